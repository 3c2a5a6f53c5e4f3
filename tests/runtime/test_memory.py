"""How much host memory the memory checks see: /proc/meminfo lowered to a container's cgroup limit."""

from __future__ import annotations

import torch

from inference.runtime import memory


def _group(folder, limit, usage, stat_line, names=("memory.max", "memory.current")):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / names[0]).write_text(f"{limit}\n")
    (folder / names[1]).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon 1\n{stat_line}\nfile 2\n")


def test_v2_limit_lowers_meminfo(tmp_path, monkeypatch):
    """A job in a 4 GiB container on a large node read the node's MemAvailable: the memory checks let it start
    and the kernel's OOM killer ended it. The group's limit less its usage (inactive page cache counted free)."""
    _group(tmp_path / "job", 4 << 30, 3 << 30, f"inactive_file {1 << 29}")
    monkeypatch.setattr(memory, "_own_cgroups", lambda: (("", "job"), ("memory", "")))
    assert memory.container_headroom_bytes(str(tmp_path)) == (1 << 30) + (1 << 29)
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(tmp_path))
    assert memory.host_available_bytes() == (1 << 30) + (1 << 29)
    assert memory.free_memory_bytes(torch.device("cpu")) == (1 << 30) + (1 << 29)


def test_parent_limit_counts_and_unlimited_is_none(tmp_path, monkeypatch):
    """An unlimited own group under a limited parent (a Kubernetes pod's slice) must not read as unlimited; a
    tree with no limit anywhere leaves MemAvailable alone."""
    _group(tmp_path / "pod", 2 << 30, 1 << 30, "inactive_file 0")
    _group(tmp_path / "pod" / "job", "max", 1 << 30, "inactive_file 0")
    monkeypatch.setattr(memory, "_own_cgroups", lambda: (("", "pod/job"), ("memory", "")))
    assert memory.container_headroom_bytes(str(tmp_path)) == 1 << 30
    (tmp_path / "pod" / "memory.max").write_text("max\n")
    assert memory.container_headroom_bytes(str(tmp_path)) is None


def test_v1_and_namespaced_root(tmp_path, monkeypatch):
    """cgroup v1 names its files differently and writes "no limit" as a huge number; inside a container's
    namespace /proc/self/cgroup names a group the mount does not show (the mount's root is the container's)."""
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    _group(tmp_path / "memory", 8 << 30, 6 << 30, f"total_inactive_file {1 << 30}", v1)
    monkeypatch.setattr(memory, "_own_cgroups", lambda: (("", ""), ("memory", "docker/abc")))
    assert memory.container_headroom_bytes(str(tmp_path)) == 3 << 30
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory.container_headroom_bytes(str(tmp_path)) is None


def test_no_cgroup_keeps_meminfo(tmp_path, monkeypatch):
    """Without a readable cgroup the reading is MemAvailable (a positive number on Linux), not None or 0."""
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(tmp_path / "absent"))
    assert memory.container_headroom_bytes() is None
    assert memory.host_available_bytes() > 0


def test_a_v2_leaf_without_the_limit_file_reads_the_limits_above(tmp_path, monkeypatch):
    """Guards against: a cgroup v2 leaf whose parent does not enable the memory controller for its children (no
    memory.max there: a Slurm step, a delegated subtree) skipping the whole walk, so the job's 4 GiB limit two
    groups up was never read."""
    _group(tmp_path / "job", 4 << 30, 3 << 30, "inactive_file 0")
    (tmp_path / "job" / "step" / "task").mkdir(parents=True)
    monkeypatch.setattr(memory, "_own_cgroups", lambda: (("", "job/step/task"), ("memory", "")))
    assert memory.container_headroom_bytes(str(tmp_path)) == 1 << 30
