"""safetensors files written byte for byte the same by every run.

``safetensors.torch.save_file`` serialises the metadata through a Rust hash map, whose order is drawn afresh in
each process: two runs writing the same tensors and metadata of more than one key wrote files that differ in
their header (``{"format":"pt","kind":"medusa"}`` or the other way round), so an export, a resumed run's heads or
a rebuilt feature cache could not be compared with ``cmp`` or a checksum. ``save_file`` here writes through the
library, then puts the metadata keys in sorted order in place: the header keeps its length (the same text,
reordered), the tensors are not touched, and the file stays what every safetensors reader reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import safetensors.torch   # looked up when writing: tests make the library's writer fail

META = "__metadata__"


def save_file(tensors: dict, path: str | os.PathLike, metadata: Optional[dict] = None) -> None:
    """``safetensors.torch.save_file`` with the metadata in sorted key order (module docstring)."""
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    if metadata and len(metadata) > 1:
        sort_metadata(Path(path))


def sort_metadata(path: Path) -> None:
    """Rewrite ``path``'s header with its metadata keys sorted, in place and at the same length; a header this
    cannot rewrite at its length (a writer that formats JSON otherwise) is left as it is."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size).decode("utf-8"))
        if not isinstance(header.get(META), dict):
            return
        header[META] = dict(sorted(header[META].items()))
        # the library's own layout: compact JSON, text as is, padded with spaces to the 8-byte-aligned length
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > size:
            return
        f.seek(8)
        f.write(text + b" " * (size - len(text)))
