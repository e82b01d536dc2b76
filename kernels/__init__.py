"""Kernels: pure-JAX references (CPU path) and the dispatch point in ops.py; Pallas TPU kernels
beside them, all called by the model through ops.py on a Pallas backend: ``gmm_mxfp4.py`` (the
MXFP4 grouped matmul, for the routed experts), ``mla_ragged_kernel.py`` (the MLA rows' write and
ragged paged attention), ``kda_decode_kernel.py`` (KDA decode over batched rows) and
``kda_prefill_kernel.py`` (KDA ragged chunked prefill), the last two combined per layer by
``kda_pools.py``."""
