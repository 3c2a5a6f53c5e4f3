"""``format=eagle3`` served by TensorRT-LLM's PyTorch backend (EagleDecodingConfig, one-model Eagle3ForCausalLM):
the export run through TensorRT-LLM's config reading, weight loading, target-layer capture and draft step as
``tests/engine_specs.py`` restates them, against our drafter; the serve commands the export prints."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine_specs import (check_trtllm_eagle3, engine_aux_features, trtllm_eagle3_aux_ids,
                          trtllm_eagle3_draft_tokens, trtllm_eagle3_forward, trtllm_eagle3_logits)
from inference.heads.eagle3 import default_aux_layers
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_eagle3_engine_flags import flagged
from test_eagle3_format import (AUX, HIDDEN, LAYERS, TOL, VOCAB, drafter, export, inputs, max_diff,
                                runtime_logits)


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def serve_options(notes) -> dict:
    """The speculative_config of the trtllm-serve note, read back (a flow-style YAML mapping of plain values)."""
    line = next(n for n in notes if n.startswith("serve: trtllm-serve"))
    body = re.search(r"speculative_config: \{(.*)\}$", line).group(1)
    out = {}
    for key, value in re.findall(r"(\w+): (\[[^\]]*\]|[^,]+)", body):
        out[key] = json.loads(value) if value.startswith("[") or value.isdigit() or value in ("true", "false") \
            else value
    return out


def trtllm_logits(params, cfg, embed, tokens, aux, positions, next_tokens):
    """``runtime_logits``' two passes through the restated TensorRT-LLM drafter; also its drafted token ids."""
    normed, state, (k, v) = trtllm_eagle3_forward(params, cfg, embed, tokens, aux, positions)
    logits, drafted = [trtllm_eagle3_logits(params, cfg, normed)], [trtllm_eagle3_draft_tokens(params, normed)]
    nxt = positions[-1] + 1 + torch.arange(2)  # the worker's next steps: position_ids + 1, the saved state
    normed, _, _ = trtllm_eagle3_forward(params, cfg, embed, next_tokens, state[-1:].expand(2, HIDDEN), nxt,
                                         past=(k, v))
    logits.append(trtllm_eagle3_logits(params, cfg, normed))
    drafted.append(trtllm_eagle3_draft_tokens(params, normed))
    return logits, drafted


def compare(d, backbone, path, seed=1):
    """(max |logit diff| over both passes, whether the drafted ids agree) of TensorRT-LLM vs our drafter."""
    params, cfg, problems = check_trtllm_eagle3(path, HIDDEN, VOCAB)
    assert problems == []
    tokens, aux, positions, nxt = inputs(seed=seed)
    embed = backbone.get_input_embeddings().weight.detach()
    theirs, drafted = trtllm_logits(params, cfg, embed, tokens, aux, positions, nxt)
    ours = runtime_logits(d, tokens, aux, positions, nxt)
    same_ids = all(torch.equal(ids.long(), o.argmax(-1)) for ids, o in zip(drafted, ours))
    return max(max_diff(a, b) for a, b in zip(ours, theirs)), same_ids


@pytest.mark.parametrize("projection", ["truncated", "own"])
def test_trtllm_loads_the_export_and_drafts_our_tokens(backbone, tmp_path, projection):
    """Guards against: an export TensorRT-LLM would load wrong or not at all (a parameter never filled: midlayer
    renamed, model. prefixed twice, q/k/v fused in another order; d2t missing when draft_vocab_size != vocab_size,
    an AssertionError at load; lm_head absent, the target's used instead), or whose draft step differs from ours
    (fc, norms, RoPE, the d2t offsets its draft_decoder adds)."""
    d = drafter(backbone, projection)
    r = export(d, tmp_path / "e")
    diff, same_ids = compare(d, backbone, r.path)
    print(f"TensorRT-LLM {projection}: max |logit diff| {diff:.2e}")
    assert diff <= TOL and same_ids


def test_the_printed_trtllm_command_captures_the_layers_the_drafter_reads(backbone, tmp_path):
    """Guards against: a TensorRT-LLM command that leaves eagle3_layers_to_capture to its default (it never reads
    the ids in config.json) or names our hidden_states ids as they are (TensorRT-LLM's ids are decoder-layer
    outputs: one lower), either of which feeds fc other target layers than the drafter was trained on; and a
    max_draft_len other than the drafter's trained depth."""
    d = drafter(backbone)
    r = export(d, tmp_path / "e")
    opts = serve_options(r.notes)
    assert opts["decoding_type"] == "Eagle3" and opts["max_draft_len"] == d.spec.num_heads
    assert opts["eagle3_layers_to_capture"] == [i - 1 for i in AUX]
    api = next(n for n in r.notes if "EagleDecodingConfig(" in n)
    assert f"eagle3_layers_to_capture={{{', '.join(str(i - 1) for i in AUX)}}}" in api
    assert f"max_draft_len={d.spec.num_heads}" in api and "speculative_model_dir=" in api
    assert trtllm_eagle3_aux_ids(opts["eagle3_layers_to_capture"], LAYERS) == tuple(AUX)
    # on the real target: what TensorRT-LLM hands fc is what our drafter reads
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        hs = backbone(ids, output_hidden_states=True).hidden_states
    ours = torch.cat([hs[i] for i in AUX], -1)
    assert torch.equal(engine_aux_features(hs, trtllm_eagle3_aux_ids(opts["eagle3_layers_to_capture"], LAYERS)), ours)


def test_trtllm_default_capture_is_eagle3s_default_layers():
    """Guards against: the restated TensorRT-LLM default (1, N//2-1, N-4) drifting from the ids our drafters
    train on by default (2, N//2, N-3), which README states serve on TensorRT-LLM with the same layers."""
    for n in (8, 16, 28, 32, 80):
        assert list(trtllm_eagle3_aux_ids(None, n)) == default_aux_layers(n), n


def test_norm_before_fc_reaches_trtllm(backbone, tmp_path):
    """Guards against: norm_before_fc written at the top level only (vLLM reads it there, TensorRT-LLM reads it
    from eagle_config only): TensorRT-LLM would build no input_norm and draft from un-normed target states."""
    d = flagged(backbone, {"norm_before_fc": True})
    r = export(d, tmp_path / "e")
    cfg = json.loads((r.path / "config.json").read_text())
    assert cfg["norm_before_fc"] is True and cfg["eagle_config"]["norm_before_fc"] is True
    diff, same_ids = compare(d, backbone, r.path, seed=3)
    assert diff <= TOL and same_ids
    assert not any("TensorRT-LLM" in n and n.startswith("note:") for n in r.notes)


@pytest.mark.parametrize("flags", [{"fc_norm": True}, {"norm_output": True}], ids=lambda f: "+".join(f))
def test_flags_trtllm_honours_run_as_ours(backbone, tmp_path, flags):
    """Guards against: fc_norm (top level) or norm_output (the post-norm state fed to the next depth) exported
    where TensorRT-LLM does not read them, so its drafts differ from ours from the first or the second depth."""
    d = flagged(backbone, flags)
    r = export(d, tmp_path / "e")
    diff, same_ids = compare(d, backbone, r.path, seed=5)
    assert diff <= TOL and same_ids


@pytest.mark.parametrize("flags, words", [
    ({"norm_before_residual": True}, "norm_before_residual"),
    ({"logit_scale": 0.5}, "logit_scale"),
    ({"norm_before_fc": True, "fc_norm": True}, "fc_norm only"),
])
def test_what_trtllm_computes_otherwise_is_said_in_the_notes(backbone, tmp_path, flags, words):
    """Guards against: a drafter TensorRT-LLM would run with other math (its decoder layer has no
    norm_before_residual, its logits no logit_scale, its apply_eagle3_fc runs fc_norm *or* input_norm) exported
    with a TensorRT-LLM command and no word; the restated engine must see the same difference."""
    d = flagged(backbone, flags)
    r = export(d, tmp_path / "e")
    note = [n for n in r.notes if n.startswith("note: TensorRT-LLM")]
    assert len(note) == 1 and words in note[0] and "serve this drafter with vLLM" in note[0]
    problems = check_trtllm_eagle3(r.path, HIDDEN, VOCAB)[2]
    assert any(p.startswith(next(iter(flags))) for p in problems), problems
