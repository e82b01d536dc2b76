"""Kernels: pure-JAX references (CPU path) and the dispatch point in ops.py."""
