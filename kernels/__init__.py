"""Kernels: pure-JAX references (CPU path) and the dispatch point in ops.py; Pallas TPU kernels
beside them (``gmm_mxfp4.py``: the MXFP4 grouped matmul, not yet dispatched by ops.py)."""
