"""Routed-expert FFN over top-k assignments: sort by expert, grouped matmuls, combine.

Reference (and CPU) path: the (token, slot) pairs are sorted by expert id and run through
``jax.lax.ragged_dot`` with the stacked expert weights; results are scattered back and summed
with the routing weights in float32. MXFP4 experts are dequantized inside the op (the whole
stack per call here; a TPU kernel dequantizes tile by tile).

Weights keep the checkpoint layout ``[E, out, in]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .mxfp4 import unpack_mxfp4


def dequant_experts(w, dtype):
    """``w`` is a dense [E, out, in] array or an (packed, scale) MXFP4 pair."""
    if isinstance(w, (tuple, list)):
        packed, scale = w
        return unpack_mxfp4(packed, scale, dtype=dtype)
    return w.astype(dtype)


def expert_ffn(x, topk_idx, topk_w, w1, w2, w3, act, num_experts: int, compute_dtype=jnp.float32):
    """x [N, K]; topk_idx/topk_w [N, k]; w1/w3 [E, I, K], w2 [E, K, I] (dense or MXFP4).

    ``act(gate, up)`` is the gated activation (SiTU or SiLU·up), computed in fp32.
    Returns float32 [N, K]: sum_j w_j * w2_e(act(w1_e x, w3_e x)).
    """
    N, K = x.shape
    k = topk_idx.shape[1]
    flat_e = topk_idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    xs = x[tok].astype(compute_dtype)
    W1 = dequant_experts(w1, compute_dtype)
    W3 = dequant_experts(w3, compute_dtype)
    W2 = dequant_experts(w2, compute_dtype)
    g = jax.lax.ragged_dot(xs, jnp.swapaxes(W1, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, jnp.swapaxes(W3, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    h = act(g, u).astype(compute_dtype)
    y = jax.lax.ragged_dot(h, jnp.swapaxes(W2, 1, 2), group_sizes, preferred_element_type=jnp.float32)
    wts = topk_w.reshape(-1)[order].astype(jnp.float32)
    out = jnp.zeros((N, y.shape[-1]), jnp.float32).at[tok].add(y * wts[:, None])
    return out
