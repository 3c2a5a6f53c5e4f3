"""Kernel choices measured once per machine, reused by later launches (``kernels=auto``).

Routing a model's linears (``linear_kernels.route_linear_kernels``) times every formulation for every
weight shape and row count: ~12 s of a ~17 s ``medusa-generate`` launch for SmolLM2-135M on 2 CPU cores,
paid again by every command. The choice depends on the machine, the torch build, the thread count and
the shape, not on the weights' values, so it is stored here after it is measured and read back by the
next launch with the same key (benchmarks/history.md "Kernel choices kept between launches").

One JSON file (``<cache>/kernel_plans.json``, the cache being ``$MEDUSA_TRAIN_CACHE`` or
``~/.cache/medusa-train``): per key, the kernel of every measured row count, the median timings it was
chosen from and when. A key holds everything a choice depends on: the CPU model and its logical core count,
torch's version, the threads, the weight's shape, dtype and bias, whether prepacked copies were made (the
candidates differ without them), the row range and margin. ``kernels=measure`` measures afresh and
replaces the stored choices (a machine that was busy when they were measured, a changed BIOS setting);
a damaged or foreign file is ignored and rewritten. Written atomically (temporary file, then rename), so
two launches at once leave one whole file.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import torch

FORMAT = "medusa-train kernel plans"
VERSION = 1
FILE_NAME = "kernel_plans.json"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


class KernelPlanCache:
    """The stored choices (``path``), read once; ``get`` / ``put`` by key, ``save`` writes new ones."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: dict[str, dict] = {}
        self.changed = False
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return   # none yet, or unreadable: measured afresh and rewritten
        if isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("version") == VERSION \
                and isinstance(raw.get("entries"), dict):
            self.entries = raw["entries"]

    @staticmethod
    def key(shape: tuple, dtype: torch.dtype, bias: bool, packed: bool, max_rows: int, margin: float) -> str:
        machine = f"{cpu_name()} x{os.cpu_count()} {platform.machine()}"
        return (f"{machine} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
                f"{shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')} bias {int(bias)} | packed {int(packed)} | "
                f"rows 1-{max_rows} margin {margin:g}")

    def get(self, key: str) -> Optional[dict[int, str]]:
        """The stored kernel per row count, or None (not stored, or damaged)."""
        entry = self.entries.get(key)
        try:
            return {int(r): str(k) for r, k in entry["choice"].items()}
        except (TypeError, KeyError, AttributeError, ValueError):
            return None

    def put(self, key: str, choice: dict[int, str], timings: dict[int, dict[str, float]]) -> None:
        self.entries[key] = {"choice": {str(r): k for r, k in sorted(choice.items())},
                             "timings_ms": {str(r): {k: round(v, 4) for k, v in t.items()}
                                            for r, t in sorted(timings.items())},
                             "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.changed = True

    def save(self) -> None:
        """Write the file if anything was measured (best effort: a read-only cache only costs the next launch
        its measurement)."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION, "entries": self.entries}, indent=1))
            tmp.replace(self.path)
        except OSError:
            return
        self.changed = False
