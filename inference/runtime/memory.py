"""How much memory this process can still allocate on a device (batch sizing, packed kernel copies)."""

from __future__ import annotations

from typing import Optional

import torch


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory this process can still allocate on ``device`` (None where unknown): CUDA's free memory plus what
    torch's allocator holds unused (reserved, not allocated: ``mem_get_info`` counts it as taken), or the host's
    MemAvailable (free pages plus reclaimable cache)."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
