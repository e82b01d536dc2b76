"""The (token, choice) pairs of a routed MoE step, flattened: shared by every MoE strategy
(``moe.py``) and the Pallas grouped-matmul path (``moe_gmm.py``), which import it from here
rather than from each other."""
from __future__ import annotations

import jax.numpy as jnp


def pair_experts(topk_idx, valid, E):
    """Flattened (token, choice) expert ids [N*k], ``E`` (a sentinel outside every group) for
    pairs of invalid tokens and for ids outside ``[0, E)``."""
    N, k = topk_idx.shape
    flat = topk_idx.reshape(-1).astype(jnp.int32)
    ok = (flat >= 0) & (flat < E)
    if valid is not None:
        ok &= jnp.repeat(jnp.asarray(valid, bool).reshape(N), k)
    return jnp.where(ok, flat, E)
