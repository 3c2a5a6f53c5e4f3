"""The EAGLE-3 drafter's RoPE: the scaled variants transformers implements, rebuilt from the heads' own config.

The drafter copies its target's rotation (the published Llama-3.1 drafters ship ``rope_type: llama3``).
``rope_scaling_of`` reads a config dict's rope fields (a backbone's ``to_dict()`` under transformers 4
or 5, or an engine ``config.json``) into the one small dict the heads save as
``draft_layer["rope_scaling"]`` (absent = plain RoPE, as in every export made before scaling was
supported); ``DraftRotary`` turns it into cos / sin exactly as transformers'
``modeling_rope_utils`` (5.x: ``_compute_*_parameters`` and ``dynamic_rope_update``) and
``LlamaRotaryEmbedding.forward`` do, without the backbone:

  default   inv_i = 1 / theta^(2i/D)
  linear    inv_i / factor
  llama3    low frequencies (wavelength > omax / low_freq_factor) / factor, high ones (< omax /
            high_freq_factor) kept, the band between interpolated
  yarn      a ramp between inv_i and inv_i / factor over the dims that turn beta_slow..beta_fast times
            in omax positions; cos and sin scaled by 0.1 ln(factor) + 1
  longrope  inv_i / long_factor_i at every position; cos and sin scaled by attention_factor (default
            sqrt(1 + ln(factor) / ln(omax)), factor = max_pos / omax). transformers uses the long
            factors for a call longer than omax and the short ones otherwise, but the engines disagree
            (vLLM: long factors at every position once max_model_len > omax; SGLang: per batch, when a
            position is > omax), so the drafter takes the long ones everywhere and exports short = long:
            training, decoding and both engines then rotate alike at every position, and equal
            transformers for any call reaching past omax.
  dynamic   plain RoPE up to max_position_embeddings; a longer call (``max(positions) + 1 = L``) uses
            theta * (factor L / max_pos - (factor - 1))^(D / (D - 2)), recomputed per call on the device
            (no host read: a captured call keeps it; transformers keeps the grown base across calls until a
            short one resets it)

(omax = ``original_max_position_embeddings``.) ``export_rope_scaling`` writes what vLLM's ``get_rope``
and SGLang's ``get_rope`` read (``vllm/model_executor/layers/rotary_embedding/__init__.py``,
``sglang/srt/layers/rotary_embedding/factory.py``; their Llama3 / YaRN / Phi3LongRoPE / Linear classes)
so they compute the same rotation:
  * llama3, linear, yarn: the same parameters; both engines' classes compute the formulas above.
  * longrope: ``short_factor`` = ``long_factor`` (above) and ``short_mscale`` = ``long_mscale`` =
    attention_factor, since the engines derive their default from max_pos / omax and ignore ``factor``
    / ``attention_factor``.
  * dynamic: nothing (plain RoPE). The engines fix one base for every position and disagree on it
    (vLLM's current DynamicNTKScalingRotaryEmbedding keeps rope_theta, SGLang's raises it by
    (factor^2 - factor + 1)^(D/(D-2))); plain RoPE is what transformers computes at every position below
    max_position_embeddings, the length the engines' default cos/sin cache covers.
What the engines cannot reproduce is refused in one line (another YaRN attention factor, ``truncate:
false``, a partial rotary dimension), in training and on import alike; on import also dynamic and a
longrope whose short and long factors differ (the two engines would rotate it differently).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..errors import UserError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": (), "longrope": ("short_factor", "long_factor")}


def _rope_fields(cfg: dict) -> tuple[str, dict]:
    """(rope type, its parameters) from ``rope_scaling`` (transformers 4, engine configs; it wins over
    ``rope_parameters`` in transformers 5 and in both engines) or transformers 5's ``rope_parameters``."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        return "default", {}
    return str(rope.get("rope_type") or rope.get("type") or "default"), rope


def _yarn_attention_factor(rope: dict, factor: float) -> float:
    """transformers' YaRN cos/sin scale: attention_factor, else the mscale ratio, else 0.1 ln(factor) + 1."""
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    return mscale(factor) * float(rope.get("attn_factor") or 1.0)  # attn_factor: SGLang's multiplier


def _yarn(rope: dict, omax: int, max_pos: int, where: str) -> dict:
    factor = float(rope.get("factor") or max_pos / omax)
    default = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    scale = _yarn_attention_factor(rope, factor)
    if abs(scale - default) > 1e-9 or float(rope.get("extrapolation_factor") or 1.0) != 1.0:
        raise UserError(f"{where}: rope type 'yarn' with a cos/sin scale of {scale:.6g} (attention_factor / mscale / "
                        f"attn_factor / extrapolation_factor) is not supported: vLLM's and SGLang's YaRN apply "
                        f"0.1 ln(factor) + 1 = {default:.6g}")
    if rope.get("truncate", True) is False:
        raise UserError(f"{where}: rope type 'yarn' with truncate=false is not supported: vLLM and SGLang "
                        "round the correction range")
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": omax,
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1)}


def _longrope(rope: dict, omax: int, max_pos: int, where: str) -> dict:
    short, long_ = rope.get("short_mscale"), rope.get("long_mscale")  # the engines' names for the scale
    if short is not None and long_ is not None and float(short) != float(long_):
        raise UserError(f"{where}: rope type 'longrope' with short_mscale {short} != long_mscale {long_} is not "
                        "supported (transformers' longrope has one attention_factor)")
    scale = rope.get("attention_factor") or short or long_
    if scale is None:
        factor = float(rope.get("factor") or max_pos / omax)
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
    return {"rope_type": "longrope", "long_factor": [float(x) for x in rope["long_factor"]],
            "original_max_position_embeddings": omax, "attention_factor": float(scale)}


def rope_scaling_of(cfg: dict, where: str) -> Optional[dict]:
    """The rope scaling the drafter computes for a config dict (None: plain RoPE); one line for a type or
    option it does not compute. Resolves transformers' defaults (omax = max_position_embeddings, YaRN's
    and longrope's factor = max_pos / omax) so the result needs nothing else."""
    rope_type, rope = _rope_fields(cfg)
    if rope_type not in ROPE_TYPES:
        raise UserError(f"{where}: rope type {rope_type!r} is not supported (the EAGLE-3 drafter computes "
                        f"{', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor {partial} is not supported: the drafter's Llama layer "
                        "rotates the whole head")
    if rope_type == "default":
        return None
    missing = [k for k in _REQUIRED[rope_type] if rope.get(k) is None]
    if missing:
        raise UserError(f"{where}: rope type {rope_type!r} needs {', '.join(_REQUIRED[rope_type])}; "
                        f"missing {', '.join(missing)}")
    max_pos = int(cfg.get("max_position_embeddings") or 2048)  # LlamaConfig's default
    # transformers gives a top-level original_max_position_embeddings (Phi-3) precedence
    omax = int(cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_pos)
    if rope_type in ("linear", "dynamic"):
        return {"rope_type": rope_type, "factor": float(rope["factor"])}
    if rope_type == "llama3":
        return {"rope_type": "llama3", "factor": float(rope["factor"]),
                "low_freq_factor": float(rope["low_freq_factor"]), "high_freq_factor": float(rope["high_freq_factor"]),
                "original_max_position_embeddings": omax}
    return (_yarn if rope_type == "yarn" else _longrope)(rope, omax, max_pos, where)


def engine_rope_scaling(raw: dict, where: str) -> Optional[dict]:
    """``rope_scaling_of`` for an engine ``config.json`` being imported, refusing what the engines rotate
    otherwise than the drafter: dynamic (each fixes its own NTK base for every position; transformers and the
    drafter rescale only beyond max_position_embeddings) and a longrope with two factor lists."""
    rope_type, rope = _rope_fields(raw)
    if rope_type == "dynamic":
        raise UserError(f"{where}: rope type 'dynamic' is not supported on import: vLLM and SGLang each rotate "
                        "every position with their own fixed NTK base, the drafter (like transformers) only "
                        "rescales beyond max_position_embeddings")
    if rope_type == "longrope" and rope.get("short_factor") != rope.get("long_factor"):
        raise UserError(f"{where}: rope type 'longrope' with short_factor != long_factor is not supported on import: "
                        "vLLM uses the long factors at every position, SGLang switches per batch; the drafter "
                        "rotates with the long ones (its exports write short = long)")
    return rope_scaling_of(raw, where)


def export_rope_scaling(layer: dict) -> dict:
    """The config.json fields besides rope_theta that make vLLM and SGLang rotate as the drafter does
    (module docstring): ``{}`` for plain RoPE and dynamic, else ``{"rope_scaling": ...}``."""
    scaling = layer.get("rope_scaling")
    if not scaling or scaling["rope_type"] == "dynamic":
        return {}
    out = dict(scaling)
    if out["rope_type"] == "longrope":
        out["short_factor"] = list(out["long_factor"])
        out["short_mscale"] = out["long_mscale"] = out.pop("attention_factor")
    return {"rope_scaling": out}


# -- the frequencies ----------------------------------------------------------------------------------
def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(s: dict, inv: torch.Tensor) -> torch.Tensor:
    factor, low, high, omax = (s["factor"], s["low_freq_factor"], s["high_freq_factor"],
                               s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > omax / low, inv / factor, inv)
    smooth = (omax / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < omax / high) * ~(wavelen > omax / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(s: dict, theta: float, dim: int) -> torch.Tensor:
    factor, omax = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(omax / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(s["beta_slow"])), dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_frequencies(scaling: Optional[dict], theta: float, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, cos/sin scale) at positions below max_pos — transformers' ``ROPE_INIT_FUNCTIONS``
    (longrope: always the long factors, module docstring). Dynamic rescales past max_pos, per call: ``DraftRotary``."""
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type in ("default", "dynamic"):
        return _plain(theta, dim), 1.0
    if rope_type == "linear":
        return _plain(theta, dim) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(scaling, _plain(theta, dim)), 1.0
    if rope_type == "yarn":
        f = scaling["factor"]
        return _yarn_frequencies(scaling, theta, dim), 1.0 if f <= 1 else 0.1 * math.log(f) + 1.0
    ext = torch.tensor(scaling["long_factor"], dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise UserError(f"rope type 'longrope' needs {dim // 2} long factors (head_dim {dim} / 2), got {ext.numel()}")
    inv = 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv, scaling["attention_factor"]


class DraftRotary(nn.Module):
    """cos / sin of the drafter's RoPE at given positions (rotate-half layout, as Llama's)."""

    def __init__(self, layer: dict, head_dim: int):
        super().__init__()
        self.scaling = layer.get("rope_scaling") or None
        rope_type = self.scaling.get("rope_type") if self.scaling else "default"
        if rope_type not in ROPE_TYPES:
            raise UserError(f"eagle3 draft_layer: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
        self.theta, self.head_dim = float(layer["rope_theta"]), head_dim
        self.max_pos = int(layer["max_position_embeddings"])
        # Only dynamic depends on the call's length: the others keep one inv_freq for every position.
        self.length_dependent = rope_type == "dynamic"
        inv, self.scale = rope_frequencies(self.scaling, self.theta, head_dim, self.max_pos)
        self.register_buffer("inv_freq", inv, persistent=False)

    def frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        if not self.length_dependent:
            return self.inv_freq
        # Dynamic NTK, computed on the device as transformers computes it from a tensor length (float32, the same
        # ops): no host read, so a captured drafter call keeps its graph. Up to max_position_embeddings the base
        # is the plain one (the buffer, bit for bit).
        seq_len = positions.max() + 1
        factor, dim = self.scaling["factor"], self.head_dim
        base = self.theta * ((factor * seq_len.clamp(min=self.max_pos) / self.max_pos) - (factor - 1)) ** (
            dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        inv = self.inv_freq.to(positions.device)
        return torch.where(seq_len > self.max_pos, 1.0 / base ** exponents, inv)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] -> cos, sin [..., T, head_dim] in ``dtype`` (computed in float32)."""
        freqs = positions[..., None].float() * self.frequencies(positions).to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)
