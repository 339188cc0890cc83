"""Benchmarks and GPU checks, run as modules from the repository root: ``python -m benchmarks.attention``,
``python -m benchmarks.kernel_ptx``."""
