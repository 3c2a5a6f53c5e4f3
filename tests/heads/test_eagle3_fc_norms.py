"""The EAGLE-3 flags on fc's input (``norm_before_fc``: one RMSNorm over the 3H concat, ``input_norm``;
``fc_norm``: one RMSNorm per aux layer, ``fc_norm.{i}``; both: input_norm first, as vLLM's
``combine_hidden_states`` orders them) computed exactly as restated here, off by default (our trainer's
drafters unchanged), and permuted with fc when a drafter's aux ids are put in the engines' order."""

from __future__ import annotations

import pytest
import torch

from inference.heads.eagle3 import Eagle3Drafter, draft_layer_config
from inference.heads.spec import HeadsSpec
from runtime_support import one_thread, tiny_llama  # noqa: F401  (one_thread: autouse fixture)
from test_eagle3_aux_layers import randomized

VOCAB, HIDDEN, LAYERS = 96, 64, 8
FLAGS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_fc": True, "fc_norm": True}]


@pytest.fixture(scope="module")
def backbone():
    return tiny_llama(vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def drafter(backbone, flags: dict, aux=(1, 2, 4), seed=0) -> Eagle3Drafter:
    """Every weight random, the norms' weights around 1 (a norm of ones would hide which block it scales)."""
    spec = HeadsSpec(num_heads=2, num_layers=1, hidden_size=HIDDEN, vocab_size=VOCAB, base_model="org/tiny",
                     kind="eagle3", aux_layers=list(aux), draft_layer={**draft_layer_config(backbone.config), **flags})
    return randomized(Eagle3Drafter(spec), backbone, seed)


def restated_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (vLLM's ``RMSNorm.forward_native``): statistics in float32, scaled in the input dtype."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def restated_combine(state: dict, aux: torch.Tensor, flags: dict, eps: float) -> torch.Tensor:
    """fc's input as vLLM's ``combine_hidden_states`` norms it: input_norm over the 3H concat, then fc_norm.{i}
    over each layer's H block, then fc."""
    if flags.get("norm_before_fc"):
        aux = restated_rms(aux, state["input_norm.weight"], eps)
    if flags.get("fc_norm"):
        aux = torch.cat([restated_rms(block, state[f"fc_norm.{i}.weight"], eps)
                         for i, block in enumerate(aux.chunk(3, -1))], -1)
    return aux @ state["fc.weight"].T


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f))
def test_the_norms_on_fcs_input_compute_the_restated_math(backbone, flags):
    """Guards against: ``norm_before_fc`` / ``fc_norm`` in a drafter's draft_layer ignored (g = fc(aux) as without
    them: the drafts of a speculators-trained drafter, which sets norm_before_fc by default, would be garbage), the
    per-layer norms applied to other blocks than their layer's, or the two applied in the other order."""
    d = drafter(backbone, flags)
    state, eps = d.state_dict(), d.spec.settings.draft_layer["rms_norm_eps"]
    assert {"input_norm.weight": "norm_before_fc" in flags, "fc_norm.2.weight": "fc_norm" in flags} == \
        {n: n in state for n in ("input_norm.weight", "fc_norm.2.weight")}
    scales = torch.tensor([1.0, 30.0, 0.1]).repeat_interleave(HIDDEN)  # layers of very different sizes, as targets have
    aux = torch.randn(2, 5, 3 * HIDDEN, generator=torch.Generator().manual_seed(1)) * scales
    with torch.no_grad():
        ours, theirs = d.combine(aux), restated_combine(state, aux, flags, eps)
        plain = aux @ state["fc.weight"].T
    assert float((ours - theirs).abs().max()) <= 1e-6
    assert float((ours - plain).abs().max()) > 1e-2
    if len(flags) == 2:  # the other order computes something else: the test tells them apart
        blocks = [restated_rms(b, state[f"fc_norm.{i}.weight"], eps) for i, b in enumerate(aux.chunk(3, -1))]
        swapped = restated_rms(torch.cat(blocks, -1), state["input_norm.weight"], eps) @ state["fc.weight"].T
        assert float((ours - swapped).abs().max()) > 1e-3


def test_the_norms_take_their_statistics_in_float32(backbone):
    """Guards against: the norms on fc's input computed in the features' dtype (fp16: the squares of a 300-sized
    activation overflow to inf and the features to zeros), unlike the drafter's other norms and vLLM's."""
    d = drafter(backbone, {"norm_before_fc": True, "fc_norm": True})
    aux = torch.randn(1, 3, 3 * HIDDEN, generator=torch.Generator().manual_seed(2)) * 300
    with torch.no_grad():
        state = d.state_dict()
        half = {k: v.half() for k, v in state.items() if k in ("input_norm.weight", "fc.weight")
                or k.startswith("fc_norm.")}
        d.half()
        ours = d.combine(aux.half())
        theirs = restated_combine(half, aux.half(), {"norm_before_fc": True, "fc_norm": True},
                                  d.spec.settings.draft_layer["rms_norm_eps"])
    assert torch.isfinite(ours).all() and bool((ours != 0).any())
    assert float((ours.float() - theirs.float()).abs().max()) <= 1e-2


def test_off_by_default_so_trained_drafters_keep_their_weights(backbone):
    """Guards against: the norms built for drafters that do not set the flags (our trainer's): extra weights in
    their checkpoints and exports (vLLM would refuse fc_norm.*) and fc's input normed where training never did."""
    d = drafter(backbone, {})
    names = set(d.state_dict())
    assert d.input_norm is None and d.fc_norm is None
    assert not any(n.startswith(("input_norm.", "fc_norm.")) for n in names)
    aux = torch.randn(4, 3 * HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(d.combine(aux), d.fc(aux))


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "+".join(f))
def test_out_of_order_aux_ids_permute_the_norms_with_fc(backbone, flags):
    """Guards against: a drafter whose aux ids are out of order (fc's column blocks in that order) put in the
    engines' ascending order with fc permuted but its per-layer norms (or input_norm's blocks) left where they
    were, so each layer is normed with another layer's weights."""
    aux_ids = [4, 1, 2]
    d = drafter(backbone, flags, aux=aux_ids, seed=5)
    feats = {i: torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(10 + i)) * (1 + i) for i in aux_ids}
    trained = restated_combine(d.state_dict(), torch.cat([feats[i] for i in aux_ids], -1), flags,
                               d.spec.settings.draft_layer["rms_norm_eps"])  # what it was trained to compute
    with torch.no_grad():
        d.canonicalize("test")
        assert d.spec.settings.aux_layers == [1, 2, 4]
        served = d.combine(torch.cat([feats[i] for i in sorted(aux_ids)], -1))  # the layers as the engines feed them
    assert float((trained - served).abs().max()) <= 1e-5
