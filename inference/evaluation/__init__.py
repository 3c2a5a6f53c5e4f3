"""Measuring decoding methods: prompts, each method's speculation choice (``choosing``), interleaved timing,
reports; generic over the registered methods, never naming one."""
