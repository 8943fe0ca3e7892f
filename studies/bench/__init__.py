"""Benchmarks: timing and exactness measurements on a GPU."""
