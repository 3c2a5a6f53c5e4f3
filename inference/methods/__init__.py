"""Decoding methods: one file each, registered in ``inference.methods.registry``.

    from inference.methods import generate, stream
    out = generate(m, ids, "prompt_lookup", num_tokens=5, max_new_tokens=64)
"""

from ..runtime.decode import stream_text
from .registry import Method, check_methods, generate, generate_batch, get, names, register, stream

__all__ = ["Method", "check_methods", "generate", "generate_batch", "get", "names", "register", "stream", "stream_text"]
