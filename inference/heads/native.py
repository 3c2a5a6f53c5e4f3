"""The native export directory: what the trainer writes and the runtime loads first.

Two files: ``config.json`` (``HeadsSpec.to_dict()``; ``format_version`` 1, or 2 when the chat template's
variables are recorded) and ``model.safetensors`` (the module's state dict: blocks, projections unless shared, the
``token_map`` tensor of truncated heads, where vLLM's loader reads it too). Only safetensors,
never pickle. Loading is strict: a missing, extra or mis-shaped tensor is refused, as is a
config written by a newer medusa-train. Medusa-2 heads hold their LoRA adapter beside them in ``adapter/``.

Writes are atomic (``swap_dir_into_place``): a crash leaves the previous export or the new one,
never a mix. The format exporters above reuse that swap for their own directories.

What a kill can leave beside ``<out>`` and who cleans it (``recover_dir``, called by every save and
export into ``<out>`` before it writes): ``.<out>.tmp-<pid>-*`` (a new export being written; removed
once process ``pid`` is dead, or this process no longer writes it) and ``.<out>.old-<pid>-*`` (the
previous export, moved aside for the instant between the swap's two renames; put back as
``<out>`` when ``<out>`` is missing, else removed, on the same condition). A loader given a missing ``<out>`` with an ``.old`` beside it says
so. Writers are told apart by process id on this host: a directory shared by several hosts
keeps another host's leftovers rather than risk removing a live writer's.

Foreign layouts (reference Medusa, TGI, vLLM) are not known here: ``inference.loading`` asks the
format importers first and falls back to ``read_native_spec`` / ``read_native``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..errors import UserError
from ..safetensors_file import save_file
from .projection import ProjectedHeads
from .registry import build_heads
from .spec import FORMAT_VERSION, HeadsSpec, check_compatible

CONFIG_FILE = "config.json"
# what to do about weights that are not the ones their config.json describes
MISMATCH_FIX = ("the weights and config.json come from different exports: re-export the heads, or keep each pair "
                "together")
WEIGHTS_FILE = "model.safetensors"
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE)


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
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = state_dict if state_dict is not None else heads_state_dict(heads)
    tmp = make_temp_dir(out)
    try:
        save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt", "kind": heads.spec.kind})   # cmp-able
        (tmp / CONFIG_FILE).write_text(json.dumps(heads.spec.to_dict(), indent=2) + "\n")
        if extra is not None:
            extra(tmp)
        open_permissions(tmp)
        swap_dir_into_place(tmp, out)
    finally:
        release_temp_dir(tmp)
    return out


def make_temp_dir(out: Path) -> Path:
    """A fresh ``.<out>.tmp-<pid>-*`` beside ``out`` to write a new export into, after clearing what
    killed writers left there (``recover_dir``)."""
    recover_dir(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    _ACTIVE.add(tmp)
    return tmp


def open_permissions(tmp: Path) -> None:
    """Give ``tmp`` (``make_temp_dir``) and everything in it the permissions a plain ``mkdir`` / ``open`` would:
    ``mkdtemp`` makes the folder 0700 and safetensors its files 0600, so an engine, a container or a colleague
    running as another user could not read what was written (the umask still applies)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [tmp, *tmp.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def release_temp_dir(tmp: Path) -> None:
    """The end of a write into ``tmp`` (``make_temp_dir``): remove what is left of it."""
    try:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        _ACTIVE.discard(tmp)


def sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then the folder itself, before a rename publishes it: after a power loss a
    folder renamed into place whose data never reached the disk holds empty or cut files under complete names."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_dir_into_place(tmp: Path, out: Path) -> None:
    """Rename a complete ``tmp`` directory to ``out``, replacing an existing ``out``.

    Two renames: ``out`` -> ``.<out>.old-<pid>-*``, then ``tmp`` -> ``out`` (the old one is put back
    if the second fails, and removed once the new one is in place). An exception leaves ``out``
    as it was; a kill between the two renames leaves ``out`` missing and the complete previous
    export in ``.old-*``, which the next ``recover_dir`` (every save and export into ``out``, and
    a finished training's rerun) puts back; loaders name it (``read_native_spec``)."""
    recover_dir(out)
    sync_tree(tmp)
    old = None
    try:
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
            _ACTIVE.add(old)
            try:
                os.replace(out, old)  # onto the empty dir just made: a unique name no other writer holds
            except BaseException:
                try:
                    old.rmdir()   # still empty when nothing moved: nothing left behind
                except OSError:   # interrupted after the move: recover_dir puts it back
                    pass
                raise
        try:
            os.replace(tmp, out)
        except BaseException:
            if old is not None and not out.exists():
                os.replace(old, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if old is not None:
            _ACTIVE.discard(old)


def _writer_pid(path: Path, kind: str, out: Path) -> Optional[int]:
    """The process id in ``.<out>.<kind>-<pid>-*``; None for names of another form."""
    rest = path.name[len(f".{out.name}.{kind}-"):]
    pid = rest.split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


_ACTIVE: set[Path] = set()  # the temp / old dirs this process is writing or swapping right now


def _writer_alive(path: Path, kind: str, out: Path) -> bool:
    """Whether the writer that made leftover ``path`` may still be using it: this process only while
    the call that made it runs, another process while it exists on this host; names of another
    form (older versions) count as dead."""
    pid = _writer_pid(path, kind, out)
    if pid == os.getpid():
        return path in _ACTIVE
    return pid_alive(pid)


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists on this host (one owned by another user counts); no id, or one <= 0: no."""
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def leftovers(out: Path, kind: str) -> list[Path]:
    """``.<out>.<kind>-*`` directories beside ``out`` (kind ``tmp`` or ``old``), oldest first."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    found = [p for p in out.parent.glob(f".{out.name}.{kind}-*") if p.is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def recover_dir(out: str | os.PathLike) -> None:
    """Undo what writers killed mid-save left beside ``out`` (module docstring): with ``out`` missing,
    the newest previous export in ``.<out>.old-*`` of a dead writer becomes ``out`` again; then
    dead writers' ``.old-*`` (superseded: ``out`` exists) and ``.tmp-*`` (never completed) are
    removed. Leftovers of live writers (another process on this host, or a call of this one still
    running) are left alone; names of an older form count as a dead writer's."""
    out = Path(out)
    olds = [p for p in leftovers(out, "old") if not _writer_alive(p, "old", out)]
    if not out.exists():
        complete = [p for p in olds if any(p.iterdir())]  # an empty one: killed before its rename
        if complete:
            os.replace(complete[-1], out)
            olds.remove(complete[-1])
    for p in olds + [p for p in leftovers(out, "tmp") if not _writer_alive(p, "tmp", out)]:
        shutil.rmtree(p, ignore_errors=True)


def check_config_object(heads_dir: str | os.PathLike) -> None:
    """Refuse, in one line, a heads directory whose config.json is valid JSON but not an object (a list, a
    number): every layout's reader, ours and the importers' detection, looks keys up in it."""
    f = Path(heads_dir) / CONFIG_FILE
    try:
        raw = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, ValueError):
        return   # unreadable or not JSON: the layout's own reader says so
    if not isinstance(raw, dict):
        raise UserError(f"{f} is not a JSON object (a heads config holds keys such as num_heads), "
                        f"got {type(raw).__name__}")


def read_native_spec(heads_dir: str | os.PathLike) -> HeadsSpec:
    """The spec of a native export, or a one-line ``UserError`` saying why the dir is not one."""
    d = Path(heads_dir)
    if not d.is_dir():
        old = [p for p in leftovers(d, "old") if any(p.iterdir())]
        if old and not d.exists():
            raise UserError(f"heads directory not found: {d}, but {old[-1]} holds the previous export left by an "
                            f"interrupted save: rerun the save/export, or rename it to {d.name}")
        if d.exists():   # a file: its own words, not "not found" for a path that is plainly there
            raise UserError(f"heads={d} is a file, not a heads directory: give the folder holding config.json and "
                            "the weights")
        raise UserError(f"heads directory not found: {d}")
    missing = [f for f in EXPORT_FILES if not (d / f).is_file()]
    if missing:
        raise UserError(f"{d} is not a heads export: missing {', '.join(missing)}")
    try:
        raw = json.loads((d / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{d / CONFIG_FILE} is not valid JSON ({e})") from None
    check_config_object(d)
    if raw.get("format_version", 0) > FORMAT_VERSION:
        raise UserError(f"{d} was written by a newer medusa-train (format {raw['format_version']})")
    if "model_type" in raw and "num_heads" not in raw:   # a transformers model folder: the usual mix-up
        raise UserError(f"{d} holds a model ({raw['model_type']}), not heads: give heads= a heads export "
                        "(<run>/heads) and the model as backbone=")
    try:
        return HeadsSpec.from_dict(raw)
    except TypeError as e:
        raise UserError(f"{d / CONFIG_FILE} is not a heads config ({e})") from None


def read_native(heads_dir: str | os.PathLike, backbone_config=None) -> ProjectedHeads:
    """A native export's heads, strictly (every tensor named and shaped as the config implies), on the CPU as
    stored and not yet given the backbone tensors they borrow (``inference.loading.attach_backbone``); with
    ``backbone_config``, heads made for another model refused. It needs no backbone weights, so a loader reads it
    before them."""
    d = Path(heads_dir)
    spec = read_native_spec(d)
    if backbone_config is not None:
        check_compatible(spec, backbone_config, where=f"heads in {d}")
    check_stored_shapes(spec, d / WEIGHTS_FILE)
    try:
        tensors = load_file(str(d / WEIGHTS_FILE), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{d / WEIGHTS_FILE} is corrupt or unreadable ({e})") from None
    heads = build_heads(spec)
    load_state_checked(heads, tensors, d / WEIGHTS_FILE)
    return heads


def expected_shapes(spec: HeadsSpec) -> dict[str, tuple]:
    """The tensors ``spec``'s heads hold, with their shapes, from the heads built on the meta device: nothing is
    allocated. A config.json that disagrees with its weights (edited, or another export's) was built at its own
    sizes before they were compared: 256 GB asked for a 10^9-wide draft layer."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_heads(spec).state_dict().items()}


def check_shapes(spec: HeadsSpec, stored: dict[str, tuple], where, expected: Optional[dict] = None) -> None:
    """``stored`` (name -> shape) against the tensors ``spec`` implies (``expected``: ``expected_shapes`` when not
    given), before any is built."""
    expected = expected if expected is not None else expected_shapes(spec)
    missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or extra:
        raise UserError(f"{where} does not match its config: missing {missing[:4]}, unexpected "
                        f"{extra[:4]}; {MISMATCH_FIX}")
    wrong = next((k for k in sorted(expected) if expected[k] != tuple(stored[k])), None)
    if wrong is not None:
        raise UserError(f"{where}: {wrong} has shape {tuple(stored[wrong])}, config implies {expected[wrong]}; "
                        f"{MISMATCH_FIX}")


def check_stored_shapes(spec: HeadsSpec, weights: Path) -> None:
    """``check_shapes`` of the tensors ``weights`` names, from the file's header alone."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{weights} is corrupt or unreadable ({e})") from None
    check_shapes(spec, stored, weights)


def check_safetensors(f: str | os.PathLike) -> None:
    """A safetensors file checked from its header alone (its length, its JSON, the tensors' offsets against the
    file's size: a half-written or cut file), reading no tensor; refused in one line otherwise."""
    try:
        with safe_open(str(f), framework="pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise UserError(f"{f} is corrupt or unreadable ({e})") from None


def indexed_shards(index: Path) -> list[Path]:
    """The shard files a safetensors index names (sorted, each once), each present (one line otherwise)."""
    try:
        shards = sorted({str(v) for v in json.loads(index.read_text())["weight_map"].values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{index} is not a safetensors index (JSON with a weight_map)") from None
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise UserError(f"{index.name} names {len(missing)} shard(s) missing from {index.parent} "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    return [index.parent / s for s in shards]


def load_state_checked(heads: ProjectedHeads, state: dict[str, torch.Tensor], where) -> None:
    """``heads.load_state_dict(state, strict=True)``, but a tensor whose shape is not what the spec
    implies is refused in one line naming it (torch's error lists every mismatch over many lines)."""
    expected = heads.state_dict()
    for name, t in state.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise UserError(f"{where}: {name} has shape {tuple(t.shape)}, config implies "
                            f"{tuple(expected[name].shape)}; {MISMATCH_FIX}")
        if name in expected:
            check_tensor_values(name, t, expected[name].dtype.is_floating_point, heads.spec.vocab_size, where)
    heads.load_state_dict(state, strict=True)


def check_tensor_values(name: str, t: torch.Tensor, floating: bool, vocab_size: int, where) -> None:
    """A stored tensor of the kind its place holds: a weight in floating point and finite (NaN drafts are never
    accepted: slow, silently), a token map of integer ids in the backbone's vocabulary (one out of range loaded and
    then failed at the first step deep in torch, and was exported as it was), each id once."""
    if floating:
        if not t.dtype.is_floating_point:
            raise UserError(f"{where}: {name} is stored as {t.dtype}, not as a floating-point weight (a damaged or "
                            "foreign file): re-export the heads from their training run")
        flat = t.reshape(-1)   # in slices: an 8B backbone's own-projection head is 0.5G values
        if not all(bool(torch.isfinite(flat[i:i + 2 ** 24]).all()) for i in range(0, flat.numel(), 2 ** 24)):
            raise UserError(f"{where}: {name} holds NaN or infinite values (a diverged training or a damaged "
                            "file): retrain from an earlier checkpoint, or re-export")
    elif name.split(".")[-1] == "token_map":
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise UserError(f"{where}: token_map is stored as {t.dtype}, not integer token ids")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
            raise UserError(f"{where}: token_map holds ids outside the backbone's vocabulary 0..{vocab_size - 1} "
                            f"({int(t.min())}..{int(t.max())}): heads of another backbone or a damaged file; "
                            "re-export them")
        ids = t.reshape(-1).sort().values
        repeated = ids[1:][ids[1:] == ids[:-1]]   # two rows for one id: a full-vocabulary export keeps one of them
        if repeated.numel():
            raise UserError(f"{where}: token_map maps two rows onto one token id ({int(repeated[0])}): a damaged "
                            "file; re-export the heads from their training run")


def place(heads: ProjectedHeads, device, dtype: Optional[torch.dtype]) -> ProjectedHeads:
    """Cast (floating tensors only: token_map stays long) and move loaded heads, in eval mode."""
    if dtype is not None:
        heads.to(dtype=dtype)
    return heads.to(device).eval()
