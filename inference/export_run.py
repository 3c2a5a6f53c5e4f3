"""What ``medusa-export`` runs once its keys are accepted (``export_cli.check_keys``): the heads checked
against their target, loaded, and written in the format's layout. Imports torch and the loaders at its top:
``export_cli`` imports it only then, so ``--help`` and a mistyped key cost nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from .backbone import load_backbone, load_backbone_config, load_tokenizer
from .errors import NeedsBackboneConfig, UserError
from .formats.export import (TOKENIZER_FILES, ExportOptions, FormatWarning, check_adapter, check_out_dir, export_heads,
                             exporter_for, megabytes)
from .heads.native import recover_dir
from .heads.spec import check_compatible
from .loading import export_target, load_heads, read_heads_spec

PLACEHOLDER_DIR = "<this dir>"   # how the exporters' plans (formats/*.py) name the folder they write


def run_export(cfg) -> None:
    """Export the heads of ``cfg`` (an ``export_cli.ExportConfig`` whose keys ``check_keys`` accepted)."""
    dtype = None if cfg.dtype == "keep" else getattr(torch, cfg.dtype)
    src, out = Path(cfg.heads), Path(cfg.out)
    check_out_dir(out, cfg.overwrite, source=src)   # never the heads' own folder, one above or inside it

    with warnings.catch_warnings(record=True) as caught:  # held back: a refusal below is then the one line printed
        warnings.simplefilter("always", FormatWarning)
        # The native loader's errors for a dir that is no heads at all, then the registry's for a
        # kind this format has no exporter for and a LoRA adapter no engine can apply, from the heads'
        # config alone (``_spec_from_config``); then the target's config (from backbone= or the heads'
        # own base model, possibly a hub download) so heads made for another target are refused.
        early, base_model = _spec_from_config(src), cfg.base_model or ""
        if early is not None:
            exporter_for(cfg.format, early.kind)
            base_model = _engine_base_model(cfg.base_model, early, src)
            check_adapter(early, base_model)
        first, target = export_target(src, cfg.backbone, trust_remote_code=cfg.trust_remote_code)
        exporter_for(cfg.format, first.kind)
        if cfg.base_model:
            base_model = _checked_base_model(cfg.base_model, first, src, cfg.trust_remote_code)
        # Shared heads get an empty placeholder here: the backbone's lm_head is read below only if
        # the chosen format needs it (vLLM copies it, materialisation expands it; TGI v2 does not).
        # Likewise an empty input-embedding table for drafters that borrow the backbone's (EAGLE-3):
        # no format stores it, so an export never reads it.
        heads = load_heads(src, backbone_config=target, lm_head_weight=torch.empty(0),
                           input_embeddings=torch.empty(0))
    for w in caught:   # now shown: one line each, each message once (cli_support.warnings_as_lines)
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    spec = heads.spec

    loaded = {} if target is None else {"config": target}

    def backbone_lm_head():
        if "w" not in loaded:
            name = cfg.backbone or spec.base_model
            if not name:
                raise UserError(f"heads in {src} do not record their backbone; pass backbone=")
            print(f"reading the lm_head of {name} ...", file=sys.stderr)
            # dtype "auto": the checkpoint's own dtype (a 7B model in bf16 needs half the memory of
            # fp32); the matrix is then cast to the heads' dtype, losslessly for bf16/fp16 -> fp32.
            model, _, _ = load_backbone(name, dtype="auto", trust_remote_code=cfg.trust_remote_code)
            if not spec.vocab_size:  # TGI-v2 dir without vocab_size: the backbone's vocabulary
                spec.vocab_size = model.config.vocab_size
            check_compatible(spec, model.config, where=f"heads in {src}")
            loaded.setdefault("config", model.config)
            heads_dtype = next((p.dtype for p in heads.parameters()), torch.float32)
            loaded["w"] = model.get_output_embeddings().weight.detach().to(heads_dtype).clone()
        return loaded["w"]

    def backbone_config():
        """The backbone's config without its weights (None when it cannot be read: a note says so)."""
        if "config" not in loaded:
            loaded["config"] = _read_backbone_config(cfg.backbone or spec.base_model, cfg.trust_remote_code)
        return loaded["config"]

    def tokenizer_files():
        return _tokenizer_files(cfg.backbone or spec.base_model, cfg.trust_remote_code)

    options = ExportOptions(materialize=cfg.materialize, lm_head=backbone_lm_head,
                            base_model=base_model, dtype=dtype,
                            backbone_config=backbone_config, tokenizer_files=tokenizer_files)
    result = export_heads(heads, cfg.format, out, overwrite=cfg.overwrite, options=options)
    for note in result.notes:   # the plans name the folder "<this dir>": the user wants a command to paste
        print(note.replace(PLACEHOLDER_DIR, str(result.path)))
    base = base_model or spec.base_model
    if not base or ":" in base.split("/")[0]:
        print(f"note: the config records base model {base!r}, which engines cannot load: "
              "pass base_model=<hub id or path>")
    elif target is None and not cfg.backbone and base == spec.base_model and _looks_local(base):
        print(f"note: the heads' base model {base} is not found here: the export was not checked against it, and "
              "the engine will not find it either; pass base_model=<hub id or path> (backbone= to check against it)")
    template = getattr(spec, "chat_template_args", None)
    if template and cfg.format != "native":   # engines render prompts themselves: the heads' rendering is not theirs
        shown = json.dumps(template)
        print(f"note: these heads were trained on prompts rendered with the chat template variables {shown}: serve "
              f"with the same (vLLM and SGLang: \"chat_template_kwargs\": {shown} in each request)")
    print(f"wrote {result.path} ({', '.join(result.files)}; weights {megabytes(result.weight_bytes)})")


def _spec_from_config(src: Path):
    """The heads' spec from their own config, so that what it alone decides is refused before ``export_target``
    reads the target's config: that read can be a hub download (offline: half a minute of retries and their log
    lines before the refusal). None for a dir whose spec needs the target (``NeedsBackboneConfig``: an EAGLE-3
    one naming no aux ids, which has no backbone adapter); its kind is checked once the target is read."""
    try:
        with warnings.catch_warnings():   # the load below gives the layout's notes once
            warnings.simplefilter("ignore", FormatWarning)
            return read_heads_spec(src)
    except NeedsBackboneConfig:
        return None


def _looks_local(name: str) -> bool:
    """A backbone name that can only be a local folder (a hub id has no leading /, . or ~), or one that exists."""
    return name.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(name))


def _checked_base_model(given: str, spec, src: Path, trust_remote_code: bool) -> str:
    """``base_model=`` as the engine config should name it: a hub id as given (not reachable here to check); a local
    folder by its absolute path, once its config shows a model these heads fit. A mistyped path or another model's
    folder was written into the config and the printed serve command with no word (``backbone=`` refuses both)."""
    if not _looks_local(given):
        return given
    local = os.path.expanduser(given)
    if not os.path.isdir(local):
        raise UserError(f"base_model={given}: no such folder (a local model for the engine to load; a hub id has no "
                        "leading /, . or ~)")
    path = os.path.abspath(local)
    check_compatible(spec, load_backbone_config(path, trust_remote_code=trust_remote_code),
                     where=f"heads in {src} on base_model={given}")
    return path


def _engine_base_model(given: Optional[str], spec, src: Path) -> str:
    """The base model the engine config names ("" = the heads' own). Heads trained with a LoRA adapter on
    their backbone (Medusa-2) need the backbone with it merged: ``base_model=``, or the ``merged/`` folder
    ``lora.merge=true`` wrote beside them; ``formats.export.check_adapter`` refuses them otherwise."""
    if given or not spec.backbone_adapter:
        return given or ""
    merged = src.resolve().parent / "merged"
    recover_dir(merged)   # a merge killed between its two renames left the complete previous one in .merged.old-*
    if (merged / "config.json").is_file():
        print(f"note: these heads were trained with a LoRA adapter on their backbone: the engine config names "
              f"the merged backbone {merged} (pass base_model= to name another copy of it)")
        return str(merged)
    return ""




def _tokenizer_files(name: Optional[str], trust_remote_code: bool) -> dict:
    """The backbone tokenizer's files as {name: text}, its chat template inside ``tokenizer_config.json``
    and as ``chat_template.json`` (the two places TGI's router reads it; transformers 5 saves it as
    ``chat_template.jinja``, which TGI does not read); {} when the tokenizer cannot be read."""
    if not name or name.startswith("random:"):
        return {}
    try:
        tokenizer = load_tokenizer(name, trust_remote_code=trust_remote_code)
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            files = {f: (Path(tmp) / f).read_text(encoding="utf-8") for f in TOKENIZER_FILES
                     if (Path(tmp) / f).is_file()}
    except Exception:   # noqa: BLE001 (a missing sentencepiece, a remote-code tokenizer's error): the export
        return {}        # goes on without the files, and says how to give TGI the template instead
    if "tokenizer.json" not in files and "vocab.json" not in files:
        return {}
    template = tokenizer.chat_template
    if isinstance(template, dict):   # named templates: the list form tokenizer_config.json keeps them in
        template = [{"name": k, "template": v} for k, v in template.items()]
    if template:
        config = json.loads(files.get("tokenizer_config.json", "{}"))
        config["chat_template"] = template
        files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        files["chat_template.json"] = json.dumps({"chat_template": template}, indent=2, ensure_ascii=False) + "\n"
    return files


def _read_backbone_config(name: Optional[str], trust_remote_code: bool):
    """A transformers config for ``name`` (local dir, hub id or ``embedded:``), or None."""
    if not name or name.startswith("random:"):
        return None
    try:   # the backbone's one config reader (a hub the machine cannot reach: its cache alone, at once)
        return load_backbone_config(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, UserError):
        return None
