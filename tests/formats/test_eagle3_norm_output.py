"""``norm_output`` in a published EAGLE-3 config read as the engines serve it, not as SpecForge trains it.

Two readings of the same key exist upstream:
  vLLM     vllm/model_executor/models/llama_eagle3.py LlamaModel.forward returns (norm(r'), norm(r') if norm_output
           else r'); its proposer (v1/spec_decode/eagle.py: ``last_hidden_states, hidden_states = ret_hidden_states``)
           computes logits from the first and feeds the second to the next depth; update_eagle3 (transformers_utils/
           configs/speculators/algos.py) copies the speculators top-level key, absent = false. vllm-project/speculators
           trains it so (src/speculators/models/eagle3/core.py L302-306 at c05b95b). Newer SGLang llama_eagle3.py
           (``aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux``) reads it the same way.
  SpecForge  specforge/modeling/draft/llama3_eagle.py compute_logits (L1772-1777 at a6b6b02): norm before lm_head when
           set (default true); specforge/algorithms/eagle3/model.py L386-400: the pre-norm backbone output is always
           fed back. Its configs/qwen3-30B-A3B-eagle3.1.json writes ``"fc_norm": true, "norm_output": true``.
Users serve such a dir with vLLM / SGLang, so this runtime must draft what they draft: the post-norm state fed back,
lm_head on the post-norm state at every depth. The tests restate both readings by hand (no engine_specs) and check
which one the imported drafter computes.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_eagle3_format import HIDDEN, LAYERS, VOCAB, drafter, inputs, load_with, max_diff, write_foreign
from test_eagle3_rope import our_logits as drafted   # the two depths as decoding runs them
from test_speculators_import import write_speculators

pytestmark = pytest.mark.filterwarnings("ignore:.*embed_tokens.weight ignored")  # the speculators dirs ship a copy
# configs/qwen3-30B-A3B-eagle3.1.json (SpecForge): per-layer norms on fc's input, and the key in question
SPECFORGE_31 = {"fc_norm": True, "norm_output": True}


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def specforge_31_dir(d, backbone):
    """A SpecForge EAGLE-3.1 dir (LlamaForCausalLMEagle3 layout, its two flags, ``fc_norm.{i}.weight`` around 1)."""
    write_foreign(d, backbone, config_extra=SPECFORGE_31)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]  # what SpecForge's save_pretrained writes
    (d / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(d / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    t.update({f"fc_norm.{i}.weight": 1 + 0.5 * torch.randn(HIDDEN, generator=g) for i in range(3)})
    save_file(t, str(d / "model.safetensors"))
    return d


def by_hand(d, tokens, aux, positions, nxt, *, feed_back: str):
    """Two depths of the imported drafter's modules, written out: depth 1 over the context rows (fc over the aux
    states), depth 2 from the last row's state, ``feed_back`` "post" = norm(r') (vLLM / speculators / newer SGLang)
    or "pre" = r' (SpecForge's TTT loop); lm_head over norm(r') at both depths (vLLM's compute_logits input, and
    SpecForge's with its norm_output true). Draft-vocab logits."""
    saved, d.norm_output = d.norm_output, False  # forward_step's second output is then r', whatever the config
    try:
        with torch.no_grad():
            normed, pre, kv = d.forward_step(tokens[None], d.combine(aux)[None], positions[None])
            first = d.lm_head(d.norm(pre))[0]
            assert max_diff(first, d.lm_head(normed)[0]) == 0.0
            state = d.norm(pre) if feed_back == "post" else pre
            hidden = state[:, -1:].expand(1, 2, HIDDEN)
            at = positions[-1] + 1 + torch.arange(2)
            _, pre2, _ = d.forward_step(nxt[None], hidden, at[None], past=kv)
            return [first, d.lm_head(d.norm(pre2))[0]]
    finally:
        d.norm_output = saved


def test_a_specforge_31_dir_drafts_as_vllm_serves_it_not_as_specforge_trained_it(backbone, tmp_path):
    """Guards against: ``norm_output`` read as SpecForge's trainer reads it (norm before lm_head, the pre-norm state
    always fed back, false = lm_head on the un-normed state), which would draft a SpecForge EAGLE-3.1 dir otherwise
    than vLLM and SGLang serve it (they feed norm(r') back for it and never take the norm off lm_head's input);
    and against the flag being dropped on import of that layout."""
    d = load_with(backbone, specforge_31_dir(tmp_path / "sf", backbone))
    assert d.norm_output is True and d.fc_norm is not None
    tokens, aux, positions, nxt = inputs(seed=7)
    ours = drafted(d, tokens, aux, positions, nxt)
    served = by_hand(d, tokens, aux, positions, nxt, feed_back="post")
    trained = by_hand(d, tokens, aux, positions, nxt, feed_back="pre")
    assert all(max_diff(a, b) <= 1e-6 for a, b in zip(ours, served))
    assert max_diff(ours[0], trained[0]) <= 1e-6  # the first depth reads the backbone's features: no difference
    assert max_diff(ours[1], trained[1]) > 1e-3  # the continuation is where the two readings part


@pytest.mark.parametrize("flag", [True, False])
def test_lm_head_reads_the_post_norm_state_whatever_the_flag(backbone, tmp_path, flag):
    """Guards against: ``norm_output: false`` taken to mean lm_head over the un-normed state (SpecForge's
    compute_logits); vLLM's compute_logits always receives norm(r') (LlamaModel.forward's first output), so the
    first depth of a dir must draft the same with the flag set, unset or absent."""
    write_foreign(tmp_path / "plain", backbone)
    write_foreign(tmp_path / "f", backbone, config_extra={"norm_output": flag})
    plain, flagged = load_with(backbone, tmp_path / "plain"), load_with(backbone, tmp_path / "f")
    assert flagged.norm_output is flag and plain.norm_output is False
    tokens, aux, positions, nxt = inputs(seed=8)
    a, b = drafted(plain, tokens, aux, positions, nxt), drafted(flagged, tokens, aux, positions, nxt)
    assert max_diff(a[0], b[0]) == 0.0 and max_diff(b[0], by_hand(flagged, tokens, aux, positions, nxt,
                                                                  feed_back="post")[0]) <= 1e-6
    assert (max_diff(a[1], b[1]) > 1e-3) is flag


@pytest.mark.parametrize("top, expected", [({"norm_output": True}, True), ({}, False)], ids=["set", "absent"])
def test_a_speculators_dir_feeds_back_what_vllm_feeds_back(backbone, tmp_path, top, expected):
    """Guards against: the speculators top-level ``norm_output`` (what its trainer sets by default for eagle3 and vLLM's
    update_eagle3 copies, absent = false) lost or defaulted otherwise on import, so the drafter would feed back
    another state than speculators trained and vLLM serves."""
    src = drafter(backbone, aux=[1, 3, 6], seed=4)
    d = load_with(backbone, write_speculators(tmp_path / "s", backbone, src, top=top))
    assert d.norm_output is expected
    tokens, aux, positions, nxt = inputs(seed=9)
    want = by_hand(d, tokens, aux, positions, nxt, feed_back="post" if expected else "pre")
    assert all(max_diff(a, b) <= 1e-6 for a, b in zip(drafted(d, tokens, aux, positions, nxt), want))
