"""Batch sizing's timed steps capture the buckets later generations replay: under the rule they will replay with."""

from __future__ import annotations

import random

import torch

from inference.methods import generate_batch
from inference.methods.medusa import HeadsDrafter
from inference.runtime.sizing import size_speculation
from inference.runtime.static_steps import StaticSteps
from inference.runtime.tree import resolve_tree
from runtime_support import one_thread, random_heads, wrap  # noqa: F401 (autouse fixture)
from test_position_limits import phi3_longrope


def freezing(switch):
    """A CPU stand-in for ``cuda_capture`` that also freezes what a CUDA graph freezes of the LongRoPE switch: the
    Python branch (``per_position``) taken at capture, whichever rule is in force at a replay."""
    def capture(fn, pool):
        frozen = switch.per_position
        outs = fn()

        def replay():
            live, switch.per_position = switch.per_position, frozen
            try:
                new = fn()
            finally:
                switch.per_position = live
            for o, n in zip(outs, new):
                o.copy_(n)
        return replay, outs
    return capture


def test_batch_sizing_captures_steps_under_the_per_position_longrope_rule():
    """Guards against per-batch sizing (``choice=auto`` batched, ``runtime.sizing._BatchTimer``) stepping outside
    ``MedusaModel.stepping``: its timed steps are the first to capture the (batch, rows) buckets, so the graphs froze
    LongRoPE's prompt rule (a step straddling the switch rotated whole with the long factors), and every later
    generation replaying them decoded other tokens than graphs=off (6 of 6 seeds on a Phi-3-shaped backbone)."""
    tree = resolve_tree("chain3", 3)
    for seed in range(2):
        model = phi3_longrope(seed)                       # switch at position 24
        m = wrap(model, random_heads(model, num_heads=3, seed=1))
        rng = random.Random(seed)
        prompts = [[rng.randrange(96) for _ in range(rng.randrange(15, 22))] for _ in range(2)]
        ref = [r.tokens for r in generate_batch(m, prompts, "medusa", tree=tree, max_new_tokens=20,
                                                eos_token_ids=()).rows]
        m.static = StaticSteps(m, capture=freezing(m._rope_switch), log=lambda line: None)
        with torch.inference_mode():
            size_speculation(m, {"chain3": (tree, 2.0)}, lambda t: HeadsDrafter(m, t), prompts, [2], what="trees",
                             latency_steps=3, warmup=1, min_rounds=1, max_rounds=1, log=lambda line: None)
        assert m.static.captures.get("2x4") == 1          # the tree's bucket was captured by the timed steps
        out = generate_batch(m, prompts, "medusa", tree=tree, max_new_tokens=20, eos_token_ids=()).rows
        assert [r.tokens for r in out] == ref
        m.static = None


def test_a_step_outside_stepping_is_never_captured_on_a_longrope_backbone():
    """Guards against any caller that times ``BatchTreeDecoder.step`` bare (outside ``MedusaModel.stepping``, as the
    GPU check's batch timing did) capturing a bucket under LongRoPE's prompt rule: every later replay of that bucket
    would rotate a step straddling the switch with the long factors. Such a step runs uncaptured; the same step
    inside ``stepping`` is captured and replayed as before."""
    from inference.runtime.batch_decode import BatchTreeDecoder

    tree = resolve_tree("chain3", 3)
    model = phi3_longrope(0)
    m = wrap(model, random_heads(model, num_heads=3, seed=1))
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    ref = [r.tokens for r in generate_batch(m, prompts, "medusa", tree=tree, max_new_tokens=20,
                                            eos_token_ids=()).rows]
    m.static = StaticSteps(m, capture=freezing(m._rope_switch), log=lambda line: None)
    with torch.inference_mode():
        dec = BatchTreeDecoder(m, HeadsDrafter(m, tree))
        dec.prefill(prompts, 20)
        for _ in range(3):
            dec.step()
    assert m.static.captures == {}
    out = generate_batch(m, prompts, "medusa", tree=tree, max_new_tokens=20, eos_token_ids=()).rows
    assert [r.tokens for r in out] == ref and m.static.captures.get("2x4") == 1
    m.static = None


def test_a_longrope_draft_model_captures_its_own_steps():
    """Guards against a separate LongRoPE draft checkpoint (not a self-draft) stepping outside its own
    ``MedusaModel.stepping``: the decode loops enter the target's alone, so every draft step ran under the prompt rule
    and, on a GPU, uncaptured (and uncounted). Its steps now capture, at batch 1 and batched, with the tokens of
    graphs off; the self-draft, which shares the target's switch, still leaves the target's rule in force after its
    steps (``stepping`` is re-entrant)."""
    from inference.methods import generate

    model = phi3_longrope(0)
    m = wrap(model, None)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    for batched in (False, True):
        def run(draft):
            if batched:
                return [r.tokens for r in generate_batch(m, prompts, "draft", draft=draft, k=3, max_new_tokens=16,
                                                         eos_token_ids=()).rows]
            return generate(m, prompts[0], "draft", draft=draft, k=3, max_new_tokens=16, eos_token_ids=()).tokens
        draft = wrap(phi3_longrope(1), None)
        ref = run(draft)
        m.static = StaticSteps(m, capture=freezing(m._rope_switch), log=lambda line: None)
        draft.static = StaticSteps(draft, capture=freezing(draft._rope_switch), log=lambda line: None)
        assert run(draft) == ref and draft.static.captures, batched
        m.static = draft.static = None


def test_stepping_is_reentrant_for_a_self_draft_sharing_the_switch():
    """Guards against a self-draft (the target's first layers, the same rotary module and switch) entering
    ``stepping`` inside the target's: leaving it reset the shared switch to the prompt rule, so the target's
    verification forward that followed rotated a step straddling the switch whole with the long factors and, on a
    GPU, ran uncaptured."""
    model = phi3_longrope(0)
    m = wrap(model, None)
    switch = m._rope_switch
    with m.stepping():
        with m.stepping():
            assert switch.per_position
        assert switch.per_position
    assert not switch.per_position
