"""Decoding methods: each one file that registers itself (see ``inference.methods.registry``)."""
