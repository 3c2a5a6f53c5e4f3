"""safetensors files written the same, byte for byte, by every run."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from inference.safetensors_file import save_file


def test_files_with_the_same_tensors_and_metadata_are_the_same_bytes(tmp_path):
    """Guards against the metadata order the library draws per call (a Rust hash map): two writes of the same heads
    export or feature-cache shard differed in their header (``{"format","kind"}`` or the other way round), so a
    resumed run's heads, a rebuilt cache or an export compared with ``cmp`` or a checksum differed about half the
    time. Every file is read back with the same tensors and metadata."""
    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(5, dtype=torch.bfloat16)}
    meta = {"format": "pt", "kind": "medusa", "first": "0", "count": "12", "é": "ü \" \\ \n"}
    files = set()
    for i in range(12):
        path = tmp_path / f"f{i}.safetensors"
        save_file(tensors, path, metadata=meta)
        files.add(path.read_bytes())
        got = load_file(path)
        assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
        with safe_open(path, "pt") as f:
            assert f.metadata() == meta
    assert len(files) == 1
