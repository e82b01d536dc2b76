"""Kernels: pure-JAX references (CPU path) and the dispatch point in ops.py; Pallas TPU kernels
beside them (``gmm_mxfp4.py``: the MXFP4 grouped matmul, wired in for the routed experts;
``kda_decode_kernel.py``: KDA decode over batched rows; ``mla_ragged_kernel.py``: ragged paged
MLA attention with the rows' write; the last two exported by ops.py but not yet called by the
model)."""
