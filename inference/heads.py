"""Medusa heads and their on-disk format: the one definition the trainer and runtime share.

A head is L residual blocks ``x + SiLU(W x + b)`` on the backbone's last hidden state
(after the final norm) followed by a projection to the vocabulary. Head k (k = 1..K)
predicts the token k+1 positions ahead of the backbone's own next token: from position t,
the backbone predicts t+1 and head k predicts t+k+1.

Unlike the reference implementation, every block is its own module (the reference's
``[ResBlock(h)] * L`` silently shares one), and loading is strict: a missing, extra or
mis-shaped tensor is refused.

Projection modes (``HeadsSpec.projection``):
  own        one full-vocabulary projection per head, initialised from the base lm_head
             (the reference / TensorRT-LLM layout).
  shared     every head reuses the frozen base lm_head; the export stores no projection.
  truncated  one projection per head over the N most frequent target tokens of the
             training data; ``token_map[i]`` is the vocabulary id of local index i
             (vLLM's ``token_map``, EAGLE-3's draft vocabulary). Cheapest on CPU.

Head families (``HeadsSpec.kind``): ``medusa`` (this module) and the dependent heads that are
also fed the drafted tokens, ``hydra`` and ``mlp_speculator`` (``dependent_heads``). All share
``ProjectedHeads`` (projection modes, token map, borrowed backbone tensors); ``build_heads`` /
``init_heads`` pick the class from the spec.

Export directory (``save_heads``): exactly ``config.json`` and ``model.safetensors``
(the token map is the ``token_map`` tensor inside it, where vLLM's loader reads it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from .errors import IncompatibleHeadsError, UserError
from .tree_draft import IndependentDrafting

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
PROJECTIONS = ("own", "shared", "truncated")
KINDS = ("medusa", "hydra", "mlp_speculator")

# Architecture fields that decide whether heads fit a backbone. Weights may differ (a
# fine-tune of the same base keeps the fingerprint); shapes and numerics may not.
_FINGERPRINT_KEYS = (
    "model_type", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "rms_norm_eps", "layer_norm_epsilon",
)


def backbone_fingerprint(config) -> str:
    """A short stable hash of a transformers config's architecture fields."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    picked = {k: cfg.get(k) for k in _FINGERPRINT_KEYS if cfg.get(k) is not None}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope, dict):  # transformers 5 keeps rope_theta (and scaling) in rope_parameters
        for k in ("rope_theta", "rope_type", "factor"):
            if rope.get(k) is not None:
                picked[k] = rope[k]
    blob = json.dumps(picked, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass
class HeadsSpec:
    """Everything needed to rebuild heads and check they fit a backbone (config.json)."""

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    projection: str = "own"
    truncated_vocab_size: Optional[int] = None
    base_model: str = ""
    base_model_fingerprint: str = ""
    kind: str = "medusa"
    inner_dim: Optional[int] = None   # mlp_speculator: state width (None = hidden_size)
    tie_weights: bool = False         # mlp_speculator: one emb/proj/ln/head for steps >= 2 (vLLM's tie_weights)
    scale_input: bool = False         # mlp_speculator: RMS-normalise the backbone state first (vLLM's ln0)
    backbone_adapter: Optional[str] = None  # Medusa-2: LoRA adapter dir (relative) the backbone needs
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UserError(f"heads kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "mlp_speculator" and self.tie_weights and self.num_heads < 2:
            raise UserError("mlp_speculator tie_weights needs at least 2 heads")
        if self.projection not in PROJECTIONS:
            raise UserError(f"heads projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise UserError(f"need num_heads >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        if self.projection == "truncated":
            n = self.truncated_vocab_size
            if not n or not 0 < n <= self.vocab_size:
                raise UserError(f"truncated_vocab_size must be in 1..{self.vocab_size}, got {n}")
        else:
            self.truncated_vocab_size = None

    @property
    def output_size(self) -> int:
        return self.truncated_vocab_size if self.projection == "truncated" else self.vocab_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadsSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise UserError(f"heads config has unknown keys {unknown}")
        return cls(**d)


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W zero-initialised, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ProjectedHeads(nn.Module):
    """What every head family shares: K projections to the vocabulary in one of the three
    ``HeadsSpec.projection`` modes, the truncated token map, and the backbone tensors a family
    borrows without storing them (the lm_head for ``shared``, the input embeddings for Hydra).

    Subclasses call ``_init_projection`` and define ``head_hidden``/``forward`` (Medusa) or the
    ``sequential`` interface (``dependent_heads``). ``_projection_name`` is the state-dict
    prefix of the projections (``projections`` here, ``head`` in vLLM's MLP speculator).
    """

    _projection_name = "projections"

    def _init_projection(self, spec: HeadsSpec, in_dim: int) -> None:
        self.spec = spec
        if spec.projection == "shared":
            if in_dim != spec.hidden_size:
                raise UserError(f"shared projection needs head width {spec.hidden_size}, got {in_dim}")
            setattr(self, self._projection_name, None)
            # Not persistent: the export never stores the backbone's own matrix.
            self.register_buffer("shared_weight", None, persistent=False)
        else:
            setattr(self, self._projection_name, nn.ModuleList(
                nn.Linear(in_dim, spec.output_size, bias=False) for _ in range(spec.num_heads)))
        if spec.projection == "truncated":
            self.register_buffer("token_map", torch.arange(spec.output_size, dtype=torch.long))
        else:
            self.token_map = None

    @property
    def projections_list(self) -> Optional[nn.ModuleList]:
        return getattr(self, self._projection_name)

    def _init_projection_from_lm_head(self, lm_head_weight: torch.Tensor,
                                      token_map: Optional[torch.Tensor]) -> None:
        """Projections start as (rows of) the base lm_head, as Medusa does."""
        spec, w = self.spec, lm_head_weight.detach()
        if spec.projection == "shared":
            self.attach_lm_head(w)
            return
        if spec.projection == "truncated":
            if token_map is None or token_map.numel() != spec.output_size:
                raise UserError("truncated heads need a token_map of truncated_vocab_size ids")
            self.token_map.copy_(token_map.to(torch.long))
            w = w[token_map.to(w.device)]
        for proj in self.projections_list:
            if proj.weight.shape == w.shape:
                proj.weight.data.copy_(w)

    def attach_lm_head(self, lm_head_weight: torch.Tensor) -> None:
        """Point shared heads at the (frozen) backbone lm_head; a no-op for other modes."""
        if self.spec.projection == "shared":
            self.shared_weight = lm_head_weight.detach()

    def attach_backbone(self, lm_head_weight: Optional[torch.Tensor] = None,
                        input_embeddings: Optional[torch.Tensor] = None) -> None:
        """Give the heads the frozen backbone tensors they borrow (see ``needs_*``)."""
        if lm_head_weight is not None:
            self.attach_lm_head(lm_head_weight)

    @property
    def needs_lm_head(self) -> bool:
        return self.spec.projection == "shared"

    @property
    def needs_input_embeddings(self) -> bool:
        return False

    def project(self, x: torch.Tensor, k: int) -> torch.Tensor:
        projections = self.projections_list
        if projections is None:
            if self.shared_weight is None:
                raise RuntimeError("shared heads need attach_lm_head(backbone lm_head weight) first")
            return F.linear(x, self.shared_weight.to(x.dtype))
        return projections[k](x)

    def to_vocab_ids(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Map indices into a head's logits to vocabulary ids (identity unless truncated)."""
        return local_ids if self.token_map is None else self.token_map[local_ids]


class MedusaHeads(IndependentDrafting, ProjectedHeads):
    """K heads over the backbone's last hidden state.

    ``forward(hidden)`` returns a list of K logit tensors (``[..., output_size]``). For
    ``truncated`` heads, logits are over the local vocabulary; ``token_map`` maps them back.
    For ``shared`` heads, call ``attach_lm_head`` with the backbone's lm_head weight first.
    """

    def __init__(self, spec: HeadsSpec):
        super().__init__()
        h = spec.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(spec.num_layers)]) for _ in range(spec.num_heads)
        )
        self._init_projection(spec, h)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_lm_head(cls, spec: HeadsSpec, lm_head_weight: torch.Tensor,
                     token_map: Optional[torch.Tensor] = None) -> "MedusaHeads":
        """Fresh heads whose projections start as (rows of) the base lm_head, as Medusa does."""
        heads = cls(spec)
        heads._init_projection_from_lm_head(lm_head_weight, token_map)
        return heads

    # -- compute -----------------------------------------------------------------------
    def head_hidden(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The residual-block output of head k (0-based) before projection."""
        return self.blocks[k](hidden)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        return self.project(self.head_hidden(hidden, k), k)

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        return [self.head_logits(hidden, k) for k in range(self.spec.num_heads)]


def build_heads(spec: HeadsSpec) -> ProjectedHeads:
    """An uninitialised module of the spec's family (``spec.kind``)."""
    if spec.kind == "medusa":
        return MedusaHeads(spec)
    from .dependent_heads import HEAD_FAMILIES  # dependent_heads imports this module

    return HEAD_FAMILIES[spec.kind](spec)


def init_heads(spec: HeadsSpec, lm_head_weight: torch.Tensor, input_embeddings: Optional[torch.Tensor] = None,
               token_map: Optional[torch.Tensor] = None) -> ProjectedHeads:
    """Fresh heads of any family, initialised from the backbone as each family prescribes."""
    if spec.kind == "medusa":
        return MedusaHeads.from_lm_head(spec, lm_head_weight, token_map)
    from .dependent_heads import HEAD_FAMILIES

    return HEAD_FAMILIES[spec.kind].from_backbone(spec, lm_head_weight, input_embeddings, token_map)


# -- export format ---------------------------------------------------------------------
def heads_state_dict(heads: ProjectedHeads) -> dict[str, torch.Tensor]:
    """The tensors the export stores: blocks, projections (unless shared), token map."""
    return {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}


def save_heads(heads: ProjectedHeads, out_dir: str | os.PathLike,
               state_dict: Optional[dict[str, torch.Tensor]] = None, extra=None) -> Path:
    """Write the export atomically: a temp dir beside ``out_dir`` renamed into place.

    A crash at any point leaves either the previous export or the new one, never a mix.
    ``state_dict`` lets a distributed trainer pass gathered weights; ``extra(tmp_dir)`` writes
    more files into the same atomic directory (Medusa-2's adapter).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = state_dict if state_dict is not None else heads_state_dict(heads)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "kind": heads.spec.kind})
        (tmp / CONFIG_FILE).write_text(json.dumps(heads.spec.to_dict(), indent=2) + "\n")
        if extra is not None:
            extra(tmp)
        swap_dir_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def swap_dir_into_place(tmp: Path, out: Path) -> None:
    """Rename a complete ``tmp`` directory to ``out``; an existing ``out`` is replaced only once the
    new one is in place (and put back if the rename fails), so a crash never leaves neither."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _foreign_importer(d: Path):
    """``inference.formats.importers`` when ``d`` is a reference-Medusa / TGI / vLLM layout, else None."""
    from .formats import importers  # lazy: it imports this module

    return importers if importers.detect_layout(d) else None


def read_heads_spec(heads_dir: str | os.PathLike) -> HeadsSpec:
    d = Path(heads_dir)
    if (foreign := _foreign_importer(d)) is not None:
        return foreign.read_foreign_spec(d)
    if not d.is_dir():
        raise UserError(f"heads directory not found: {d}")
    missing = [f for f in EXPORT_FILES if not (d / f).is_file()]
    if missing:
        raise UserError(f"{d} is not a heads export: missing {', '.join(missing)}")
    try:
        raw = json.loads((d / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{d / CONFIG_FILE} is not valid JSON ({e})") from None
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(f"{d} was written by a newer medusa-train (format {raw['format_version']})")
    try:
        return HeadsSpec.from_dict(raw)
    except TypeError as e:
        raise UserError(f"{d / CONFIG_FILE} is not a heads config ({e})") from None


def check_compatible(spec: HeadsSpec, backbone_config, where: str = "heads") -> None:
    """Refuse heads made for another backbone, naming the first mismatch."""
    cfg = backbone_config
    if spec.hidden_size != cfg.hidden_size:
        raise IncompatibleHeadsError(
            f"{where} were trained for hidden size {spec.hidden_size}, the backbone has {cfg.hidden_size}")
    if spec.vocab_size != cfg.vocab_size:
        raise IncompatibleHeadsError(
            f"{where} were trained for vocab size {spec.vocab_size}, the backbone has {cfg.vocab_size}")
    fp = backbone_fingerprint(cfg)
    if spec.base_model_fingerprint and spec.base_model_fingerprint != fp:
        raise IncompatibleHeadsError(
            f"{where} were trained on a backbone with config fingerprint {spec.base_model_fingerprint} "
            f"({spec.base_model or 'unknown'}), this backbone's is {fp}")


def load_heads(heads_dir: str | os.PathLike, backbone_config=None,
               lm_head_weight: Optional[torch.Tensor] = None,
               device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
               input_embeddings: Optional[torch.Tensor] = None) -> ProjectedHeads:
    """Load an export strictly; with ``backbone_config``, refuse heads made for another model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(heads_dir)
    if (foreign := _foreign_importer(d)) is not None:
        return foreign.import_heads(d, backbone_config, lm_head_weight, device=device, dtype=dtype)
    spec = read_heads_spec(d)
    if backbone_config is not None:
        check_compatible(spec, backbone_config, where=f"heads in {d}")
    try:
        tensors = load_file(str(d / WEIGHTS_FILE), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{d / WEIGHTS_FILE} is corrupt or unreadable ({e})") from None
    heads = build_heads(spec)
    expected = heads.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise UserError(f"{d / WEIGHTS_FILE} does not match its config: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(
                f"{d / WEIGHTS_FILE}: {name} has shape {tuple(t.shape)}, config implies {tuple(expected[name].shape)}")
    heads.load_state_dict(tensors, strict=True)
    if heads.needs_lm_head and lm_head_weight is None:
        raise UserError(f"heads in {d} share the backbone lm_head: pass the backbone to load them")
    if heads.needs_input_embeddings and input_embeddings is None:
        raise UserError(f"{spec.kind} heads in {d} read the backbone's input embeddings: pass the backbone to load them")
    heads.attach_backbone(lm_head_weight, input_embeddings)
    if dtype is not None:
        heads.to(dtype=dtype)  # token_map stays long: .to(dtype) only casts floating tensors
    return heads.to(device).eval()
