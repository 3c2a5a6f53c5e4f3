"""Which device and which process: the launcher's process group, or a 1-process group of our own.

Training and the feature-cache build both run under ``deepspeed``/``torchrun`` launchers (N ranks)
or as a plain process; distillation picks its device the same way. Kept apart from the trainer so
those commands set up a process without importing the training loop. ``stop_on_signals``: what a Ctrl-C or
SIGTERM does to a process with nothing to finish first (the trainer's setup, a cache build, distillation).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from inference.errors import UserError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(setting: str) -> torch.device:
    if setting == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is available (use trainer.device=cpu)")
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(setting)


def init_distributed(device: torch.device):
    """Join the launcher's process group, or make a 1-process group when run without one."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    added = {}
    if "RANK" not in os.environ:
        added = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        os.environ.update(added)
    import deepspeed   # lazy: it reads DS_ACCELERATOR (set above) when imported; 0.5 s, not for preflight

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines drown the progress bar
    if device.type == "cpu":
        # DeepSpeed's CPU shared-memory allreduce op is JIT-compiled on first use, leaves a
        # 66 MB buffer per rank in /dev/shm after every multi-process run (RAM, never freed),
        # and its bf16 kernels fault without AVX-512. gloo's allreduce is plenty for the heads.
        # (sys.modules: ``import deepspeed.comm.torch as m`` binds the real torch, which
        # deepspeed.comm re-exports under that name.)
        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    try:
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl", verbose=False)
    finally:
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if key in added:  # a child process started later must not inherit a stale rendezvous
                os.environ.pop(key, None)  # (DeepSpeed still reads LOCAL_RANK at initialize)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Process:
    """This process's place in the run: its device, rank and the world size."""

    device: torch.device
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_process(t) -> Process:
    """Device, CPU threads, process group and seed from ``trainer.*`` (training and the cache build)."""
    device = resolve_device(t.device)
    if t.threads:
        torch.set_num_threads(t.threads)
    rank, world_size = init_distributed(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.manual_seed(t.seed)
    return Process(device, rank, world_size)


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


# What a collective raises when another process of the launch is gone: gloo's transport errors (plain
# RuntimeErrors naming their transport's source file), NCCL's remote errors (a DistBackendError naming the remote
# process), the store's and network's own errors. Not any DistBackendError: NCCL says a misuse (a bug here) in one too.
_LOST_PEER = re.compile(r"gloo/transport|Connection (reset|closed) by peer|ncclRemoteError|remote process exited")


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another process of this launch is gone (killed, crashed,
    its node lost), rather than a defect of this one: only inside a process group of 2+ processes."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    if "timed out" in str(e).lower():   # a peer alive but late (a hang, collectives out of order): not this line
        return False
    gone = tuple(getattr(dist, name) for name in ("DistNetworkError", "DistStoreError") if hasattr(dist, name))
    return isinstance(e, gone) or (isinstance(e, RuntimeError) and bool(_LOST_PEER.search(str(e))))


def leave_after_lost_peer(e: BaseException) -> str:
    """Tear down the broken process group (left to the interpreter's exit, gloo's threads abort the process:
    "terminate called without an active exception") and say, in one line, what happened and what is kept."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    first = re.sub(r"^\[[^\]]*\] ", "", first)[:160]   # gloo prefixes its source file and line
    try:
        dist.destroy_process_group()
    except Exception:   # already torn down: nothing to leave
        pass
    return (f"lost another process of this launch ({first}): it stopped, was killed or lost its node, and its own "
            "output says why; what was saved is kept: run the same command again to resume")


@contextmanager
def stop_on_signals(message: Callable[[], str]) -> Iterator[None]:
    """A Ctrl-C (SIGINT) or SIGTERM while the block runs stops it at once, through its ``finally`` clauses (a
    temporary file is removed), and ends it as ``UserError(message())``: one line saying what is kept, exit 2 as
    a stop during training (``trainer.Interrupts``). A signal while that line is made changes nothing (the
    DeepSpeed launcher sends each rank a SIGTERM right after the terminal's SIGINT); one while the block unwinds
    raises again, into the same line. The handlers in place before are restored on leaving. Main thread only
    (the only one that can take a signal handler); elsewhere a KeyboardInterrupt is still turned into the line."""
    state = {"stopping": False}

    def handle(signum, frame) -> None:
        if not state["stopping"]:
            raise KeyboardInterrupt

    previous = swap_handlers(handle)
    try:
        yield
    except KeyboardInterrupt:
        state["stopping"] = True
        raise UserError(message()) from None
    finally:
        restore_handlers(previous)


def swap_handlers(handler) -> dict:
    """Make ``handler`` the SIGINT and SIGTERM handler; the ones it replaced, for ``restore_handlers``. Main thread
    only (the only one that can take a signal handler); elsewhere nothing changes (``{}``)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_handlers(previous: dict) -> None:
    """Put back the handlers ``swap_handlers`` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)
