"""Benchmarks: agenticstate against raw redis-py and the peer package, as ratios from one run."""
