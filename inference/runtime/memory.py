"""How much memory this process can still allocate on a device (batch sizing, packed kernel copies)."""

from __future__ import annotations

from typing import Optional

import torch


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory this process can still allocate on ``device`` (None where unknown): CUDA's free memory,
    or the host's MemAvailable (free pages plus reclaimable cache)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
