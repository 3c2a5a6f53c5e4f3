"""Decoding methods: each one file that registers itself (see ``inference.methods.registry``).

    from inference.methods import generate, stream
    out = generate(m, ids, "prompt_lookup", num_tokens=5, max_new_tokens=64)
"""

from . import medusa, draft, lookahead, prompt_lookup, medusa_lookup, autoregressive, hf_generate  # noqa: F401  (register)
from .registry import Method, check_methods, generate, get, names, register, stream  # noqa: F401
