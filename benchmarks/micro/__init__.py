"""Micro-benchmarks, one module each, run as ``python scripts/bench.py <name>``: each has ``main(argv)``."""
