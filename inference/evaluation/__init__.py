"""Measuring decoding methods: prompts, calibration, tree choice, interleaved timing, reports."""
