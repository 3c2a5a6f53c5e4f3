"""The backbone's attention during decoding: transformers' SDPA, with masked grouped-query attention in the
kernel on CPU and folded into query rows on CUDA (no repeated keys and values either way).

Tree verification (and batched decoding) calls attention with an explicit mask and several query rows.
transformers' ``sdpa_attention_forward`` then repeats every key/value head (``repeat_kv``) to the number of
query heads before calling SDPA, because CUDA's fused kernels cannot combine a mask with grouped-query
attention; a one-row call without a mask (the plain loop) takes a path without the copy. On CPU that copy
is the whole KV cache, per layer, per verification step: for SmolLM2 (3 key/value heads for 9 query heads)
a 2-8-row verification forward is 2-3 ms (4-5%) cheaper without it at a 250-token context and 7-10 ms
(9-15%) at 1,000 tokens (``python scripts/bench.py tree-attention``). torch's CPU kernel takes the mask and
``enable_gqa=True`` together and gives bit-identical outputs (it indexes the shared head instead of reading
a copy), so on CPU this module calls it that way.

On CUDA the groups are folded instead (``FOLD_GROUPS``): a masked call with grouped-query attention runs as one SDPA
call over the key/value heads, each carrying the query rows of its G query heads ([B, Hkv, G*n, D] queries, the mask
repeated G times over a tree's rows; a longer call, a prompt's, attends per group instead), so no key/value is
copied (transformers 5.25 packs one-row calls so itself; multi-row calls it copies). With static steps (``graphs=``)
every step is masked over the whole capacity, the plain loop's too: at Llama-3.1-8B's shape (8 key/value heads for
32 query heads) transformers' copy writes 4x the KV cache and attention reads it back, per layer per step (~2 GB a
step at 2,048 slots, by arithmetic). The GPU check times both ways (``benchmarks/gpu_gqa.py``).
Every CUDA call runs without torch's cuDNN SDPA backend (``inference.attention_backends``: it plans a graph
per new key length, 1.4 ms of host time per call in a decoding loop).

Everything else (other devices, one row on CPU, no mask, soft-capping, position biases, attention sinks) goes to
transformers' own function unchanged. ``use_decoding_attention`` installs it on a model loaded with
``attn_implementation="sdpa"`` under its own registered name (masks are built exactly as for ``sdpa``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention_backends import decoding_sdpa, folded_attention

NAME = "medusa_sdpa"
FOLD_GROUPS = True   # on CUDA, masked grouped-query calls fold the groups into query rows (module docstring)

# Keyword arguments that change the attention's math beyond (mask, scale, dropout): delegate when present.
_DELEGATE_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "head_mask")


def _sdpa_forward():
    """transformers' function, looked up per call so that tests can watch what is handed to it."""
    return sdpa_attention_forward


def decoding_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: ``query`` [B, Hq, n, D], ``key``/``value`` [B, Hkv, S, D];
    returns ([B, n, Hq, D], None) like ``sdpa_attention_forward``."""
    groups = getattr(module, "num_key_value_groups", 1)
    grouped = (groups > 1 and attention_mask is not None and key.shape[-1] == value.shape[-1]
               and not any(kwargs.get(k) is not None for k in _DELEGATE_KWARGS))
    if grouped and query.shape[2] > 1 and query.device.type == "cpu":
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=False, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if grouped and FOLD_GROUPS and query.device.type == "cuda" and attention_mask.shape[1] == 1:
        with decoding_sdpa(query.device):
            return folded_attention(query, key, value, attention_mask, dropout, scaling), None
    with decoding_sdpa(query.device):
        return _sdpa_forward()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                               is_causal=is_causal, **kwargs)


def _register() -> None:
    # lazy: 2.5 s to import (transformers.modeling_utils), here once a loaded model has brought them in
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, decoding_attention_forward)
    # Masks are built as for sdpa; a name without a mask function would get no mask at all.
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def _configs_using(model, impl: str) -> list:
    """The distinct config objects of ``model`` and its modules (multimodal wrappers hold their own) whose
    attention implementation is ``impl``."""
    configs = {id(c): c for c in (getattr(sub, "config", None) for sub in model.modules()) if c is not None}
    return [c for c in configs.values() if getattr(c, "_attn_implementation", None) == impl]


def use_decoding_attention(model) -> None:
    """Switch ``model`` (and its sub-configs) from ``sdpa`` to this module's function, in place; other
    implementations (eager) are left as they are."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    _register()
    for cfg in _configs_using(model, "sdpa"):
        cfg._attn_implementation = NAME


@contextmanager
def transformers_attention(model):
    """Within: ``model`` attends with transformers' own sdpa again (the ``generate`` baseline times what a
    user of transformers gets)."""
    switched = _configs_using(model, NAME)
    for cfg in switched:
        cfg._attn_implementation = "sdpa"
    try:
        yield
    finally:
        for cfg in switched:
            cfg._attn_implementation = NAME
