"""Resumable checkpoints: atomic, the last M kept, found again by ``resume=auto``.

Layout under ``<output_dir>/checkpoints/``::

    step-000050/            DeepSpeed engine state (heads, optimizer, LR scheduler; one
                            optimizer shard per rank under ZeRO) + trainer_state.json
                            (step, data position, config) + rng-rank{r}.safetensors
    latest                  the name of the newest complete checkpoint

A checkpoint is written under a temporary name and renamed only once every rank has
finished, so a kill mid-write leaves the previous checkpoint as ``latest``.

The engine state is DeepSpeed's native format (torch-serialised files), the only format
that holds a ZeRO-partitioned optimizer. It is resume state written by this run for this
run, never meant to be shared: the export (``heads/``) is safetensors only and is what
leaves the machine. Our own files here are JSON and safetensors.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import torch

from inference.errors import UserError

STATE_FILE = "trainer_state.json"
LATEST = "latest"


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
    return json.loads((Path(path) / STATE_FILE).read_text())


def rng_state() -> dict[str, torch.Tensor]:
    import numpy as np

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
    import numpy as np

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    py = json.loads(bytes(state["python"].tolist()).decode())
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype("uint32"), int(state["numpy_pos"][0])))


def save(engine, output_dir: Path, step: int, trainer_state: dict, keep_last: int, rank: int) -> Path:
    """Write checkpoint ``step`` atomically on every rank; rank 0 renames and prunes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    tag, tmp_tag = step_tag(step), f".tmp-{step_tag(step)}"
    if rank == 0 and (root / tmp_tag).exists():
        shutil.rmtree(root / tmp_tag)  # leftover of a run killed mid-write
    _barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, save_latest=False)
    save_file(rng_state(), str(root / tmp_tag / f"rng-rank{rank}.safetensors"))
    _barrier()
    final = root / tag
    if rank == 0:
        (root / tmp_tag / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, default=str) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(root / tmp_tag, final)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(tag + "\n")
        os.replace(latest_tmp, root / LATEST)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(engine, path: Path, rank: int) -> dict:
    """Restore engine + RNG from ``path``; returns the trainer state."""
    from safetensors.torch import load_file

    path = Path(path)
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise UserError(f"could not load checkpoint {path} (incomplete, or written with another ZeRO layout)")
    rng_file = path / f"rng-rank{rank}.safetensors"
    if rng_file.is_file():
        set_rng_state(load_file(str(rng_file)))
    return read_state(path)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
