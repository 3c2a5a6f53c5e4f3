"""Resumable checkpoints: pickle-free, atomic, the last M kept, found again by ``resume=auto``.

Layout under ``<output_dir>/checkpoints/``::

    step-000050/
        heads.safetensors       fp32 master weights of the heads (+ token map buffer)
        optimizer.safetensors   AdamW moments per parameter (exp_avg.<name>, exp_avg_sq.<name>)
        rng-rank{r}.safetensors every rank's RNG state
        trainer_state.json      step, optimizer step, LR scheduler, data position, config
    latest                      the name of the newest complete checkpoint

Every tensor is gathered into its full (unpartitioned) shape through DeepSpeed's
``safe_get_full_*`` API, so a checkpoint does not depend on the ZeRO stage or world size it
was written with and nothing is ever unpickled (DeepSpeed's own ``save_checkpoint`` writes
torch pickles). A checkpoint is written under a temporary name and renamed once complete,
so a kill mid-write leaves the previous checkpoint as ``latest``.

Resuming under a changed configuration (``check_resume_config``)
-----------------------------------------------------------------
``trainer_state.json`` keeps the run's whole configuration (``config``, resolved) and its
effective global batch. Before anything is loaded, a resume compares it with the new one, key
by key, and refuses in one line naming the keys that differ when a change would make the
resumed run a different run than the one checkpointed. A refused change goes to a new
``output_dir`` (or ``trainer.resume=never``, which starts fresh in the same one).

*Safe* (they pass; ``SAFE_KEYS``): how long and how often, not what is trained --
``trainer.max_steps`` (train further or stop earlier), ``trainer.save_every``, ``trainer.keep_last``,
``trainer.log_every``, ``trainer.eval_every``, ``trainer.resume``, ``trainer.progress_bar``,
``trainer.threads``, ``trainer.device``, ``logger.*``, ``output_dir``, ``recipe`` (a label);
where and at which precision the same maths runs -- ``trainer.zero_stage`` and ``trainer.precision``
(checkpoints hold full fp32 weights and moments whatever the stage or precision, see above),
``trainer.global_batch_size`` as long as the *effective* global batch (rows per optimizer step) is
unchanged (it is compared instead), ``backbone.attn_implementation``
(same function, another kernel), ``backbone.trust_remote_code``, ``features.cache_dir`` (a location),
``lora.merge`` (what is written after training), ``lora.gradient_checkpointing`` (the same maths recomputed), and
``task`` / ``distill.*`` (not training).

A key written out with the value the run already resolved is no change (``resolved_settings``):
``heads.loss_weights`` equal to decay^k, and whatever the heads family resolves itself
(``TrainingFamily.resolved``; e.g. eagle3's ``heads.aux_layers`` equal to the layers the default picked,
in any order, ``heads.ttt_steps`` equal to ``num_heads``, ``heads.draft_vocab_size`` equal to the
truncated vocabulary; mlp_speculator's ``heads.inner_dim`` equal to the backbone's width), and the
reverse (a run that spelled them out resumed without them). A run recorded before the heads keys were
split by family (every family's keys in every record) resumes: keys its family no longer has are gone
from the new configuration, so they are not compared.

*Unsafe* (refused): everything else, and any key added later until it is listed as safe (against a
checkpoint from before the key existed: set away from its default). In
particular whatever changes the heads' shapes (``heads.*``: number, layers, projection,
truncated vocabulary, kind), the data order or content (``data.*``, ``trainer.seed``,
``features.mode`` / ``.dtype`` / ``.shard_batches``), the loss (``heads.loss_*``,
``heads.targets``, ``heads.train_on``, ``heads.teacher_weight``, ``lora.*``, the backbone: ``backbone.*``), or the
optimizer's meaning (``optim.*``, ``trainer.grad_clip``, the effective global batch; the LR
schedule's base LR is restored from the checkpoint, so a changed ``optim.lr`` would not even
take effect). ``trainer.micro_batch_size`` too, even with the effective batch unchanged: the saved data
position counts micro-batches, so under another micro-batch size it points at other rows (some trained
twice, some skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from inference.errors import UserError, first_line
from inference.heads.native import sync_tree
from .backbone import backbone_config
from .config import RecipeConfig, loss_weights
from .data.readers import data_fingerprint
from .families import training_family
from .manifest import RECORD_DIR

STATE_FILE = "trainer_state.json"
LATEST = "latest"

# Configuration keys (dotted; a trailing ".*" covers a whole section) that may change between a
# checkpoint and its resume: see the module docstring for why each is safe. Everything else is unsafe.
SAFE_KEYS = (
    "recipe", "output_dir", "task", "distill.*", "logger.*",
    "trainer.max_steps", "trainer.save_every", "trainer.keep_last", "trainer.log_every", "trainer.eval_every",
    "trainer.resume", "trainer.progress_bar", "trainer.threads", "trainer.device",
    "trainer.zero_stage", "trainer.precision", "trainer.global_batch_size",
    "backbone.attn_implementation", "backbone.trust_remote_code", "features.cache_dir", "lora.merge",
    "lora.gradient_checkpointing",
)
EFFECTIVE_BATCH = "trainer.global_batch_size (effective)"


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_tag(step: int) -> str:
    return f"step-{step:06d}"


def find_resume(output_dir: Path, resume: str) -> Optional[Path]:
    """The checkpoint to resume from, or None to start fresh."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise UserError(f"trainer.resume={resume!r} is not a checkpoint directory (no {STATE_FILE})")
        return path
    root = checkpoints_dir(output_dir)
    latest = root / LATEST
    if latest.is_file():
        path = root / latest.read_text().strip()
        if (path / STATE_FILE).is_file():
            return path
    complete = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file())
    return complete[-1] if complete else None


def read_state(path: Path) -> dict:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint {path} is corrupt ({STATE_FILE}: {e}); delete it to resume from an earlier one")


def flatten(tree, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out = {}
    for k, v in (tree or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def is_safe_key(key: str) -> bool:
    return any(key == s or (s.endswith(".*") and key.startswith(s[:-1])) for s in SAFE_KEYS)


def unsafe_changes(saved: dict, new: dict, defaults: Optional[dict] = None) -> list[str]:
    """The dotted keys whose values differ between two flat configurations and are not safe to change.

    A key only one side has is compared only when the other side has a value at one of its parents
    (``backbone.random_init`` None vs ``backbone.random_init.hidden_size``: the structure changed);
    otherwise it was added or removed by another version of medusa-train, and the version that did not
    have it behaved as its default: a new key is compared with its default in ``defaults`` (flat; the
    schema's) when given (a checkpoint from before ``heads.train_on`` existed resumes with the default,
    not with ``all``). A setting whose default is a mapping of free entries (``backbone.chat_template_args``) is
    compared whole (``mapping_value``): an entry added, changed or dropped, or set beside a checkpoint from before the
    setting existed (which had its default), is a change of that setting."""
    diff = set()
    mappings = [p for p, v in (defaults or {}).items() if isinstance(v, dict) and not is_safe_key(p)]
    for p in mappings:
        before = mapping_value(saved, p)
        if _norm(defaults[p] if before is None else before) != _norm(mapping_value(new, p) or {}):
            diff.add(p)
    for k in set(saved) | set(new):
        if is_safe_key(k) or any(k == p or k.startswith(p + ".") for p in mappings):
            continue
        if k in saved and k in new:
            if _norm(saved[k]) != _norm(new[k]):
                diff.add(k)
            continue
        other = new if k in saved else saved
        parents = [".".join(k.split(".")[:i]) for i in range(1, k.count(".") + 1)]
        hit = next((p for p in parents if p in other), None)
        if hit is not None and not is_safe_key(hit):
            diff.add(hit)
        elif hit is None and k in new and defaults is not None and k in defaults:
            if _norm(defaults[k]) != _norm(new[k]):
                diff.add(k)
    return sorted(diff)


def mapping_value(flat: dict, key: str):
    """The value at ``key`` of a flat configuration, a mapping rebuilt from its ``key.<entry>`` keys (``flatten``
    lays a mapping's entries out, an empty one stays a leaf); None where the configuration has no such key."""
    entries = {k[len(key) + 1:]: v for k, v in flat.items() if k.startswith(key + ".")}
    if entries:
        return {**(flat[key] if isinstance(flat.get(key), dict) else {}), **entries}
    return flat.get(key)


def schema_defaults(kind: str = "medusa") -> dict:
    """Every configuration key's default (flat), from the recipe schema with heads family ``kind``'s group."""
    return flatten(_norm(dataclasses.asdict(RecipeConfig(heads=training_family(kind).config(kind=kind)))))


def _norm(v):
    return json.loads(json.dumps(v, default=str))  # tuples -> lists, enums -> str: compare what was saved


def check_resume_config(path: Path, state: dict, config: dict, effective_batch: int,
                        resolve: Optional[Callable[[dict], dict]] = None) -> None:
    """Refuse (one line naming the keys) to resume checkpoint ``path`` under a configuration that
    differs from its own in a key that is not safe to change (module docstring). ``config`` is the
    new run's resolved configuration (nested), ``state`` the checkpoint's trainer state; ``resolve``
    (``resolved_settings`` bound to the backbone) maps a configuration to the values its automatic keys
    took, so a key written out with the value the run resolved is the same run."""
    if not config:  # nothing to compare with (a configuration that is not a config tree)
        return
    saved = state.get("config")
    new = flatten(config)
    if saved is None:  # written before configurations were stored: compare what the state has
        spec = state.get("heads") or {}
        saved_flat = {f"heads.{k}": spec[k] for k in ("num_heads", "num_layers", "projection", "kind") if k in spec}
        if spec.get("projection") == "truncated" and "truncated_vocab_size" in spec:
            saved_flat["heads.truncated_vocab_size"] = spec["truncated_vocab_size"]
        diff = [k for k in saved_flat if k in new and _norm(saved_flat[k]) != _norm(new[k])]
        saved = {k: saved_flat.get(k) for k in diff}
    else:
        saved = flatten(saved)
        defaults = schema_defaults(str((config.get("heads") or {}).get("kind", "medusa")))
        diff = unsafe_changes(saved, new, defaults)
        if diff and resolve is not None:
            diff = unresolved_changes(diff, state["config"], config, resolve)
        saved = {**{k: defaults[k] for k in diff if k not in saved and k in defaults}, **saved}
    if "global_batch_size" in state and int(state["global_batch_size"]) != int(effective_batch):
        diff.append(EFFECTIVE_BATCH)
        saved, new = {**saved, EFFECTIVE_BATCH: state["global_batch_size"]}, {**new, EFFECTIVE_BATCH: effective_batch}
    if diff:
        shown = ", ".join(f"{k} ({_short(mapping_value(saved, k))} -> {_short(mapping_value(new, k))})"
                          for k in diff[:6])
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        raise UserError(f"cannot resume {path}: it was trained with a different configuration: {shown}{more}; "
                        "these change what is trained, so use a new output_dir (or trainer.resume=never to "
                        "start over here), or rerun with the checkpoint's values")


def unresolved_changes(diff: list[str], saved: dict, new: dict, resolve: Callable[[dict], dict]) -> list[str]:
    """The keys of ``diff`` that still differ once both configurations' automatic values are resolved
    (``heads.aux_layers=null`` and the layers that default picks are the same drafter)."""
    try:
        before, after = resolve(saved), resolve(new)
    except UserError:  # the saved configuration does not resolve on this backbone: compare as written
        return diff
    return [k for k in diff if not (k in before and k in after and _norm(before[k]) == _norm(after[k]))]


def resolved_settings(config: dict, hf_config) -> dict:
    """The values the automatic heads keys of a configuration (nested, as saved) take on the backbone
    ``hf_config`` describes, flat: the loss weights (decay^k) and the family's own (``TrainingFamily.resolved``)."""
    saved = config.get("heads") or {}
    fam = training_family(saved.get("kind", "medusa"))
    h = SimpleNamespace(**{**dataclasses.asdict(fam.config()), **saved})
    return {"heads.loss_weights": loss_weights(h), **fam.resolved(h, hf_config)}


def trained_record_changes(cfg) -> Optional[list[str]]:
    """The keys in which ``cfg`` differs from the record of the heads a finished run left in ``cfg.output_dir``
    (``.hydra/config.yaml``), compared as a resume compares a checkpoint's (safe keys and a key written out at the
    value the run resolved for it are no change); None when the folder holds no heads or no record this version
    reads: nothing to compare with. What a new run there (``preflight.check_run_folder``) and a task that trains
    no heads there (``keeps_trained_record``) ask."""
    out = Path(os.path.expanduser(str(cfg.output_dir)))
    record = out / RECORD_DIR / "config.yaml"
    if not ((out / "heads").is_dir() and record.is_file()):
        return None
    try:
        saved = OmegaConf.to_container(OmegaConf.load(record), resolve=True)
    except Exception:   # noqa: BLE001 (a record this version cannot read)
        return None
    new = config_dict(cfg)
    diff = unsafe_changes(flatten(saved), flatten(new), schema_defaults(str(new["heads"]["kind"])))
    if diff:   # e.g. heads.aux_layers=null against the layers the run resolved it to
        hf_config = backbone_config(cfg.backbone)
        diff = unresolved_changes(diff, saved, new, lambda config: resolved_settings(config, hf_config))
    return diff


def keeps_trained_record(cfg, ignoring: tuple = ()) -> bool:
    """Whether a task that trains no heads in ``cfg.output_dir`` (a finished run's idle rerun, a feature-cache
    build) leaves the folder's record as it is: it holds heads and a record of a configuration that differs from
    this one in safe keys only (another precision, ``features.mode``), which says how those heads were trained;
    rewritten there, the original command was later refused as "another configuration". A record that differs
    in what training depends on (one a refused command wrote) is not theirs: it is rewritten, as before. Keys
    under the prefixes ``ignoring`` are not compared (a build's own ``features.*``)."""
    diff = trained_record_changes(cfg)
    return diff is not None and not [key for key in diff if not key.startswith(ignoring)]


def config_dict(cfg) -> dict:
    """The resolved configuration as plain JSON-able data (enums as their names): what a checkpoint keeps."""
    if OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if dataclasses.is_dataclass(cfg):
        return json.loads(json.dumps(dataclasses.asdict(cfg), default=lambda v: getattr(v, "value", str(v))))
    return {}


def resume_point(cfg, effective_batch: int) -> tuple[Optional[Path], Optional[dict]]:
    """(checkpoint, its trainer state) that run ``cfg`` resumes, or (None, None) to start fresh; refused in
    one line, before any weight or data loads, when it was trained under another configuration."""
    path = find_resume(Path(cfg.output_dir), cfg.trainer.resume)
    if path is None:
        return None, None
    state = read_state(path)
    check_readable(path)

    @functools.cache
    def hf_config():  # read only when a differing key may be an automatic one written out
        return backbone_config(cfg.backbone)

    check_resume_config(path, state, config_dict(cfg), effective_batch,
                        lambda config: resolved_settings(config, hf_config()))
    check_resume_data(path, state, cfg.data)
    return path, state


def check_resume_data(path: Path, state: dict, data_cfg) -> None:
    """Refuse to resume a checkpoint on a local ``data.source`` whose content changed since it was saved (the
    saved stream position would point into other conversations: the run neither continues nor starts over).
    Not compared where either side has no fingerprint (a hub dataset, a checkpoint older than the record)."""
    there = state.get("data_fingerprint")
    here = data_fingerprint(data_cfg.source, data_cfg.split) if there else None
    if there and here and there != here:
        raise UserError(f"cannot resume {path}: it was trained on other content of data.source={data_cfg.source} "
                        f"({there} there, {here} now: the data was rewritten) and its saved position in the stream "
                        "would point into other conversations; restore the data, or use a new output_dir (or "
                        "trainer.resume=never to start over here)")


def _short(v) -> str:
    text = json.dumps(_norm(v))
    return text if len(text) <= 40 else text[:37] + "..."


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    py = json.dumps(random.getstate()).encode()
    state["python"] = torch.frombuffer(bytearray(py), dtype=torch.uint8)
    np_state = np.random.get_state()
    state["numpy_keys"] = torch.from_numpy(np_state[1].astype("int64"))
    state["numpy_pos"] = torch.tensor([np_state[2]], dtype=torch.long)
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    py = json.loads(bytes(state["python"].tolist()).decode())
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype("uint32"), int(state["numpy_pos"][0])))


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _base_optimizer(engine):
    """The torch optimizer under DeepSpeed's wrappers (ZeRO / bf16) or the client one itself."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _full_tensor(param, opt, key=None):
    """Full fp32 parameter (key None) or optimizer moment, from any ZeRO stage; collective."""
    # lazy: deepspeed takes 0.5 s to import, and preflight (its resume check) imports this module
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    full = safe_get_full_fp32_param(param) if key is None else safe_get_full_optimizer_state(param, key)
    if full is not None:
        return full
    if key is None:
        return param.detach()
    return opt.state.get(param, {}).get(key, torch.zeros_like(param))  # before the first step


def full_fp32(param) -> torch.Tensor:
    """A parameter's full fp32 value on CPU from any ZeRO stage (master weights under bf16/fp16); collective."""
    return _full_tensor(param, None).float().cpu()


def _optimizer_step(engine) -> int:
    for state in _base_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def gather(engine, keep: bool = True) -> tuple[dict, dict, int]:
    """(weights, optimizer moments, optimizer step), full-size (collective: every rank gathers each tensor); a rank
    that writes nothing (``keep=False``) drops each one as it comes: holding them all, every rank of a node held 12
    bytes a trained parameter in host memory at every save (~32 GB a rank for heads with their own
    full-vocabulary projections at Llama-3.1-8B's shape)."""
    opt = _base_optimizer(engine)
    if getattr(engine.optimizer, "_hp_optimizer_states_linked", False):
        # ZeRO-1/2 (and bf16) step each parameter group in turn and link every parameter to its optimizer state right
        # after the first group's step, once: a second group (Medusa-2's heads beside the adapter) had no state then
        # and stays unlinked ("exp_avg not found" at every save). Link again, now that every group has its state.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    weights, moments = {}, {}
    for name, p in _trainable(engine):
        full = _full_tensor(p, opt)
        if keep:
            weights[name] = full.float().cpu().contiguous()
        for key in ("exp_avg", "exp_avg_sq"):
            full = _full_tensor(p, opt, key)
            if keep:
                moments[f"{key}.{name}"] = full.float().cpu().contiguous()
    for name, b in engine.module.named_buffers():
        if keep and name in engine.module.state_dict():
            weights[name] = b.detach().cpu().contiguous()
    return weights, moments, _optimizer_step(engine)


def save(engine, output_dir: Path, step: int, trainer_state: dict, keep_last: int, rank: int) -> Path:
    """Write checkpoint ``step`` atomically; every rank calls this, rank 0 writes the shared files."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    tag, tmp = step_tag(step), root / f".tmp-{step_tag(step)}"
    weights, moments, opt_step = gather(engine, keep=rank == 0)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)  # leftover of a run killed mid-write
        tmp.mkdir()
    _barrier()
    save_file(rng_state(), str(tmp / f"rng-rank{rank}.safetensors"))
    _barrier()
    final = root / tag
    if rank == 0:
        save_file(weights, str(tmp / "heads.safetensors"))
        save_file(moments, str(tmp / "optimizer.safetensors"))
        sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else {}
        state = {**trainer_state, "optimizer_step": opt_step,
                 "lr_scheduler": sched}  # LambdaLR: numbers only (its lambda is stored as None)
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, default=str) + "\n")
        if final.exists():
            shutil.rmtree(final)
        sync_tree(tmp)   # on the disk before the rename names it complete (a power loss, not only a kill)
        os.replace(tmp, final)
        latest_tmp = root / f".{LATEST}.tmp"
        with open(latest_tmp, "w") as f:
            f.write(tag + "\n")
            f.flush()
            os.fsync(f.fileno())   # the pointer, too, on the disk before it names the step
        os.replace(latest_tmp, root / LATEST)
        for old in _by_write_order(root)[:-keep_last]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _by_write_order(root: Path) -> list[Path]:
    """Checkpoint dirs oldest-written first: the last M *written* are kept, so a fresh run
    (``trainer.resume=never``) in a directory holding an older run's higher steps prunes those
    first instead of its own newest checkpoint."""
    def written(p: Path):
        state = p / STATE_FILE
        return (state.stat().st_mtime if state.is_file() else 0.0, p.name)

    return sorted((p for p in root.glob("step-*") if p.is_dir()), key=written)


def check_readable(path: Path) -> None:
    """Refuse, from the files' headers alone (no tensor is read), a checkpoint whose heads or optimizer state is
    missing, truncated or damaged: ``load`` found it only after the backbone had loaded and the data been scanned."""
    for name in ("heads.safetensors", "optimizer.safetensors"):
        try:   # safetensors checks the header's offsets against the file's length on open
            with safe_open(str(Path(path) / name), framework="pt") as f:
                f.keys()
        except Exception as e:   # noqa: BLE001 (missing, truncated, not safetensors)
            raise UserError(f"checkpoint {path} is incomplete or corrupt ({name}: {first_line(e)}); delete it to "
                            "resume from an earlier one") from None


def holds_token_map(path: Path) -> bool:
    """Whether the checkpoint at ``path`` saved its heads' token map (``load`` restores it), read from the file's
    header alone; False for a checkpoint that cannot be read (``load`` says why)."""
    try:
        with safe_open(str(Path(path) / "heads.safetensors"), framework="pt") as f:
            return any(k.split(".")[-1] == "token_map" for k in f.keys())
    except Exception:   # noqa: BLE001 (a missing or damaged file: load refuses it in one line)
        return False


def load(engine, path: Path, rank: int) -> dict:
    """Restore heads, AdamW state, LR schedule and RNG from ``path``; returns the trainer state."""
    # lazy: deepspeed takes 0.5 s to import, and preflight (its resume check) imports this module
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    path = Path(path)
    state = read_state(path)
    try:
        weights = load_file(str(path / "heads.safetensors"))
        moments = load_file(str(path / "optimizer.safetensors"))
    except Exception as e:
        raise UserError(f"checkpoint {path} is incomplete or corrupt ({e}); delete it to resume from an earlier one")
    opt = _base_optimizer(engine)
    params = dict(_trainable(engine))
    missing = sorted(set(params) - set(weights))
    if missing:
        raise UserError(f"checkpoint {path} does not match these heads (missing {missing[:3]})")
    step_value = float(state.get("optimizer_step", 0))
    _materialize_optimizer_state(engine, opt, step_value)
    for name, p in params.items():
        w = weights[name].to(p.device)
        m, v = (moments[f"{k}.{name}"].to(p.device) for k in ("exp_avg", "exp_avg_sq"))
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # ZeRO / bf16: fp32 master lives in the optimizer
            safe_set_full_fp32_param(p, w)
            safe_set_full_optimizer_state(p, m, "exp_avg")
            safe_set_full_optimizer_state(p, v, "exp_avg_sq")
        else:  # plain torch optimizer: its state is keyed by the module parameter itself
            opt.state[p] = {"step": torch.tensor(step_value), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        _set_module_param(p, w)
    for s in opt.state.values():  # ZeRO keeps one state per flat partition: give each the step
        if "step" in s:
            s["step"] = torch.full_like(s["step"], step_value) if torch.is_tensor(s["step"]) else step_value
    for name, b in engine.module.named_buffers():
        if name in weights:
            b.copy_(weights[name].to(b.device))
    sched = state.get("lr_scheduler")
    if sched and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(dict(sched))
        for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr  # load_state_dict restores the schedule, not the optimizer's current lr
    rng_file = path / f"rng-rank{rank}.safetensors"
    if rng_file.is_file():
        set_rng_state(load_file(str(rng_file)))
    return state


def _materialize_optimizer_state(engine, opt, step_value: float) -> None:
    """Create AdamW state (zeros) for every tensor the optimizer steps, as its first step would.

    torch's AdamW creates state lazily; DeepSpeed's ZeRO / bf16 wrappers link each module
    parameter to its slice of that state only once it exists. Creating it here (then linking)
    lets the saved moments be written into place before the first step of the resumed run.
    """
    if step_value == 0:
        return
    flats = [flat for group in opt.param_groups for flat in group["params"]]
    flats += list(getattr(engine.optimizer, "fp32_partitioned_groups_flat", []))  # ZeRO-3 fills groups lazily
    for flat in flats:
        if "exp_avg" not in opt.state.get(flat, {}):
            opt.state[flat] = {**opt.state.get(flat, {}), "step": torch.tensor(step_value),
                               "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def _set_module_param(p, value) -> None:
    """Copy a full tensor into the module's (possibly ZeRO-3 partitioned) parameter."""
    if hasattr(p, "ds_id"):
        import deepspeed   # lazy: as in _full_tensor

        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                p.data.copy_(value.to(p.dtype))
    else:
        p.data.copy_(value.to(p.dtype))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
