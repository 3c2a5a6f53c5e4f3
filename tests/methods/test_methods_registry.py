"""The decoding-method registry (inference/methods/registry.py): a method registered in one place
runs through ``generate`` / ``stream`` and the interleaved ``evaluate`` with nothing else edited;
unknown names and the removed ``method=`` key are refused in one line."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from inference.cli import EvalConfig
from inference.cli_run import eval_methods
from inference.errors import UserError
from inference.evaluation.evaluate import evaluate
from inference.prompts import Prompt
from inference.methods import generate, names, stream
from inference.methods.registry import kv_bytes_per_token, unregister
from inference.runtime.model import MedusaModel

from runtime_support import one_thread  # noqa: F401 (autouse fixture)

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 512}


# -- a toy method: everything adding a method takes (counted in the README's "adding a method") --
from inference.methods.draft import verify_chain  # noqa: E402
from inference.methods.registry import Method, register, slot_costs  # noqa: E402
from inference.runtime.decode import prefill_token, seeded_generator  # noqa: E402


@dataclass
class EchoOptions:
    n: int = 2


class EchoDecoder:
    """Proposes the root token n times; the chain verification keeps what the target agrees with."""

    def __init__(self, m, options, sampling, seed):
        self.m, self.n, self.cfg, self.gen = m, options.n, sampling, seeded_generator(m.device, seed)

    def prefill(self, prompt, max_new_tokens):
        self.past = prompt.shape[1]
        self.cache = self.m.new_cache(self.past + max_new_tokens + self.n + 1)
        _, self.root = prefill_token(self.m, prompt, self.cache, self.cfg, self.gen)
        return self.root

    def step(self):
        accepted, bonus = verify_chain(self.m, self.cache, self.past, self.root, [self.root] * self.n, self.cfg,
                                       self.gen)
        self.past, self.root = self.past + 1 + len(accepted), bonus
        return accepted + [bonus], self.n


@pytest.fixture
def echo():
    register(Method("echo", "repeat the root token", EchoOptions, decoder=EchoDecoder,
                    costs=lambda m, o, run_length: slot_costs(m, o.n + 1)))
    yield "echo"
    unregister("echo")


# -- the tests ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from medusa_train.backbone import random_backbone

    bb = random_backbone(TINY, seed=0)
    return MedusaModel(model=bb.model.eval(), tokenizer=bb.tokenizer, heads=None)


def test_a_registered_method_runs_through_generate_and_stream(tiny, echo):
    """Guards against generate/stream knowing a fixed list of methods (a new method needing edits
    elsewhere), and against the shared driver losing greedy identity for a new Decoder."""
    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    plain = generate(tiny, prompt, "autoregressive", max_new_tokens=20, eos_token_ids=())
    out = generate(tiny, prompt, echo, n=3, max_new_tokens=20, eos_token_ids=())
    assert out.tokens == plain.tokens and out.proposed and set(out.proposed) == {3}
    s = stream(tiny, prompt, echo, max_new_tokens=20, eos_token_ids=())
    assert [t for chunk in s for t in chunk] == plain.tokens == s.result.tokens
    with pytest.raises(UserError, match="no option 'k'"):
        generate(tiny, prompt, echo, k=3)


def test_a_registered_method_runs_in_evaluate_with_the_baselines_and_costs(tiny, echo):
    """Guards against evaluate hard-coding its methods: a new one must run interleaved with the
    baselines, be summarised like the others and have its costs and options reported."""
    prompts = [Prompt(str(i), [f"say {i} {i} {i}"]) for i in range(2)]
    r = evaluate(tiny, prompts, methods=[echo, "autoregressive", "hf_generate"], max_new_tokens=6,
                 progress=False, log=lambda s: None, options={echo: EchoOptions(n=4)})
    row = r["per_method"][echo]
    assert row["greedy_identical_fraction"] == 1.0 and 0 <= row["acceptance_rate"] <= 1
    assert row["proposed_per_step"] == 4.0 and "speedup_vs_hf_generate" in row
    assert r["costs"][echo]["extra_kv_cache_bytes"] == 5 * kv_bytes_per_token(tiny)
    assert r["method_options"][echo] == {"n": 4}


def test_unknown_method_is_refused_in_one_line_listing_the_registered_ones(tiny):
    """Guards against a typo in a method name failing late, with a traceback, or without saying
    which names exist."""
    with pytest.raises(UserError) as e:
        generate(tiny, [1, 2, 3], "beam")
    msg = str(e.value)
    assert "\n" not in msg and "unknown method 'beam'" in msg and all(n in msg for n in names())


def test_method_key_on_medusa_eval_is_refused_in_one_line():
    """Guards against the removed method= key being silently ignored (or half-supported) beside
    methods=: it is refused in one line that points to methods=[...]."""
    with pytest.raises(UserError, match=r"methods=\["):
        eval_methods(EvalConfig(method="draft"))
    code = "import sys; from inference.cli import eval_main; eval_main(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, "method=draft"], capture_output=True, text=True, timeout=180)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "methods=[" in lines[0], proc.stderr


def test_baselines_are_added_and_hf_generate_only_in_greedy_mode():
    """Guards against methods= losing the baselines the speedups need, or adding the greedy-only
    transformers baseline in sampling mode."""
    assert eval_methods(EvalConfig(methods=["lookahead"])) == ["lookahead", "autoregressive", "hf_generate"]
    assert eval_methods(EvalConfig(methods=["lookahead"], mode="sample")) == ["lookahead", "autoregressive"]
    assert eval_methods(EvalConfig(heads="h")) == ["medusa", "autoregressive", "hf_generate"]
