"""The exporter registry, what an exporter returns, and the one atomic writer all formats share.

An exporter is a pure function ``(heads, ExportOptions) -> ExportPlan``: it decides names,
shapes, dtypes and config keys, or refuses with a ``UserError`` naming why the format cannot
hold these heads. Writing is done here, once: a temp dir beside ``out`` renamed into place, so
a crash leaves the previous directory or the new one, never a half-written engine checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Optional

import safetensors.torch   # safetensors.torch.save_file looked up when writing (tests make it fail)
import torch
from safetensors import SafetensorError

from ..errors import FormatWarning, UserError  # noqa: F401  (FormatWarning: the formats' import)
from ..heads.native import make_temp_dir, open_permissions, recover_dir, release_temp_dir, swap_dir_into_place
from . import FORMATS, load_builtin_formats
from .importers import detect_layout

_EXPORTERS: dict[tuple[str, str], Callable] = {}


class ExportWriteError(UserError, OSError):
    """``write_plan`` could not write ``out`` (a full disk, a quota, a file system gone read-only) and left it as it
    was: a ``UserError``, so ``medusa-export`` says so in one line (it was a traceback), and still an ``OSError``."""


@dataclasses.dataclass
class ExportOptions:
    """What an exporter may use besides the heads.

    materialize: expand a shared / truncated projection into full per-head projections for a
                 format that has no other way to hold it (size cost reported in the plan's notes).
    lm_head:     a callable giving the backbone's lm_head weight [vocab, hidden]; called only by
                 exporters that need it, so formats that do not never load the backbone.
    base_model:  the name written into the engine config (hub id or path the engine can load).
    dtype:       cast floating tensors to this dtype (None keeps the heads' own).
    backbone_config: a callable giving the backbone's transformers config (or None when it cannot
                 be read); called only by exporters that copy backbone facts into the engine
                 config (TGI: the attention head size its launcher reads), never loads weights.
    tokenizer_files: a callable giving the backbone tokenizer's files as {name: text} (or {} when it
                 cannot be read); called only by exporters whose engine reads the tokenizer and its
                 chat template from the export itself (TGI's router).
    """

    materialize: bool = False
    lm_head: Optional[Callable[[], torch.Tensor]] = None
    base_model: str = ""
    dtype: Optional[torch.dtype] = None
    backbone_config: Optional[Callable[[], object]] = None
    tokenizer_files: Optional[Callable[[], dict]] = None

    def backbone_lm_head(self, heads) -> torch.Tensor:
        """The lm_head matrix shared heads project with: the one attached to ``heads`` if any
        (imported vLLM dirs carry their own copy), else the backbone's through ``lm_head``."""
        w = getattr(heads, "shared_weight", None)
        if w is None or w.numel() == 0:
            if self.lm_head is None:
                raise UserError("these heads share the backbone lm_head: pass backbone=<model> so it can be read")
            w = self.lm_head()
        spec = heads.spec
        if tuple(w.shape) != (spec.vocab_size, spec.hidden_size):
            raise UserError(f"the backbone lm_head has shape {tuple(w.shape)}, the heads need "
                            f"({spec.vocab_size}, {spec.hidden_size}): wrong backbone")
        return w.detach().cpu()


@dataclasses.dataclass
class ExportPlan:
    """Exactly what goes on disk: ``config.json``, one safetensors file, small text files beside
    them (``extra_files``: name -> content, e.g. a Medusa tree), and lines for the user."""

    config: dict
    weights_file: str
    tensors: dict[str, torch.Tensor]
    notes: list[str] = dataclasses.field(default_factory=list)
    extra_files: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclasses.dataclass
class ExportResult:
    path: Path
    files: list[str]
    weight_bytes: int
    notes: list[str]


def register_exporter(format_name: str, kind: str, files: tuple = ()):
    """Decorator: ``fn(heads, ExportOptions) -> ExportPlan`` exports heads of ``kind`` to ``format_name``, writing
    ``files`` besides config.json (its weights file, a tree file): what ``overwrite=true`` may later replace."""
    if format_name not in FORMATS:
        raise ValueError(f"unknown format {format_name!r}; add it to inference.formats.FORMATS first")
    _EXPORT_FILES.update(files)

    def add(fn):
        _EXPORTERS[(format_name, kind)] = fn
        return fn

    return add


def exporter_for(format_name: str, kind: str) -> Callable:
    load_builtin_formats()
    if format_name not in FORMATS:
        raise UserError(f"unknown format {format_name!r}: choose one of {', '.join(FORMATS)}")
    fn = _EXPORTERS.get((format_name, kind))
    if fn is None:
        kinds = sorted(k for f, k in _EXPORTERS if f == format_name)
        raise UserError(f"format {format_name} has no exporter for heads of kind {kind!r} "
                        f"(it exports kinds: {', '.join(kinds) or 'none'})")
    return fn


def plan_export(heads, format_name: str, options: Optional[ExportOptions] = None) -> ExportPlan:
    """The plan (names, tensors, config) without writing anything: what the engine-spec tests check."""
    options = options or ExportOptions()
    check_adapter(heads.spec, options.base_model)
    kind = getattr(heads.spec, "kind", "medusa")
    plan = exporter_for(format_name, kind)(heads, options)
    if options.dtype is not None:
        plan.tensors = {k: (_cast_checked(k, v, options.dtype) if v.is_floating_point() else v)
                        for k, v in plan.tensors.items()}
        plan.config["torch_dtype"] = str(options.dtype).removeprefix("torch.")
    plan.tensors = {k: v.detach().cpu().contiguous() for k, v in plan.tensors.items()}
    return plan


def _cast_checked(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` cast to ``dtype``, refused in one line when a finite value becomes inf: the engine would run inf weights
    (NaN logits) and the project's own loader refuses the export."""
    cast = t.to(dtype)
    overflow = torch.isinf(cast) & torch.isfinite(t)
    if overflow.any():
        largest = t[overflow].abs().max().item()
        short = str(dtype).removeprefix("torch.")
        raise UserError(f"dtype={short} cannot hold tensor {name}: a value of magnitude {largest:.6g} is beyond "
                        f"{short}'s range (+-{torch.finfo(dtype).max:.6g}); keep the heads' dtype (dtype=keep) or "
                        "choose one with a wider range (bfloat16, float32)")
    return cast


def export_heads(heads, format_name: str, out, *, overwrite: bool = False,
                 options: Optional[ExportOptions] = None) -> ExportResult:
    """Plan, then write ``out`` atomically. A non-empty ``out`` is refused unless ``overwrite``."""
    out = Path(out)
    check_out_dir(out, overwrite)
    plan = plan_export(heads, format_name, options)
    write_plan(plan, out)
    return ExportResult(path=out, files=sorted(["config.json", plan.weights_file, *plan.extra_files]),
                        weight_bytes=plan.weight_bytes, notes=plan.notes)


def check_out_dir(out: Path, overwrite: bool, source: Optional[Path] = None) -> None:
    """Refuse, in one line, an ``out`` the export must not write: ``source`` itself, a folder holding it
    or one inside it (replacing it would delete the heads being read), a file, a symbolic link, a non-empty
    folder without ``overwrite``, and, even with ``overwrite``, a non-empty folder that is not an export
    (``_is_export``: a training run, a home folder), or a place that cannot be created. A save into ``out`` killed
    between its two renames left ``out`` missing and its previous content beside it: that content is put back first
    and judged as ``out`` (it was restored and then replaced by the export, without ``overwrite``: a run's trained
    heads were deleted)."""
    recover_dir(out)
    if source is not None:
        src, dst = Path(source).resolve(), out.resolve()   # symlinks followed: the folders actually touched
        if dst == src:
            raise UserError("out= must differ from heads= (the export would replace its own source)")
        if dst in src.parents:
            raise UserError(f"out={out} holds heads={source}: the export would delete the heads it reads; "
                            "give out= a folder of its own")
        if src in dst.parents:
            raise UserError(f"out={out} is inside heads={source}: give out= a folder outside the heads")
    if out.is_symlink():   # the swap renames out= itself: a link (dangling or not) cannot be replaced by a folder
        raise UserError(f"out={out} is a symbolic link (to {os.readlink(out)}): give out= the folder itself, "
                        "or a new one")
    if out.exists() and not out.is_dir():
        raise UserError(f"out={out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"out={out} is not empty: pass overwrite=true to replace it")
        if not _is_export(out):
            raise UserError(f"out={out} is not an export (overwrite=true replaces only a previous export: an engine "
                            "layout's config.json and the files exports write): give out= a new or empty folder")
    base = out.absolute().parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UserError(f"out={out} cannot be created: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"out={out} cannot be created: {base} is not writable")


# The tokenizer files an export may carry (``ExportOptions.tokenizer_files``), the chat template's own file too.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.json")
# Every name an export writes: config.json, the tokenizer files, and what each exporter declared when it registered
# (``register_exporter(files=)``). A folder holding anything else is not one of ours to replace.
_EXPORT_FILES: set = {"config.json", *TOKENIZER_FILES}


def export_files() -> frozenset:
    """Every file name an export of a registered format may hold."""
    load_builtin_formats()
    return frozenset(_EXPORT_FILES)


def _is_export(folder: Path) -> bool:
    """Whether ``folder`` is a previous export, which ``overwrite=true`` may replace: a flat folder of the files
    exports write (``export_files``) whose config a format's importer recognises. A training run (subfolders), a
    model folder (generation_config.json; a config no drafter layout has), another run's heads (the native
    config) or a downloaded drafter with other files (a ``.pt``) is not one."""
    entries = list(folder.iterdir())
    if not (folder / "config.json").is_file() or any(e.is_dir() or e.is_symlink() for e in entries):
        return False
    load_builtin_formats()
    if any(e.name not in _EXPORT_FILES for e in entries):
        return False
    return detect_layout(folder) is not None


def _writable_temp_dir(out: Path) -> Path:
    """``out``'s parent created and a temp dir made in it, or one line saying why it cannot be (a
    folder where the file system refuses new entries, e.g. under /proc, passes ``check_out_dir``)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return make_temp_dir(out)  # clears what writers killed here left first (heads.native.recover_dir)
    except OSError as e:
        raise UserError(f"out={out} cannot be created ({e.strerror or e})") from None


def write_plan(plan: ExportPlan, out: Path) -> None:
    """Write config + weights (+ the plan's extra files) into a temp dir beside ``out``, then swap it
    in (old one removed last).

    A kill at any point leaves the previous ``out`` or the new one (possibly moved aside as
    ``.<out>.old-*`` between the swap's renames); the next write into ``out`` recovers and cleans
    up first (``heads.native.recover_dir``)."""
    tmp = _writable_temp_dir(out)
    try:
        # metadata format=pt: transformers' and the engines' safetensors readers expect it.
        safetensors.torch.save_file(plan.tensors, str(tmp / plan.weights_file), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
        for name, text in plan.extra_files.items():  # inside the same swap: all files or none
            if "/" in name or name in ("config.json", plan.weights_file):
                raise ValueError(f"extra file name {name!r} must be a plain name other than the plan's own files")
            (tmp / name).write_text(text, encoding="utf-8")
        open_permissions(tmp)   # an engine running as another user (a container) must read them
        swap_dir_into_place(tmp, out)
    except (OSError, SafetensorError) as e:   # safetensors reports its I/O errors (a full disk) as SafetensorError
        reason = (e.strerror if isinstance(e, OSError) else None) or str(e)
        raise ExportWriteError(f"out={out} could not be written ({reason}): nothing was changed there") from e
    finally:
        release_temp_dir(tmp)


def check_adapter(spec, base_model: str) -> None:
    """Refuse heads trained with a LoRA adapter on their backbone (Medusa-2) unless ``base_model`` names the
    model the engine must serve: engines load the config's base model as it is and cannot apply an adapter,
    so the recorded (un-adapted) backbone would feed the heads hidden states they were never trained on."""
    if getattr(spec, "backbone_adapter", None) and not base_model:
        raise UserError(f"these heads were trained with a LoRA adapter on their backbone ({spec.backbone_adapter}/): "
                        "an engine would serve the backbone without it; pass base_model=<the backbone with the "
                        "adapter merged> (rerunning the training command with lora.merge=true writes <run>/merged)")


# -- helpers shared by exporters --------------------------------------------------------------
def refuse_unless_kind(heads, kind: str = "medusa") -> None:
    got = getattr(heads.spec, "kind", "medusa")
    if got != kind:
        raise UserError(f"this exporter handles {kind} heads, got kind {got!r}")


def megabytes(n_bytes: int) -> str:
    """A byte count for people: 512 B, 37.5 KiB, 258.0 MiB, 1.9 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.1f} {unit}"
    return f"{n_bytes} B"


def full_projection(heads, k: int, options: ExportOptions) -> tuple[torch.Tensor, bool]:
    """Head k's projection as a full [vocab, hidden] matrix, and whether it had to be materialised.

    own: the head's own matrix. shared: a copy of the backbone lm_head (exact: same logits).
    truncated: zeros with the head's rows placed at their token ids. There is no bias in these
    layouts, so a token outside the map gets logit exactly 0 instead of "never": it can outrank
    the mapped tokens only when every mapped logit is negative. The engine verifies every draft
    against the backbone, so outputs never change; at worst a draft is wasted.
    """
    spec = heads.spec
    if spec.projection == "own":
        return heads.projections_list[k].weight.detach(), False
    if spec.projection == "shared":  # a copy per head: safetensors refuses tensors sharing memory
        return options.backbone_lm_head(heads).clone(), True
    local = heads.projections_list[k].weight.detach()
    full = torch.zeros(spec.vocab_size, local.shape[1], dtype=local.dtype)
    full[heads.token_map.cpu()] = local.cpu()
    return full, True


def written_bytes(t: torch.Tensor, options: ExportOptions) -> int:
    """The bytes ``t`` takes in the written file: cast to ``options.dtype`` when set and ``t`` is floating
    (``plan_export`` casts after the exporter planned; a size note in the source dtype was off by 2x)."""
    cast = options.dtype is not None and t.is_floating_point()
    return t.numel() * (torch.finfo(options.dtype).bits // 8 if cast else t.element_size())


def stored_projection_bytes(heads, options: ExportOptions) -> int:
    """What the heads' own projections and a truncated map take as written (0 for shared heads: they have none), the
    size a materialised export is compared with."""
    if heads.projections is None:
        return 0
    n = sum(written_bytes(p.weight, options) for p in heads.projections)
    return n + (heads.token_map.numel() * 8 if heads.token_map is not None else 0)


def materialise_note(heads, fmt: str, bytes_before: int, bytes_after: int) -> str:
    spec = heads.spec
    what = {"shared": "the shared backbone lm_head copied into every head",
            "truncated": (f"each {spec.truncated_vocab_size}-token projection expanded to the full "
                          f"{spec.vocab_size}-token vocabulary (tokens outside the map get logit 0, "
                          "not -inf: a draft may be wasted when all mapped logits are negative; "
                          "outputs are unchanged, the engine verifies every draft)")}[spec.projection]
    return (f"materialised for {fmt}: {what}; projections {megabytes(bytes_before)} -> "
            f"{megabytes(bytes_after)} (+{megabytes(bytes_after - bytes_before)})")
