"""``graphs=`` through the evaluation and the command lines: captures made in an untimed warm-up, recorded in
report.json, and bad settings refused before anything loads."""

from __future__ import annotations

import pytest

from inference.cli import EvalConfig
from inference.cli_checks import check_decoding_keys
from inference.errors import UserError
from inference.evaluation import evaluate as ev
from inference.prompts import Prompt
from inference.runtime.model import MedusaModel
from inference.runtime.static_steps import StaticSteps
from runtime_support import one_thread  # noqa: F401 (autouse fixture)
from test_static_steps import replaying


@pytest.fixture(scope="module")
def m():
    from medusa_train.backbone import random_backbone

    bb = random_backbone({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
                          "max_position_embeddings": 512}, seed=0)
    return MedusaModel(model=bb.model.eval(), tokenizer=bb.tokenizer, heads=None)


def test_captures_happen_before_the_timed_runs_and_are_reported(m, monkeypatch):
    """Guards against capture time landing inside the first timed prompt (a captured method would look slower
    than it is) and against report.json not saying whether and what was captured."""
    m.static = StaticSteps(m, capture=replaying, log=lambda line: None)
    seen = {}
    timed = ev.decode_interleaved

    def record(*args, **kw):
        seen.update(m.static.captures)
        return timed(*args, **kw)

    monkeypatch.setattr(ev, "decode_interleaved", record)
    prompts = [Prompt(str(i), [f"count {i} " * (1 + 4 * i)]) for i in range(3)]
    report = ev.evaluate(m, prompts, methods=["prompt_lookup", "autoregressive"], max_new_tokens=12, progress=False,
                         log=lambda s: None, settings={})
    assert seen.get("1") == 1                                 # the plain step captured in the warm-up
    assert report["graphs"]["captured"] and report["graphs"]["captures"] == m.static.captures
    assert report["per_method"]["prompt_lookup"]["greedy_identical_fraction"] == 1.0
    m.static = None
    monkeypatch.undo()
    assert ev.evaluate(m, prompts[:1], methods=["autoregressive"], max_new_tokens=4, progress=False,
                       log=lambda s: None, settings={})["graphs"] == "off"


def test_second_turns_find_the_buffer_warmed_to_their_length(m, monkeypatch):
    """Guards against the warm-up sizing the KV buffer to the longest first turn under turns=both: a second turn
    (first turn + answer + question) beyond the buffer's capacity regrew it inside the timed runs, dropping
    every graph, and the recaptures and their eager checks were timed as the method's speed."""
    m.static = StaticSteps(m, capture=replaying, log=lambda line: None)
    regrown = {}
    timed = ev.decode_interleaved

    def record(*args, **kw):
        regrown["before"] = m.static.regrown
        out = timed(*args, **kw)
        regrown["after"] = m.static.regrown
        return out

    monkeypatch.setattr(ev, "decode_interleaved", record)
    prompts = [Prompt("a", ["count to three", "now " * 80]), Prompt("b", ["hi", "and then?"])]
    ev.evaluate(m, prompts, methods=["autoregressive"], max_new_tokens=8, turns="both", progress=False,
                log=lambda s: None, settings={})
    assert m.static.kv.shape[4] > 256 and regrown["after"] == regrown["before"], regrown   # beyond a first turn
    m.static = None


@pytest.mark.parametrize("keys, match", [(dict(graphs="yes"), "graphs must be one of"),
                                         (dict(graph_buckets=[4, 2]), "strictly increasing"),
                                         (dict(graphs="on", device="cpu"), "needs device=cuda")])
def test_command_lines_refuse_bad_graph_keys_before_loading(keys, match):
    """Guards against graphs= / graph_buckets= mistakes reaching the backbone load (one line, exit 2)."""
    with pytest.raises(UserError, match=match):
        check_decoding_keys(EvalConfig(**keys))

