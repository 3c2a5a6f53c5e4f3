"""transformers' ``generate`` with its static cache (method ``hf_generate_static``,
inference/methods/hf_generate.py): the GPU baseline. Its tokens, its cache length per model, its untimed
warm-up where transformers compiles, and that evaluations add it on CUDA only (``Method.devices``)."""

from __future__ import annotations

import pytest
import torch

from inference.cli import EvalConfig
from inference.cli_run import eval_methods
from inference.errors import UserError
from inference.evaluation.evaluate import evaluate
from inference.prompts import Prompt
from inference.evaluation.reports import compare_markdown, markdown
from inference.methods import generate, get
from inference.methods import hf_generate as hf
from inference.runtime.model import MedusaModel
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread, tiny_llama  # noqa: F401 (autouse fixture)

NEW = 12
STATIC = "hf_generate_static"


def ids(n: int) -> list[int]:
    """A prompt of n tokens of the tiny vocabulary."""
    return [1 + i % 90 for i in range(n)]


@pytest.fixture
def tiny():
    """A fresh random fp32 Llama (its own cache-length record), EOS off so every call runs NEW tokens."""
    return MedusaModel(model=tiny_llama(vocab=96, seed=0), tokenizer=None, heads=None, eos_token_ids=[])


def test_greedy_tokens_equal_autoregressive_across_prompt_lengths(tiny):
    """Guards against the static cache (sized once per model, longer than the prompt) changing greedy tokens,
    and against the cache length changing with each prompt length (a recompile per prompt on a GPU)."""
    prompts = [ids(3), ids(40), ids(2), ids(298)]
    lengths = []
    for p in prompts:
        plain = generate(tiny, p, "autoregressive", max_new_tokens=NEW, eos_token_ids=()).tokens
        assert generate(tiny, p, STATIC, max_new_tokens=NEW).tokens == plain, len(p)
        lengths.append(hf._static[tiny.model]["length"])
    assert lengths == [256, 256, 256, 512]   # rounded up, grown once, never shrunk
    assert tiny.model._previous_max_cache_length == 512   # what transformers allocated is what was recorded
    assert get(STATIC).costs(tiny, None, 298 + NEW).extra_kv_cache_bytes > 0


def test_output_is_cut_after_the_first_eos(tiny):
    """Guards against the baseline counting tokens past EOS (transformers pads after it), which would inflate
    its tokens/s against the methods the runtime stops at EOS."""
    prompt = [1, 5, 9, 17]
    free = generate(tiny, prompt, "autoregressive", max_new_tokens=NEW, eos_token_ids=()).tokens
    eos = free[3]
    tiny.eos_token_ids = [eos]
    out = generate(tiny, prompt, STATIC, max_new_tokens=NEW)
    assert out.tokens == free[:free.index(eos) + 1] == generate(tiny, prompt, "autoregressive",
                                                                max_new_tokens=NEW).tokens
    assert out.finish_reason == "eos" and out.decode_s > 0   # GenerationOutput's reasons, as the runtime's


def test_sampling_mode_is_refused(tiny):
    """Guards against the greedy-only baseline being timed in a sampling run (it would decode greedily and be
    reported as sampling)."""
    with pytest.raises(UserError, match="greedy mode only"):
        generate(tiny, [1, 2, 3], STATIC, max_new_tokens=4, sampling=SamplingConfig(mode="sample"))
    assert STATIC not in eval_methods(EvalConfig(methods=["lookahead"], mode="sample", device="cpu"))


def test_untimed_warm_up_once_per_cache_length_where_transformers_compiles(tiny, monkeypatch):
    """Guards against the timed figure including torch.compile's first call (a warm-up per new cache length
    where transformers compiles), against a warm-up per prompt, and against one where nothing compiles (CPU)."""
    calls = []
    real = hf._generate

    def spy(m, ids, mask, max_new_tokens, eos=None, **extra):
        calls.append((ids.shape[1], max_new_tokens, extra))
        return real(m, ids, mask, max_new_tokens, eos=eos, **extra)

    monkeypatch.setattr(hf, "_generate", spy)
    generate(tiny, ids(3), STATIC, max_new_tokens=NEW)
    assert len(calls) == 1 and calls[0][2] == {"cache_implementation": "static", "max_cache_len": 256}
    monkeypatch.setattr(hf, "_compiles", lambda m: True)
    calls.clear()
    for p in (ids(3), ids(29), ids(259)):
        generate(tiny, p, STATIC, max_new_tokens=NEW)
    warm = [c for c in calls if "min_new_tokens" in c[2]]
    assert [(c[0], c[2]["max_cache_len"]) for c in warm] == [(3, 256), (259, 512)]
    assert all(c[1] == c[2]["min_new_tokens"] == NEW for c in warm)   # no more tokens than the timed call
    assert len(calls) == 5


def test_added_to_evaluations_on_cuda_only(monkeypatch):
    """Guards against every CPU evaluation (and the CI) paying for a GPU-only baseline, against CUDA runs missing
    it, and against batched runs getting a baseline they cannot decode in batches."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eval_methods(EvalConfig(methods=["lookahead"])) == ["lookahead", "autoregressive", "hf_generate"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("auto", "cuda"):
        assert eval_methods(EvalConfig(methods=["lookahead"], device=device)) == \
            ["lookahead", "autoregressive", "hf_generate", STATIC]
    assert eval_methods(EvalConfig(methods=["lookahead"], device="cpu")) == ["lookahead", "autoregressive",
                                                                             "hf_generate"]
    assert STATIC not in eval_methods(EvalConfig(methods=["lookahead"], batch_size=[2, 4]))
    assert eval_methods(EvalConfig(methods=["lookahead"], mode="sample")) == ["lookahead", "autoregressive"]


def test_explicit_method_runs_on_cpu_with_its_speedup_column():
    """Guards against methods=[hf_generate_static] being dropped on a CPU, and against the evaluation naming its
    baselines (no speedup_vs_hf_generate_static, no identity check, no report column)."""
    from medusa_train.backbone import random_backbone

    assert eval_methods(EvalConfig(methods=[STATIC], device="cpu")) == [STATIC, "autoregressive", "hf_generate"]
    bb = random_backbone({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                          "max_position_embeddings": 512}, seed=0)
    m = MedusaModel(model=bb.model.eval(), tokenizer=bb.tokenizer, heads=None)
    prompts = [Prompt(str(i), [f"say {i} {i} {i}" * (1 + 3 * i)]) for i in range(2)]
    r = evaluate(m, prompts, methods=[STATIC, "autoregressive", "hf_generate"], max_new_tokens=6, progress=False,
                 log=lambda s: None, settings={"mode": "greedy"})
    for row in r["per_method"].values():
        assert {"speedup_vs_autoregressive", "speedup_vs_hf_generate", "speedup_vs_hf_generate_static"} <= set(row)
        assert "acceptance_rate" not in row
    assert r["per_method"][STATIC]["greedy_identical_fraction"] == 1.0
    assert r["hf_generate_static_identical_fraction"] == r["hf_generate_identical_fraction"] == 1.0
    for text in (markdown(r), compare_markdown(r)):
        header = next(line for line in text.splitlines() if line.startswith("| method"))
        assert "speedup vs HF generate | speedup vs HF generate (static cache) |" in header
        widths = {line.count("|") for line in text.splitlines() if line.startswith("|")}
        assert len(widths) == 1   # every row has the header's columns


@pytest.mark.parametrize("method", ["hf_generate", STATIC])
def test_generate_baselines_stop_at_the_eos_ids_given(tiny, method):
    """Guards against the transformers baselines ignoring ``eos_token_ids`` (their runner was never given them):
    a Llama-3-style list of EOS ids must stop them where the runtime's own loop stops, and ``()`` (never stop
    early) must run past the model's own EOS, as every decoding method does."""
    prompt = ids(6)
    free = generate(tiny, prompt, "autoregressive", max_new_tokens=NEW).tokens
    stop = free[-1]
    first = free.index(stop)
    never = [t for t in range(tiny.vocab_size) if t not in free]   # ids in the vocabulary this answer never holds
    eos = [never[0], stop, never[-1]]
    expect = generate(tiny, prompt, "autoregressive", max_new_tokens=NEW, eos_token_ids=eos).tokens
    assert expect == free[:first + 1]
    assert generate(tiny, prompt, method, max_new_tokens=NEW, eos_token_ids=eos).tokens == expect
    tiny.eos_token_ids = [stop]
    assert generate(tiny, prompt, method, max_new_tokens=NEW, eos_token_ids=()).tokens == free
    assert generate(tiny, prompt, method, max_new_tokens=NEW).tokens == expect


@pytest.mark.parametrize("method", ["hf_generate", STATIC, "batch"])
def test_backbone_generation_config_does_not_change_the_baseline(tiny, method):
    """Guards against the transformers baselines inheriting the backbone's ``generation_config``: transformers
    fills every key left unset from it, so a model shipping repetition_penalty / no_repeat_ngram_size /
    min_new_tokens / num_beams / an EOS made ``hf_generate`` (static cache and batched too) another decoder than the
    greedy loop it is compared with; and ``eos_token_ids=()`` fell back to that config's EOS instead of never
    stopping early. The model's own config must come back unchanged after the call."""
    prompt = ids(6)
    free = generate(tiny, prompt, "autoregressive", max_new_tokens=NEW, eos_token_ids=()).tokens
    shipped = dict(repetition_penalty=3.0, no_repeat_ngram_size=2, min_new_tokens=2, num_beams=2,
                   eos_token_id=free[3], pad_token_id=0)
    for key, value in shipped.items():
        setattr(tiny.model.generation_config, key, value)
    tiny.eos_token_ids = [free[3]]
    expect = generate(tiny, prompt, "autoregressive", max_new_tokens=NEW).tokens
    assert expect == free[:free.index(free[3]) + 1]
    if method == "batch":
        assert hf.hf_generate_batch(tiny, [prompt], NEW).rows[0].tokens == expect
    else:
        assert generate(tiny, prompt, method, max_new_tokens=NEW, eos_token_ids=()).tokens == free
        assert generate(tiny, prompt, method, max_new_tokens=NEW).tokens == expect
    assert {k: getattr(tiny.model.generation_config, k) for k in shipped} == shipped
