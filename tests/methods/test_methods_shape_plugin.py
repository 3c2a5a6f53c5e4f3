"""A decoding method registered at run time, with a tunable speculation shape (a chain whose length is chosen),
plugs into ``choice=auto``, the one choice file and the command-line keys without touching a shared file
(``methods/shape.py``: the evaluation and the CLI ask the method's shape and never name it)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest

from inference.cli_keys import EvalKeys, keys_help, schema
from inference.cli_support import parse_overrides
from inference.evaluation.batch_eval import evaluate_batched
from inference.prompts import Prompt
from inference.methods import generate, generate_batch
from inference.methods import chain_choice
from inference.methods.chain_choice import ChainShape
from inference.methods.choice_file import read_choice, write_choice
from inference.methods.draft import chain_sampling
from inference.methods.prompt_lookup import LookupDrafter, PromptLookupDecoder, PromptLookupSettings
from inference.methods.registry import Method, option, options_from_keys, register, unregister
from inference.runtime import sizing as runtime_sizing
from inference.runtime.batch_decode import BatchTreeDecoder
from inference.runtime.race import PLAIN
from inference.runtime.verify import SamplingConfig

from runtime_support import one_thread  # noqa: F401 (autouse fixture)
from test_batch_methods import m  # noqa: F401 (fixture: a tiny backbone without heads)

TOY = "toy_chain"


@dataclass
class ToyChainOptions(PromptLookupSettings):
    """A toy: prompt lookup under its own name and key (what matters here is its shape, not its drafts)."""

    num_tokens: int = option(4, "toy_chain_tokens", "most tokens the toy chain proposes per step")


@pytest.fixture
def toy():
    register(Method(TOY, "a toy chain method (tests only)", ToyChainOptions,
                    decoder=lambda mm, o, sampling, seed: PromptLookupDecoder(mm, o, sampling, seed),
                    batch_decoder=lambda mm, o, sampling, seed, ragged: BatchTreeDecoder(
                        mm, LookupDrafter(mm, o), chain_sampling(sampling or SamplingConfig()), seed, ragged),
                    shape=ChainShape("num_tokens", varying=True)))
    yield TOY
    unregister(TOY)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(2)
    return [[rng.randrange(6) for _ in range(n)] for n in (3, 40, 9, 80, 20)]


def test_its_keys_are_generated_checked_and_documented(toy):
    """Guards against a method option the command line cannot reach (no key in the schema), cannot check
    (no type: a word where a number belongs reaching the decoder) or does not document (--help)."""
    cfg = parse_overrides("medusa-eval", schema("EvalConfig", EvalKeys), [f"methods=[{toy}]", "toy_chain_tokens=3"])
    assert options_from_keys(toy, cfg).num_tokens == 3
    assert options_from_keys(toy, parse_overrides("medusa-eval", schema("E", EvalKeys), [])).num_tokens == 4
    with pytest.raises(SystemExit):
        parse_overrides("medusa-eval", schema("EvalConfig", EvalKeys), ["toy_chain_tokens=many"])
    assert "toy_chain_tokens (default 4; toy_chain): most tokens the toy chain proposes per step" in keys_help()


def test_choice_auto_sizes_it_and_its_choice_file_decodes_it(toy, m, prompts, monkeypatch, tmp_path):  # noqa: F811
    """Guards against a plug-in's shape being skipped by choice=auto (its chain length never sized), its
    choice recorded nowhere, or its choice file not decoding as the evaluation measured: each batch size's
    chain, and greedy rows identical to plain greedy decoding."""
    def fake_race(taus, timer, *, what, **kw):   # chains pay at batch 1 only (controlled step times)
        b = int(what.rsplit(" ", 1)[1])
        step = {PLAIN: 0.01, **{n: 0.01 * (1 + (0.0 if b == 1 else 5.0) * int(n[5:])) for n in taus}}
        return step, {n: {"step_ms": s * 1e3} for n, s in step.items()}, {"rounds": 1}

    monkeypatch.setattr(runtime_sizing, "race", fake_race)
    # controlled calibration too: each step would accept 2 of the longest chain's drafts (tau 3 at 2+ tokens)
    monkeypatch.setattr(chain_choice, "measure_chain_acceptance", lambda *a, **k: [2, 2, 2])
    monkeypatch.setattr(type(m), "encode_chat", lambda self, text: prompts[int(text)])
    items = [Prompt(id=str(i), turns=[str(i)]) for i in range(len(prompts))]
    chosen: dict = {}
    r = evaluate_batched(m, items, methods=[toy], batch_sizes=[2], max_new_tokens=8, calibration_prompts=1,
                         calibration_tokens=8, progress=False, log=lambda s: None, choice="auto", chosen=chosen)
    record = r["batched"]["speculation"][toy]
    assert record["chain"] == "auto" and record["schedule"]["2"] == "plain" and record["schedule"]["1"] != "plain"
    assert r["batched"]["per_batch_size"]["2"]["per_method"][toy]["greedy_identical"] is True
    made = chosen[toy]
    assert made.measured and made.options.schedule is made.schedule

    path = write_choice(tmp_path, toy, made, made.options)
    saved = read_choice(str(path), None, [toy], lambda method: options_from_keys(method, object()))
    assert saved.method == toy and saved.schedule.to_dict() == made.schedule.to_dict()
    shape = ChainShape("num_tokens")
    batched = shape.apply(ToyChainOptions(), saved.schedule, True)
    out = generate_batch(m, prompts[:3], toy, options=batched, max_new_tokens=8, eos_token_ids=())
    plain = [generate(m, p, "autoregressive", max_new_tokens=8, eos_token_ids=()).tokens for p in prompts[:3]]
    assert [row.tokens for row in out.rows] == plain
    alone = shape.apply(ToyChainOptions(), saved.schedule, False)
    assert alone.num_tokens == saved.schedule.choices[1].num_nodes - 1 and alone.schedule is None
    assert shape.static_shapes(saved.schedule)[2] == (1, 0)   # plain at batch 2: a 1-row step


def test_choice_fixed_keeps_its_set_length(toy, m, prompts, monkeypatch):  # noqa: F811
    """Guards against choice=fixed still sizing a plug-in (or holding calibration prompts out)."""
    monkeypatch.setattr(runtime_sizing, "race", lambda *a, **k: pytest.fail("sized at choice=fixed"))
    monkeypatch.setattr(type(m), "encode_chat", lambda self, text: prompts[int(text)])
    items = [Prompt(id=str(i), turns=[str(i)]) for i in range(len(prompts))]
    r = evaluate_batched(m, items, methods=[toy], batch_sizes=[2], max_new_tokens=6, progress=False,
                         log=lambda s: None, choice="fixed",
                         options={toy: dataclasses.replace(ToyChainOptions(), num_tokens=3)})
    assert r["batched"]["num_prompts"] == len(prompts)
    assert r["batched"]["speculation"][toy] == {"chain": "fixed", "schedule": {"2": "chain4"}, "sizing": None}
