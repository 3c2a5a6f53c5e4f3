"""What report.json's ``graphs`` (``StaticSteps.summary``) says was captured."""

from __future__ import annotations

from inference.methods import generate
from inference.runtime.static_steps import StaticSteps, apply_graphs
from runtime_support import one_thread, random_heads, tiny_llama, wrap  # noqa: F401 (autouse fixture)
from test_static_steps import REPEATING, replaying


def test_the_report_counts_a_draft_models_captures():
    """Guards against report.json's ``graphs`` leaving out the draft model's static steps (method ``draft``): its
    own buffer's steps and their capture time and memory were captured beside the target's and reported nowhere,
    so the record said fewer graphs, less capture time and less graph memory than the run made; and against a
    self-draft's steps made anew (and dropped) at every generate being listed until garbage collection."""
    model = tiny_llama(vocab=96, seed=0)
    m = wrap(model, random_heads(model, num_heads=3, seed=1))
    m.static = StaticSteps(m, capture=replaying, log=lambda line: None)
    for _ in range(4):   # one self-draft, rebuilt at every generate, on the same steps
        generate(m, REPEATING, "draft", draft="self:1", k=3, max_new_tokens=20, eos_token_ids=())
    (draft,) = m.static.summary()["draft_models"]
    assert draft["captures"].get("1") == 1 and draft["capture_s"] > 0 and draft["failed_captures"] == 0
    apply_graphs(m, "uncaptured")                          # on CPU: a static buffer, nothing captured, said so
    generate(m, REPEATING, "draft", draft="self:1", k=3, max_new_tokens=20, eos_token_ids=())
    summary = m.static.summary()
    assert not summary["captured"] and summary["captures"] == {} and summary["graph_memory_bytes"] == 0
    assert [d["captures"] for d in summary["draft_models"]] == [{}]
    m.static = None
