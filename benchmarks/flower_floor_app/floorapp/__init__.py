"""The floor of Flower's message path (benchmarks/flower_overhead.py)."""
