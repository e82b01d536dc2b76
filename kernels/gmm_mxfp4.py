"""MXFP4 grouped matmul as a Pallas TPU kernel: ``y[rows of g] = x[rows of g] @ W_g.T`` with
each expert's weight decoded from MXFP4 inside the kernel (issue #15, kernel 1).

Why: K3's routed experts are about 1.4 TB as MXFP4 and four times that in bf16, so on a TPU
they cannot be held decoded; XLA's gather paths also copy every token's expert weights. This
kernel reads the packed nibbles and E8M0 scales of one ``[tn, tk]`` weight tile at a time,
decodes them exactly (integer bit assembly, as ``kernels/mxfp4.py``; scale bytes 0 and 255,
code 8 = -0 included), multiplies in the activation dtype and accumulates in float32.
Activations stay unquantized (K3's experts are weight-only FP4).

Layout. ``x [M, K]`` holds the tokens sorted by group (expert), ``group_sizes [G]`` how many
rows each group has; rows past ``sum(group_sizes)`` keep ``existing`` (zeros by default).
Weights are stacked ``[L*E, N, K/2]`` / ``[L*E, N, K/32]`` (every layer's experts, passed
whole: no per-layer slice for XLA to copy); group ``g`` of a call uses weight
``layer * E + group_offset + g`` (``group_offset``: the first expert of this EP shard).

**Repack** (:func:`repack_halves`, once at load, lossless): within each ``tk``-wide block of K,
byte ``j`` holds element ``j`` in its low nibble and element ``j + tk/2`` in its high one (the
checkpoint pairs elements ``2j, 2j+1``). A tile then decodes as two half tiles, each a plain
``[tn, tk/2]`` array multiplied by one half of the activation tile — no lane interleave, and
no ref reshape or bitcast (which TPU interpret mode rejects; values are reshaped only).

Grid (megablox's): ``(N / tn, visits, K / tk)``; a *visit* is one (group, row tile) pair,
listed by :func:`group_metadata` in row order, so a row tile shared by two groups is visited
twice in a row and the second visit's masked store keeps the first's rows. Metadata is
scalar-prefetched into SMEM. The visit count is static, ``ceil(M / tm) + G - 1``; visits past
the real ones repeat the last and store nothing.

Cost per call: HBM bytes ≈ ``visits · N·K·(1/2 + 1/32)`` of weights (each visit streams its
group's tiles) + ``x`` once per column tile (``(N/tn) · M·K·itemsize``) + ``M·N·4`` out;
FLOPs ``2·M·N·K`` plus the row tiles' padding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .mxfp4 import GROUP_SIZE, _f32_bits_from_codes


def repack_halves(packed, tk: int):
    """Checkpoint nibble order -> this kernel's: within each ``tk`` block of K, byte ``j`` =
    element ``j`` (low nibble) | element ``j + tk/2`` (high). Lossless; numpy or jax arrays
    ``[..., N, K/2]`` with ``K % tk == 0`` and ``tk % 32 == 0``."""
    xp = jnp if isinstance(packed, jax.Array) else np
    lead, half = packed.shape[:-1], packed.shape[-1]
    K = 2 * half
    if tk % GROUP_SIZE or K % tk:
        raise ValueError(f"tk={tk} must be a multiple of {GROUP_SIZE} dividing K={K}")
    codes = xp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*lead, K // tk, 2, tk // 2)
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).astype(xp.uint8).reshape(*lead, half)


def group_metadata(group_sizes, M: int, tm: int):
    """Megablox-style visit lists (jit-friendly): ``offsets [G+1]`` (row where each group
    starts), ``group_ids`` and ``m_tile_ids`` per visit (static length ``ceil(M/tm) + G - 1``,
    padded by repeating the last real visit) and ``num_visits`` (the real ones)."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    G = sizes.shape[0]
    n_tiles = -(-M // tm)
    V = n_tiles + G - 1
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])
    first = offsets[:-1] // tm
    last = (offsets[1:] + tm - 1) // tm  # exclusive
    count = jnp.where(sizes > 0, last - first, 0)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(count)])  # visit index of each group's first
    num = starts[-1]
    v = jnp.arange(V, dtype=jnp.int32)
    vv = jnp.minimum(v, jnp.maximum(num - 1, 0))
    gid = jnp.clip(jnp.searchsorted(starts[1:], vv, side="right"), 0, G - 1).astype(jnp.int32)
    tile = jnp.clip(first[gid] + vv - starts[gid], 0, n_tiles - 1).astype(jnp.int32)
    return offsets, gid, tile, num.astype(jnp.int32)


def _decode_half(codes_u8, scales_u32):
    """``[tn, h]`` codes and their ``[tn, h]`` scale bytes -> exact float32 ``[tn, h]``."""
    return jax.lax.bitcast_convert_type(_f32_bits_from_codes(codes_u8.astype(jnp.uint32), scales_u32), jnp.float32)


def decode_tile(wp, ws):
    """A repacked ``[tn, tk/2]`` byte tile and its ``[tn, tk/32]`` scale bytes -> the two exact
    float32 halves ``[tn, tk/2]`` (elements ``0..tk/2`` and ``tk/2..tk``). Value ops only."""
    tn, h = wp.shape
    s = jnp.broadcast_to(ws.astype(jnp.uint32)[:, :, None], (tn, ws.shape[1], GROUP_SIZE)).reshape(tn, 2 * h)
    return _decode_half(wp & 0xF, s[:, :h]), _decode_half(wp >> 4, s[:, h:])


def tile_k(K: int) -> int:
    """The ``tk`` for input width K: the largest of 512, 256, 128, 64, 32 dividing it (else K).
    Weights are repacked with it, so the repack and the calls must agree."""
    return next((t for t in (512, 256, 128, 64, 32) if K % t == 0), K)


def default_blocks(K: int, N: int, tm: int) -> tuple[int, int, int]:
    """``(tm, tk, tn)`` for a ``[M, K] x [N, K]`` call: :func:`tile_k`, and tn the largest of
    512, 256, 128 dividing N (else N)."""
    tn = next((t for t in (512, 256, 128) if N % t == 0), N)
    return tm, tile_k(K), tn


def _kernel(offsets, gids, tiles, num, layer_base, *refs, tm, tk, act):
    """One visit's ``[tm, tn]`` output tile over the K steps. ``act`` set: the gate/up pair —
    refs carry a second weight (its packed and scale tiles) and accumulator, and the tile
    stored is ``act(x W_gate^T, x W_up^T)``."""
    if act is None:
        x_ref, wp_ref, ws_ref, base_ref, o_ref, acc_ref = refs
        pairs = ((wp_ref, ws_ref, acc_ref),)
    else:
        x_ref, wp_ref, ws_ref, up_p_ref, up_s_ref, base_ref, o_ref, acc_ref, up_acc_ref = refs
        pairs = ((wp_ref, ws_ref, acc_ref), (up_p_ref, up_s_ref, up_acc_ref))
    t, kk = pl.program_id(1), pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        for _, _, a in pairs:
            a[...] = jnp.zeros_like(a)

    x = x_ref[...]
    h = tk // 2
    dims = (((1,), (1,)), ((), ()))
    for p_ref, s_ref, a_ref in pairs:
        w_lo, w_hi = (w.astype(x.dtype) for w in decode_tile(p_ref[...], s_ref[...]))
        a_ref[...] += (jax.lax.dot_general(x[:, :h], w_lo, dims, preferred_element_type=jnp.float32)
                       + jax.lax.dot_general(x[:, h:], w_hi, dims, preferred_element_type=jnp.float32))

    @pl.when(kk == pl.num_programs(2) - 1)
    def _():
        g = gids[t]
        rows = tiles[t] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (rows >= offsets[g]) & (rows < offsets[g + 1]) & (t < num[0])
        # the tile's second visit (a group boundary inside it) keeps what the first stored
        again = (t > 0) & (tiles[jnp.maximum(t - 1, 0)] == tiles[t])
        base = jnp.where(again, o_ref[...], base_ref[...])
        val = acc_ref[...] if act is None else act(acc_ref[...], up_acc_ref[...])
        o_ref[...] = jnp.where(mine, val, base).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_experts", "group_offset", "blocks", "interpret", "act"))
def mxfp4_gmm(x, w_packed, w_scale, group_sizes, layer=0, *, num_experts: int, group_offset: int = 0,
              blocks: tuple[int, int, int] = (128, 512, 256), existing=None, interpret=None, up=None, act=None):
    """``[M, N]`` float32: rows of group ``g`` times expert ``layer·E + group_offset + g``.

    ``w_packed`` must be :func:`repack_halves`-ed with ``blocks[1]`` (``tk``). ``blocks =
    (tm, tk, tn)``; M, N, K must be multiples of tm, tn, tk. ``interpret``: a
    ``pltpu.InterpretParams`` (CPU tests) or None (compile for TPU).

    Fused gate/up: with ``up = (packed, scale)`` (a second stack of the same shape, e.g. w3
    beside w1) and ``act`` (static, e.g. SiTU or ``silu(g) * u``, float32 in and out), the
    result is ``act(x W^T, x W_up^T)``: both weights' tiles are decoded in the same visit and
    x is read once."""
    tm, tk, tn = blocks
    M, K = x.shape
    LE, N, half = w_packed.shape
    if 2 * half != K or w_scale.shape != (LE, N, K // GROUP_SIZE):
        raise ValueError(f"weights {w_packed.shape} / {w_scale.shape} do not match x {x.shape}")
    if M % tm or K % tk or N % tn or tk % GROUP_SIZE:
        raise ValueError(f"blocks {blocks} must divide M={M}, K={K}, N={N} (tk a multiple of 32)")
    if (up is None) != (act is None):
        raise ValueError("the fused gate/up form needs both up= and act=")
    if up is not None and (up[0].shape != w_packed.shape or up[1].shape != w_scale.shape):
        raise ValueError(f"up weights {up[0].shape} / {up[1].shape} differ from {w_packed.shape} / {w_scale.shape}")
    offsets, gids, tiles, num = group_metadata(group_sizes, M, tm)
    base = jnp.asarray(layer, jnp.int32).reshape(1) * num_experts + group_offset
    existing = jnp.zeros((M, N), jnp.float32) if existing is None else existing.astype(jnp.float32)
    V = gids.shape[0]

    def w_map(n, t, k, offsets, gids, tiles, num, base):
        return base[0] + gids[t], n, k

    w_specs = [pl.BlockSpec((pl.Squeezed(), tn, tk // 2), w_map),
               pl.BlockSpec((pl.Squeezed(), tn, tk // GROUP_SIZE), w_map)]
    weights = [w_packed, w_scale] + ([] if up is None else list(up))
    acc = pltpu.VMEM((tm, tn), jnp.float32)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5, grid=(N // tn, V, K // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda n, t, k, o, g, ti, nu, b: (ti[t], k)),
                  *w_specs * (len(weights) // 2),
                  pl.BlockSpec((tm, tn), lambda n, t, k, o, g, ti, nu, b: (ti[t], n))],
        out_specs=pl.BlockSpec((tm, tn), lambda n, t, k, o, g, ti, nu, b: (ti[t], n)),
        scratch_shapes=[acc] * (len(weights) // 2))
    return pl.pallas_call(
        functools.partial(_kernel, tm=tm, tk=tk, act=act), grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        input_output_aliases={6 + len(weights): 0},  # row tiles no group visits keep ``existing``
        interpret=interpret)(offsets, gids, tiles, num.reshape(1), base, x, *weights, existing)
