"""How much memory this process can still allocate on a device (batch sizing, packed kernel copies, the
training memory checks): one reading of the host's memory, a container's limit included."""

from __future__ import annotations

import os
from typing import Optional

import torch

CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned 63-bit value; nothing real comes near it
_UNLIMITED = 1 << 62
# (limit, usage, statistics file, the statistic that names reclaimable page cache): cgroup v2, then v1
_CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file"))


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory this process can still allocate on ``device`` (None where unknown): CUDA's free memory plus what
    torch's allocator holds unused (reserved, not allocated: ``mem_get_info`` counts it as taken), or
    ``host_available_bytes``."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return host_available_bytes()


def host_available_bytes() -> Optional[int]:
    """The host's MemAvailable (free pages plus reclaimable cache), lowered to what the container's memory
    limit leaves (a job in a 32 GiB container on a 1 TiB node sees the node in /proc/meminfo: a check on
    MemAvailable alone lets it start and the kernel's OOM killer end it). None where neither is readable."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    headroom = container_headroom_bytes()
    if headroom is None:
        return avail
    return headroom if avail is None else min(avail, headroom)


def container_headroom_bytes(root: Optional[str] = None) -> Optional[int]:
    """What this process's memory cgroup (v2, else v1) and the groups above it still allow: the smallest limit
    less usage, the inactive page cache counted as free (the kernel reclaims it before it kills). None without
    a limit or a readable cgroup."""
    root = CGROUP_ROOT if root is None else root
    for (limit_name, usage_name, stat_name, reclaimable), (mount, own) in zip(_CGROUP_FILES, _own_cgroups()):
        top = os.path.normpath(os.path.join(root, mount))
        # the process's own group where the mount shows the whole tree; a container's namespace shows only its
        # own group, at the mount's root
        folder = os.path.normpath(os.path.join(top, own))
        if not os.path.isdir(folder):
            folder = top
        headroom, seen = None, False
        while True:   # up to the mount: a leaf without the limit file (v2 enables it per parent) still has limits above
            seen = seen or os.path.exists(os.path.join(folder, limit_name))
            room = _group_headroom(folder, limit_name, usage_name, stat_name, reclaimable)
            if room is not None:
                headroom = room if headroom is None else min(headroom, room)
            if folder == top or not folder.startswith(top):
                break
            folder = os.path.dirname(folder)
        if seen:
            return headroom
    return None


def _group_headroom(folder: str, limit_name: str, usage_name: str, stat_name: str, reclaimable: str):
    try:
        with open(os.path.join(folder, limit_name)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= _UNLIMITED:
            return None
        with open(os.path.join(folder, usage_name)) as f:
            usage = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - usage + _statistic(os.path.join(folder, stat_name), reclaimable))


def _own_cgroups() -> tuple[tuple[str, str], tuple[str, str]]:
    """(mount, this process's memory group under it) for cgroup v2 and v1, as /proc/self/cgroup names them."""
    v2 = v1 = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2 = path.lstrip("/")
                elif "memory" in controllers.split(","):
                    v1 = path.lstrip("/")
    except (OSError, ValueError):
        pass
    return ("", v2), ("memory", v1)


def _statistic(path: str, name: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
