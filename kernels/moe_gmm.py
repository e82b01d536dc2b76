"""Routed experts through the MXFP4 grouped-matmul kernel (``gmm_mxfp4.py``): the ``pallas``
backend of ``expert_ffn`` for MXFP4 experts.

The (token, slot) pairs are sorted by expert (padding tokens go to a sentinel past every
group, so no work), padded to a whole row tile, and run through three grouped matmuls —
gate (w1), up (w3), the gated activation in float32, down (w2) — each reading only the
visited experts' packed tiles of the *whole* weight stack ``[L, E, ...]`` with the layer as
an index (no per-layer slice for XLA to copy). The weighted rows are added back into their
tokens. Weights must have been converted at load (``repack_experts``): nibbles repacked for
the kernel's ``tk``, scales padded to 128 columns (``gmm_mxfp4.pad_scales``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .gmm_mxfp4 import choose_blocks, mxfp4_gmm, pad_scales, repack_halves, scale_groups, tile_k
from .moe_pairs import pair_experts


def repack_experts(packed, scale=None):
    """The load-time conversion of an expert stack for the kernel (lossless, once): packed
    bytes ``[..., N, K/2]`` repacked (``repack_halves`` at ``tile_k(K)``); with ``scale``
    (``[..., N, K/32]``) the pair ``(packed, scale)``, scales padded to
    ``[..., N, scale_groups(K)]`` (``pad_scales``: a minor dim of 128 keeps XLA:TPU's default
    row-major layout, so the stack is not copied around each call). Abstract arrays
    (``jax.ShapeDtypeStruct``, an ``nnx.eval_shape`` model compiled ahead of time) get the
    converted shapes, shardings kept."""
    if isinstance(packed, jax.ShapeDtypeStruct):
        if scale is None:
            return packed
        shape = (*scale.shape[:-1], scale_groups(2 * packed.shape[-1]))
        return packed, jax.ShapeDtypeStruct(shape, scale.dtype, sharding=getattr(scale, "sharding", None))
    out = repack_halves(packed, tile_k(2 * packed.shape[-1]))
    return out if scale is None else (out, pad_scales(scale))


def _row_tile(M: int) -> int:
    return int(min(128, max(8, 1 << max(0, M - 1).bit_length())))


def gmm_experts(x, topk_idx, topk_w, w1, w2, w3, act, E, compute_dtype, valid, layer, interpret=None):
    """``sum_j w_j * w2_e(act(w1_e x, w3_e x))`` (float32 ``[N, K]``) with MXFP4 ``(packed,
    scale)`` weights, ``[E, ...]`` or layer stacks ``[L, E, ...]`` (``layer``: the row)."""
    f32, i32 = jnp.float32, jnp.int32
    N, K = x.shape
    k = topk_idx.shape[1]
    M = N * k
    tm = _row_tile(M // max(1, E) + 1)
    Mp = -(-M // tm) * tm
    flat_e = pair_experts(topk_idx, valid, E)  # [M], E = sentinel (no expert)
    order = jnp.argsort(flat_e, stable=True)
    tok = (order // k).astype(i32)
    sizes = jnp.zeros((E + 1,), i32).at[flat_e].add(1)[:E]
    xs = jnp.zeros((Mp, K), compute_dtype).at[:M].set(x[tok].astype(compute_dtype))

    def flat(w):  # [L, E, n, c] -> [L*E, n, c]: one stack, indexed by layer * E + expert
        p, s = w
        return p.reshape(-1, *p.shape[-2:]), s.reshape(-1, *s.shape[-2:])

    lay = 0 if layer is None else layer

    def gmm(h, w, **fused):
        p, s = flat(w)
        blocks = choose_blocks(h.shape[1], p.shape[1], tm, x_itemsize=h.dtype.itemsize, weights=1 + bool(fused))
        return mxfp4_gmm(h, p, s, sizes, lay, num_experts=E, blocks=blocks, interpret=interpret, **fused)

    h = gmm(xs, w1, up=flat(w3), act=act).astype(compute_dtype)  # act(gate, up), fused
    y = gmm(h, w2)[:M]
    live = flat_e[order] < E
    tw = topk_w.astype(f32).reshape(-1)[order]
    contrib = jnp.where(live[:, None], y * tw[:, None], 0.0)
    return jnp.zeros((N, y.shape[-1]), f32).at[tok].add(contrib)


def interpret_params():
    """What ``pallas-interpret`` runs the kernels with (CPU)."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()

