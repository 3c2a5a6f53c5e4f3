"""EAGLE-3 drafters: one Llama decoder layer over three backbone layers and the next token.

The drafter (arXiv 2503.01840; the math vLLM's and SGLang's ``llama_eagle3.py`` run):

  g_t   = fc([a_t^low; a_t^mid; a_t^high])                     3H -> H, the backbone's features at t
  x     = [input_layernorm(e(x_{t+1})); hidden_norm(g)]         2H: the next token's embedding first
  r     = g + o_proj(attn(q/k/v_proj(x)))                       RoPE at the drafter's position, GQA
  r'    = r + mlp(post_attention_layernorm(r))                  SwiGLU
  out   = norm(r')  -> lm_head -> the draft vocabulary          guesses x_{t+2}
  r'    is fed back as the next depth's g (the drafter continues from its own state)

Five config flags vLLM honours change that math; imported drafters may carry them (``ENGINE_FLAGS``,
optional keys of ``draft_layer``, absent = the defaults above; our trainer sets none):
  norm_before_residual  r = hidden_norm(g) + o_proj(...)   (vLLM's ``_norm_before_residual``)
  norm_output           norm(r') is fed back instead of r'  (EAGLE-3.1: the next depth reads the post-norm state;
                        lm_head reads norm(r') either way: vLLM's llama_eagle3.py LlamaModel.forward returns
                        (norm(r'), norm(r') if norm_output else r'), the proposer computes logits from the first and
                        feeds the second back; speculators' Eagle3DraftModel trains it so. SpecForge's llama3_eagle.py
                        reads the same key otherwise: norm before lm_head (default true), r' always fed back, so its
                        EAGLE-3.1 configs' "norm_output": true is served, by vLLM and here, as post-norm feedback)
  logit_scale           lm_head(out) * logit_scale           (vLLM's ``LogitsProcessor(scale=logit_scale)``)
  norm_before_fc        g = fc(input_norm([a^low; a^mid; a^high]))    one RMSNorm over the 3H concat (gpt-oss style;
                        ``input_norm.weight`` [3H])
  fc_norm               g = fc([fc_norm.0(a^low); fc_norm.1(a^mid); fc_norm.2(a^high)])   one RMSNorm per aux state
                        (EAGLE-3.1 paper; ``fc_norm.{i}.weight`` [H])
With both, input_norm runs first and the per-layer norms on its output, as vLLM's ``combine_hidden_states``
orders them (speculators' trainer applies them in that order too, though its config refuses setting both).
Every norm here is Llama's RMSNorm with the layer's ``rms_norm_eps`` (``rms_norm``: float32 statistics).

``a_t^i`` is hidden_states[i] in transformers' numbering (0 = the embeddings, i = the output of
decoder layer i-1), which is also vLLM's "input of layer i" (``eagle_aux_hidden_state_layer_ids``);
the EAGLE-3 default is (2, N//2, N-3), three distinct ids on shallow targets (``default_aux_layers``).
The engines capture the listed layers while walking the target's layers, so ascending and each once:
that is the order fc's column blocks follow here too (``canonicalize``). e() is the backbone's own
frozen input embedding (borrowed, not stored). The draft vocabulary is the truncated projection's
token map (``token_map[i]`` = vocabulary id of draft index i; ``d2t`` in the serving layout) or the
whole vocabulary.

Positions: the drafter entry fed (g_p, x_{p+1}) sits at RoPE position p; depth j of a chain
started at p sits at p + j, exactly where decoding puts it, so training and decoding agree.

What sees what (training-time test, ``ttt_features``; decoding, ``DraftKV`` + ``forward_step``):
step 0 at t attends causally to the step-0 entries <= t (the backbone's features); step j >= 1 at
t attends to the same step-0 entries <= t and to its own chain's entries of steps 1..j at t —
in decoding these are the committed prefix (true features) and the tree path it extends.

``HeadsSpec`` fields: ``num_heads`` = draft depths trained (TTT steps), ``num_layers`` = 1,
``projection`` own or truncated (the draft vocabulary); the family's own settings (``Eagle3Settings``):
``aux_layers`` (3 ids) and ``draft_layer`` (the backbone's attention / MLP / RoPE sizes, so heads
rebuild without the backbone). It trains on the aux layers, the true next tokens and the positions
(``BackboneInputs`` below), not on the last hidden state.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from ..attention_backends import decoding_sdpa, folded_attention
from ..errors import IncompatibleHeadsError, UserError
from .drafting import ContextDrafting
from .inputs import BackboneInputs
from .registry import HeadFamily, register_family
from .rope import DraftRotary, rope_scaling_of
from .spec import HeadsSpec

NUM_AUX = 3  # vLLM and SGLang build fc over exactly three target layers
_LAYER_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "rms_norm_eps", "rope_theta", "hidden_act", "max_position_embeddings", "target_layers")
# Optional draft_layer keys, each a config flag vLLM honours (module docstring): name -> its default.
ENGINE_FLAGS = {"norm_before_residual": False, "norm_output": False, "logit_scale": 1.0, "norm_before_fc": False,
                "fc_norm": False}
BOOL_FLAGS = tuple(f for f, default in ENGINE_FLAGS.items() if isinstance(default, bool))


def fold_groups(q: torch.Tensor, mask: Optional[torch.Tensor], grouped: bool) -> bool:
    """Whether the drafter's masked grouped-query attention folds its groups into query rows
    (``folded_attention``): on CUDA, where SDPA with a mask and ``enable_gqa`` runs its unfused math kernel."""
    return grouped and mask is not None and q.device.type == "cuda" and mask.shape[1] == 1


@dataclasses.dataclass
class Eagle3Settings:
    """An EAGLE-3 drafter's own settings (stored flat in config.json under these names)."""

    aux_layers: Optional[list] = dataclasses.field(
        default=None, metadata={"help": "the three backbone hidden_states ids the drafter reads (ascending)"})
    draft_layer: Optional[dict] = dataclasses.field(
        default=None, metadata={"help": "the decoder layer's sizes, copied from the target (draft_layer_config)"})


MIN_TARGET_LAYERS = NUM_AUX + 1  # three distinct servable ids in 1..N-1 (id 0, the embeddings, cannot be tapped)


def engine_default_aux_layers(num_layers: int) -> list[int]:
    """What vLLM and SGLang capture for a drafter whose config names no aux ids: EAGLE-3's low /
    middle / high layers (2, N//2, N-3), as they compute them (possibly repeated on shallow targets)."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int]:
    """The ids a new drafter reads: EAGLE-3's (2, N//2, N-3) where they are three distinct servable ids,
    else three spread over 1..N-1 (targets of 4-6 layers: the engines capture each layer once, so a
    repeated id would leave fc 2H wide at serve time). Ascending, the order the engines capture them."""
    if num_layers < MIN_TARGET_LAYERS:
        raise UserError(f"eagle3 drafters read three distinct layers 1..N-1 of their target (what vLLM and SGLang "
                        f"can capture); this one has {num_layers} layer(s): use heads.kind=hydra or medusa, or a "
                        f"target of {MIN_TARGET_LAYERS}+ layers (a random debug backbone: "
                        f"backbone.random_init.num_hidden_layers={MIN_TARGET_LAYERS})")
    eagle = engine_default_aux_layers(num_layers)
    if len(set(eagle)) == NUM_AUX and min(eagle) >= 1:
        return sorted(eagle)
    return [1, num_layers // 2, num_layers - 1]


def repeated_aux_layers(aux) -> list[int]:
    """The ids ``aux`` names more than once (the engines capture each layer once: fc would get 2H)."""
    ids = [int(i) for i in aux]
    return sorted({i for i in ids if ids.count(i) > 1})


def refuse_repeated_aux_layers(aux, where: str) -> None:
    """One line for aux ids naming a layer twice: vLLM and SGLang walk the target's layers and capture
    each listed one once, so fc (3H wide) would receive 2H and fail with a shape error at serve time."""
    twice = repeated_aux_layers(aux)
    if twice:
        raise UserError(f"{where} names aux layer(s) {twice} more than once ({list(aux)}): vLLM and SGLang capture "
                        f"each layer once, so fc would receive {len(set(aux))} layers instead of {NUM_AUX}; "
                        "name three distinct layers")


def ascending_fc(fc_weight: torch.Tensor, aux) -> torch.Tensor:
    """fc.weight [H, 3H] with its three column blocks reordered from ``aux``'s order to ascending ids, so
    fc([a_sorted...]) equals the original fc([a_aux...]): the order vLLM and SGLang feed it (they collect
    hidden states while walking the layers)."""
    blocks = fc_weight.chunk(len(aux), dim=1)
    order = sorted(range(len(aux)), key=lambda j: int(aux[j]))
    return torch.cat([blocks[j] for j in order], dim=1)


def ascending_fc_inputs(tensors: dict, aux) -> dict:
    """``tensors`` (serving names) with what acts on fc's input reordered from ``aux``'s order to ascending ids:
    fc.weight's column blocks (``ascending_fc``), ``input_norm.weight``'s blocks (its statistics span the whole
    concat, so permuting its blocks with the layers leaves it the same norm) and the ``fc_norm.{i}`` of each layer."""
    order = sorted(range(len(aux)), key=lambda j: int(aux[j]))
    out = dict(tensors)
    if "fc.weight" in out:
        out["fc.weight"] = ascending_fc(out["fc.weight"], aux)
    if "input_norm.weight" in out:
        blocks = out["input_norm.weight"].chunk(len(aux))
        out["input_norm.weight"] = torch.cat([blocks[j] for j in order])
    norms = [f"fc_norm.{j}.weight" for j in range(len(aux))]
    if all(n in tensors for n in norms):
        out.update({norms[k]: tensors[norms[j]] for k, j in enumerate(order)})
    return out


def draft_layer_config(backbone_config) -> dict:
    """The sizes of the drafter's decoder layer, from the backbone's config; one line if the
    backbone's family has no Llama-style decoder layer to copy (what vLLM's drafter is)."""
    cfg = backbone_config.to_dict() if hasattr(backbone_config, "to_dict") else dict(backbone_config)
    name = cfg.get("model_type", "this backbone")
    missing = [k for k in ("num_attention_heads", "intermediate_size", "num_hidden_layers", "hidden_size")
               if cfg.get(k) is None]
    if missing:
        raise UserError(f"cannot build an EAGLE-3 decoder layer for {name}: its config has no {', '.join(missing)}; "
                        "eagle3 needs a Llama-style backbone (use heads.kind=hydra or medusa for this one)")
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if act not in ("silu", "swish"):
        raise UserError(f"cannot build an EAGLE-3 decoder layer for {name}: it uses {act!r}, the drafter's "
                        "Llama MLP needs silu")
    # The target's rope scaling (llama3, YaRN, ...), saved with the heads; absent = plain RoPE.
    scaling = rope_scaling_of(cfg, f"cannot build an EAGLE-3 decoder layer for {name}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    heads = int(cfg["num_attention_heads"])
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "intermediate_size": int(cfg["intermediate_size"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(theta),
        "hidden_act": "silu",
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 8192),
        "target_layers": int(cfg["num_hidden_layers"]),
        **({"rope_scaling": scaling} if scaling else {}),
    }


def _validate(spec: HeadsSpec) -> None:
    own = spec.settings
    layer = own.draft_layer
    if not isinstance(layer, dict) or any(k not in layer for k in _LAYER_KEYS):
        raise UserError(f"eagle3 heads need draft_layer with {', '.join(_LAYER_KEYS)}")
    if spec.num_layers != 1:
        raise UserError(f"eagle3 drafters have one decoder layer (num_layers=1), got {spec.num_layers}")
    if spec.projection == "shared":
        raise UserError("eagle3 drafters have their own lm_head: use projection own or truncated")
    n = layer["target_layers"]
    aux = own.aux_layers
    if aux is None or len(aux) != NUM_AUX:
        raise UserError(f"eagle3 heads need {NUM_AUX} aux layer ids (vLLM and SGLang read three), got {aux}")
    bad = [i for i in aux if not 0 <= int(i) < n]
    if bad:
        raise UserError(f"aux layer ids {bad} are out of range: the backbone has hidden states 0..{n - 1} "
                        f"({n} layers)")
    own.aux_layers = [int(i) for i in aux]
    if layer["num_attention_heads"] % layer["num_key_value_heads"]:
        raise UserError("num_attention_heads must be a multiple of num_key_value_heads")
    for flag in BOOL_FLAGS:
        if not isinstance(layer.get(flag, False), bool):
            raise UserError(f"eagle3 draft_layer {flag} must be true or false, got {layer[flag]!r}")
    scale = layer.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale == 0:
        raise UserError(f"eagle3 draft_layer logit_scale must be a finite non-zero number, got {scale!r}")


def _check_backbone(spec: HeadsSpec, backbone_config, where: str) -> None:
    """The aux layer ids must exist in this backbone: an EAGLE-3 checkpoint made for a deeper target
    (whose fingerprint, for a foreign one, is unknown) would otherwise read layers it never saw."""
    n = getattr(backbone_config, "num_hidden_layers", None)
    if n is None:
        return
    aux = spec.settings.aux_layers
    bad = [i for i in aux if not 0 <= i < n]
    if bad:
        raise IncompatibleHeadsError(f"{where} read aux layers {aux}, the backbone has hidden states "
                                     f"0..{n - 1} ({n} layers): they were trained for another target")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in float32, scale in the input dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class DraftAttention(nn.Module):
    """q/k/v over the 2H input, RoPE (rotate-half, as Llama), GQA, o_proj back to H."""

    def __init__(self, hidden: int, layer: dict):
        super().__init__()
        self.heads, self.kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
        self.head_dim = layer["head_dim"]
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.rotary = DraftRotary(layer, self.head_dim)  # the target's rope scaling, if any (heads/rope.py)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D], cos / sin [B, 1, T, D]."""
        return x * cos + _rotate_half(x) * sin

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2H] -> q [B, heads, T, D], k / v [B, kv_heads, T, D] (q, k rotated)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary.cos_sin(positions[:, None], x.dtype)  # once for q and k
        return self.rope(q, cos, sin), self.rope(k, cos, sin), v

    def expand_kv(self, kv: torch.Tensor) -> torch.Tensor:
        rep = self.heads // self.kv_heads
        return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)

    def out(self, ctx: torch.Tensor) -> torch.Tensor:
        """ctx [B, heads, T, D] -> [B, T, H]."""
        b, _, t, _ = ctx.shape
        return self.o_proj(ctx.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The one decoder layer (vLLM's ``midlayer``): names match the serving layout."""

    def __init__(self, hidden: int, layer: dict):
        super().__init__()
        eps = layer["rms_norm_eps"]
        self.self_attn = DraftAttention(hidden, layer)
        self.mlp = DraftMLP(hidden, layer["intermediate_size"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)


def draft_kv_bytes_per_slot(spec, dtype: torch.dtype) -> int:
    """Bytes one slot of the drafter's own KV cache takes (its one layer's keys and values); 0 for
    heads without a draft layer."""
    layer = getattr(spec.settings, "draft_layer", None) or {}
    return 2 * layer.get("num_key_value_heads", 0) * layer.get("head_dim", 0) * \
        torch.empty((), dtype=dtype).element_size()


class DraftKV:
    """The drafter's own KV cache for one sequence: the committed entries (one per accepted position,
    from the backbone's features) then, during a step, the draft tree's entries (dropped afterwards)."""

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.k = self.v = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, kv_heads, n, D] at slots length..length+n-1."""
        if self.k is None:
            shape = (1, k.shape[1], self.capacity, k.shape[-1])
            self.k = k.new_empty(shape)
            self.v = v.new_empty(shape)
        n = k.shape[2]
        if self.length + n > self.capacity:
            raise RuntimeError(f"draft KV cache full ({self.capacity} slots)")
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, :self.length], self.v[:, :, :self.length]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class StaticDraftKV:
    """The drafter's KV cache at a fixed shape, for its forwards captured as graphs (``forward_static``):
    keys / values [batch, kv_heads, capacity, D] that never move, written at slots given as device tensors and
    attended over whole, masked. Zero-filled: uninitialised memory can hold NaN, and NaN times a zero softmax
    weight is NaN in every row. ``length``: batch 1's committed entries (host side, outside the calls);
    ``claim`` / ``check`` refuse two generations interleaving on one buffer, as the backbone's static cache does."""

    _made = itertools.count()   # a serial per cache: what names the calls captured over it, never reused

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device):
        self.capacity, self.length, self.generation = capacity, 0, 0
        self.serial = next(StaticDraftKV._made)
        with torch.inference_mode(False):   # it outlives the generation that made it: written in and out of it
            self.k = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
            self.v = torch.zeros_like(self.k)

    def claim(self) -> int:
        self.generation += 1
        self.length = 0
        return self.generation

    def check(self, generation: int) -> None:
        if generation != self.generation:
            raise RuntimeError("two generations are drafting on one static EAGLE-3 draft cache at once; finish "
                               "one before starting another (or decode with graphs=off)")

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """k, v [B, kv_heads, n, D] at ``slots`` [n] (batch 1), or row ``rows[b]``'s ``slots[b]`` ([B, 1],
        [B, n]): device indices, so a captured call writes wherever its inputs say."""
        if rows is None:
            self.k.index_copy_(2, slots, k)
            self.v.index_copy_(2, slots, v)
        else:
            self.k[rows, :, slots] = k.transpose(1, 2)
            self.v[rows, :, slots] = v.transpose(1, 2)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


class Eagle3Drafter(ContextDrafting, nn.Module):
    """An EAGLE-3 drafter (module docstring). Drafting goes through ``methods/eagle3.py``
    (dynamic trees with this module's ``DraftKV``), training through ``ttt_features``."""

    def __init__(self, spec: HeadsSpec):
        super().__init__()
        self.spec = spec
        h, layer = spec.hidden_size, spec.settings.draft_layer
        self.fc = nn.Linear(NUM_AUX * h, h, bias=False)
        # What acts on fc's input under norm_before_fc / fc_norm (module docstring); absent = plain EAGLE-3.
        eps = layer["rms_norm_eps"]
        self.input_norm = RMSNorm(NUM_AUX * h, eps) if layer.get("norm_before_fc", False) else None
        self.fc_norm = nn.ModuleList([RMSNorm(h, eps) for _ in range(NUM_AUX)]) if layer.get("fc_norm", False) else None
        self.midlayer = DraftLayer(h, layer)
        self.norm = RMSNorm(h, layer["rms_norm_eps"])
        self.lm_head = nn.Linear(h, spec.output_size, bias=False)
        if spec.projection == "truncated":
            self.register_buffer("token_map", torch.arange(spec.output_size, dtype=torch.long))
        else:
            self.token_map = None
        self.register_buffer("embed_weight", None, persistent=False)  # the backbone's, borrowed
        # The engine flags an imported drafter may carry (module docstring); the defaults compute plain EAGLE-3.
        self.norm_before_residual = bool(layer.get("norm_before_residual", False))
        self.norm_output = bool(layer.get("norm_output", False))
        self.logit_scale = float(layer.get("logit_scale", 1.0))

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_backbone(cls, spec: HeadsSpec, lm_head_weight: torch.Tensor, input_embeddings: Optional[torch.Tensor],
                      token_map: Optional[torch.Tensor] = None) -> "Eagle3Drafter":
        """A warm start: the untrained drafter reads the high aux layer and projects it with (rows
        of) the backbone's lm_head, because fc starts as the identity on that layer and o_proj /
        down_proj start at zero (a cold start cost ~10% of depth-1 accuracy at this toolkit's data
        sizes, ANCHORS); q/k/v, gate/up keep their random init so gradients reach them."""
        if input_embeddings is None:
            raise UserError("eagle3 drafters need the backbone's input embeddings")
        d = cls(spec)
        h = spec.hidden_size
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            d.fc.weight.zero_()
            d.fc.weight[:, (NUM_AUX - 1) * h:].copy_(torch.eye(h))
            for lin in (d.midlayer.self_attn.q_proj, d.midlayer.self_attn.k_proj, d.midlayer.self_attn.v_proj,
                        d.midlayer.mlp.gate_proj, d.midlayer.mlp.up_proj):
                fan_in = lin.weight.shape[1]
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / math.sqrt(fan_in))
            d.midlayer.self_attn.o_proj.weight.zero_()
            d.midlayer.mlp.down_proj.weight.zero_()
            w = lm_head_weight.detach().float()
            if spec.projection == "truncated":
                if token_map is None or token_map.numel() != spec.output_size:
                    raise UserError("a truncated draft vocabulary needs a token_map of truncated_vocab_size ids")
                d.token_map.copy_(token_map.to(torch.long))
                w = w[token_map.to(w.device)]
            d.lm_head.weight.copy_(w)
        d.attach_backbone(lm_head_weight, input_embeddings)
        return d

    # -- the engines' aux order (ascending, each layer once) ----------------------------------------
    @staticmethod
    def canonical_spec(spec: HeadsSpec, where: str) -> HeadsSpec:
        """``spec`` as it will run once loaded: aux ids ascending (``canonicalize`` permutes fc to match);
        one line for ids naming a layer twice, which no engine can serve."""
        aux = spec.settings.aux_layers
        refuse_repeated_aux_layers(aux, where)
        if aux == sorted(aux):
            return spec
        return dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, aux_layers=sorted(aux)))

    def canonicalize(self, where: str) -> "Eagle3Drafter":
        """Loaded weights in the engines' order: a drafter trained with aux ids out of order (fc's column
        blocks in that order) gets fc permuted and its ids sorted, so it computes the same drafts with the
        layers captured the way vLLM and SGLang capture them (ascending); repeated ids are refused."""
        aux = list(self.spec.settings.aux_layers)
        refuse_repeated_aux_layers(aux, where)
        if aux != sorted(aux):
            fc_inputs = ("fc.weight", "input_norm.", "fc_norm.")
            params = {n: p for n, p in self.named_parameters() if n.startswith(fc_inputs)}
            with torch.no_grad():
                for name, t in ascending_fc_inputs({n: p.detach().clone() for n, p in params.items()}, aux).items():
                    params[name].copy_(t)
            self.spec.settings.aux_layers = sorted(aux)
        return self

    @property
    def needs_lm_head(self) -> bool:
        return False

    @property
    def needs_input_embeddings(self) -> bool:
        return True

    def attach_backbone(self, lm_head_weight=None, input_embeddings=None) -> None:
        # An empty tensor is a placeholder (medusa-export reads no backbone): nothing to attach.
        if input_embeddings is not None and input_embeddings.numel():
            if tuple(input_embeddings.shape) != (self.spec.vocab_size, self.spec.hidden_size):
                raise UserError(f"eagle3 drafters need input embeddings of shape "
                                f"{(self.spec.vocab_size, self.spec.hidden_size)}, got {tuple(input_embeddings.shape)}")
            self.embed_weight = input_embeddings.detach()

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.embed_weight is None:
            raise RuntimeError("eagle3 drafters need attach_backbone(input_embeddings=...) first")
        return F.embedding(tokens, self.embed_weight).to(dtype)

    # -- the math -------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., 3H] backbone features (low, mid, high concatenated) -> g [..., H]; with ``norm_before_fc`` /
        ``fc_norm`` through their norms first (input_norm, then each layer's, as vLLM orders them)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm(a) for norm, a in zip(self.fc_norm, aux.chunk(NUM_AUX, dim=-1))], dim=-1)
        return self.fc(aux)

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input [e; hidden_norm(g)], the residual ``_finish`` adds to: hidden_norm(g) with
        ``norm_before_residual`` (the one computed for the input), else g)."""
        layer = self.midlayer
        e = layer.input_layernorm(self.embed(tokens, hidden.dtype))
        normed = layer.hidden_norm(hidden)
        return torch.cat([e, normed], dim=-1), (normed if self.norm_before_residual else hidden)

    def _finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(r') for ``project``, the state fed to the next depth: r', or norm(r') with ``norm_output``);
        ``residual``: ``_inputs``' second (hidden_norm(g) with ``norm_before_residual``, else g)."""
        layer = self.midlayer
        r = residual + attn_out
        r = r + layer.mlp(layer.post_attention_layernorm(r))
        normed = self.norm(r)
        # As vLLM's llama_eagle3.py LlamaModel.forward: `aux_output = hidden_states if self.norm_output else
        # hidden_prenorm`; the flag never moves the norm off lm_head's input (not SpecForge's meaning: module docstring)
        return normed, (normed if self.norm_output else r)

    def forward_step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     past: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                     mask: Optional[torch.Tensor] = None):
        """One drafter pass over new rows: tokens [B, T] (x_{p+1}), hidden [B, T, H] (g_p or a previous
        depth's pre-norm state), positions [B, T]; ``past`` = (K, V) [B, kv_heads, S, D] visible entries;
        ``mask`` additive [B|1, 1, T, S+T] (None: all of past plus causal among the new rows).
        Returns (normed [B, T, H] for ``project``, the state [B, T, H] fed to the next depth (pre-norm; with
        ``norm_output`` the normed one), (k, v) of the new rows)."""
        attn = self.midlayer.self_attn
        x, residual = self._inputs(tokens, hidden)
        q, k, v = attn.qkv(x, positions)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None and q.shape[2] > 1:
            t, s = q.shape[2], keys.shape[2]
            mask = torch.zeros(t, s, dtype=q.dtype, device=q.device)
            mask[:, s - t:] = torch.triu(torch.full((t, t), torch.finfo(q.dtype).min, dtype=q.dtype,
                                                    device=q.device), 1)
            mask = mask[None, None]
        normed, pre = self._attend(q, keys, values, mask, residual)
        return normed, pre, (k, v)

    def forward_static(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                       cache: StaticDraftKV, slots: torch.Tensor, mask: torch.Tensor,
                       rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_step`` at a fixed shape: the new rows' keys / values go into ``cache`` at ``slots``
        (``StaticDraftKV.write``), then attention spans the cache's whole capacity (its first B rows) under
        ``mask`` [B|1, 1, T, capacity] (additive), which must show each row its own entry. No host read: the
        drafter's calls are captured as graphs with it. Returns (normed, pre-norm state)."""
        x, residual = self._inputs(tokens, hidden)
        q, k, v = self.midlayer.self_attn.qkv(x, positions)
        cache.write(k, v, slots, rows)
        b = q.shape[0]
        return self._attend(q, cache.k[:b], cache.v[:b], mask, residual)

    def _attend(self, q, keys, values, mask, residual) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.midlayer.self_attn
        # GQA inside the kernel: repeating the whole cache's keys and values per query head copied
        # (heads / kv_heads) x the cache on every call, twice the attention's own cost at 300 entries. On CUDA
        # a mask with enable_gqa leaves torch only its unfused math kernel (flash takes no mask): the groups are
        # folded into query rows instead, as the backbone's attention does.
        grouped = attn.heads != attn.kv_heads
        with decoding_sdpa(q.device):  # the drafter's cache grows every call: no cuDNN plan per length
            if fold_groups(q, mask, grouped):
                ctx = folded_attention(q, keys, values, mask.to(q.dtype)).transpose(1, 2)
            else:
                ctx = F.scaled_dot_product_attention(q, keys, values, enable_gqa=grouped,
                                                     attn_mask=None if mask is None else mask.to(q.dtype))
        return self._finish(residual, attn.out(ctx))

    def ttt_features(self, aux: torch.Tensor, future: torch.Tensor, positions: torch.Tensor,
                     mask0: torch.Tensor, steps: Optional[int] = None) -> list[torch.Tensor]:
        """Training-time test: the drafter unrolled ``steps`` (default ``num_heads``) depths over a
        batch. aux [B, T, 3H]; ``future[..., j]`` = x_{t+1+j}; positions [B, T]; mask0 additive
        [B|1, 1, T, T], the step-0 visibility (causal within a packed document).

        Step j at t is fed its own pre-norm state of step j-1 at t and x_{t+1+j}, at position t+j,
        and attends to the step-0 entries mask0 allows plus its chain's entries of steps 1..j at t
        (module docstring), so its features equal decoding's for a chain started at t. Returns the
        normed features of each step [B, T, H] (step j guesses x_{t+2+j})."""
        steps = self.spec.num_heads if steps is None else steps
        attn = self.midlayer.self_attn
        hidden = self.combine(aux)
        keys, values, feats = [], [], []
        masks = [mask0.to(hidden.dtype)]
        for j in range(steps):
            x, residual = self._inputs(future[..., j], hidden)
            q, k, v = attn.qkv(x, positions + j)
            keys.append(attn.expand_kv(k))
            values.append(attn.expand_kv(v))
            if j == 1:  # steps >= 1 see their chain's entries at their own position only: a diagonal block
                t = q.shape[2]
                diag = torch.full((t, t), torch.finfo(hidden.dtype).min, dtype=hidden.dtype, device=q.device)
                diag.fill_diagonal_(0)
                diag = diag.expand(*masks[0].shape[:-2], t, t)
            if j >= 1:
                masks.append(diag)
            # One fused attention over [step-0 keys; chain keys of steps 1..j] (the CPU flash kernel: the
            # T x (j+1)T scores are never materialised; 3x faster than softmax over explicit scores).
            ctx = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                 attn_mask=torch.cat(masks, -1))
            normed, hidden = self._finish(residual, attn.out(ctx))
            feats.append(normed)
        return feats

    # -- projection (one lm_head for every depth) ----------------------------------------------
    def project(self, x: torch.Tensor, k: int = 0) -> torch.Tensor:
        logits = self.lm_head(x)
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale

    def to_vocab_ids(self, local_ids: torch.Tensor) -> torch.Tensor:
        return local_ids if self.token_map is None else self.token_map[local_ids]


def _describe(spec: HeadsSpec) -> str:
    return (f"EAGLE-3 drafter: {spec.num_layers} decoder layer over hidden states {list(spec.settings.aux_layers)}, "
            f"{spec.num_heads} training-time-test steps")


# Trained on three backbone layers (not the last hidden state: the teacher term and greedy targets read
# that), the true next tokens x_{t+1+j} and the positions (its own RoPE), within packed documents.
INPUTS = BackboneInputs(last_hidden=False, aux_layers=True, path_tokens=True, positions=True)

register_family(HeadFamily("eagle3", Eagle3Drafter, ContextDrafting, settings=Eagle3Settings, inputs=INPUTS,
                           validate=_validate, check_backbone=_check_backbone, describe=_describe))
