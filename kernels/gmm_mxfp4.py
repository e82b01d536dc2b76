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
Weights are stacked ``[L*E, N, K/2]`` / ``[L*E, N, Gp]`` (every layer's experts, passed
whole: no per-layer slice for XLA to copy); group ``g`` of a call uses weight
``layer * E + group_offset + g`` (``group_offset``: the first expert of this EP shard).

**Stored layout** (made once at load by ``moe_gmm.repack_experts``, lossless; the reference
path and the checkpoint keep the original):

* bytes (:func:`repack_halves`): within each ``tk``-wide block of K, byte ``j`` holds element
  ``j`` in its low nibble and element ``j + tk/2`` in its high one (the checkpoint pairs
  elements ``2j, 2j+1``). A tile then decodes as two half tiles, each a plain ``[tn, tk/2]``
  array multiplied by one half of the activation tile — no lane interleave, and no ref
  reshape or bitcast (which TPU interpret mode rejects; values are reshaped only).
* scales (:func:`pad_scales`): the checkpoint's ``[.., N, K/32]`` uint8 with zero columns up to
  ``Gp = 128·ceil(K/4096)`` (K3: 112 or 96 -> 128; +14% / +33% of the scale bytes, ~1-2% of
  the stack). Why: a Mosaic block's last dim must be a multiple of 128 or the whole dim, so
  the per-``tk`` block ``(tn, tk/32)`` (16 columns) is illegal; the whole-row block ``(tn,
  K/32)`` is legal, but XLA:TPU stores an array whose minor dim is 96 or 112 transposed
  (``{1,2,0}``) and then copies the whole scale stack around every call; with 128 columns it
  keeps row-major ``T(32,128)``, the layout the kernel reads. N stays the second dim, so
  ``sharding.mesh.param_spec`` splits bytes and scales alike (experts over EP, N over tp).
  The kernel also accepts the checkpoint's ``[.., N, K/32]`` (same result, plus that copy).
  Rejected: k-major scales ``[.., K/32, N]`` (legal as uint16 blocks ``(16, tn)``, but the
  positional ``param_spec`` would then split K/32 over tp, not N, and uint16 doubles the
  bytes); pre-expanded scales (32x the bytes).

In the kernel a visit fetches its ``[tn, Gp]`` scale block once (same block index for every
k step); :func:`tile_scales` picks K tile ``kk``'s groups and repeats each 32 times with one
bf16 matmul by a 0/1 matrix (exact: one term per output, bytes exact in bf16). Measured
alternatives (tpu7x, down projection, tn 896, tm 128): slicing the block's 16 columns at the
dynamic offset ``kk·16`` fails ("cannot statically prove that index in dimension 2 is a
multiple of 128"); broadcast + reshape ``[tn, 16, 32] -> [tn, 512]`` compiles but takes 13.8
MiB of scoped VMEM against 5.1 MiB. Packed bytes are widened to uint32 before the nibble shift
(Mosaic has no 8-bit shift).

**VMEM and blocks.** ``vmem_limit_bytes`` is explicit (:data:`VMEM_LIMIT`, 32 MiB of a v7x
TensorCore's 64). ``tk`` is fixed at load by the repack (:func:`tile_k`: 512 at K3's widths);
``tm`` is the caller's row tile (8 for decode, up to 128); :func:`choose_blocks` takes the
widest ``tn`` (a multiple of 128 dividing N, <= 2048) whose :func:`vmem_estimate` (every
block double-buffered, accumulators, the decode's ``[tn, tk/2]`` 32-bit values) fits half the
limit: fewer grid steps (~0.35 us each) and fewer re-reads of x, while the weights stream once
per visit whatever tn is. Compiled for ``tpu7x`` at K3's per-device shapes (fused gate/up and
down, tm 8 and 128) Mosaic reports 1.5-5.2 MiB of scoped VMEM used against estimates of 8-17
MiB (``tests/test_tpu_aot_gmm.py``); no compile copies a weight stack. Unmeasured on a TPU:
speed (the in-kernel decode is VPU work per weight element; the 0/1 matmul adds MXU work of
``tn·Gp·tk`` per step).

Grid (megablox's): ``(N / tn, visits, K / tk)``; a *visit* is one (group, row tile) pair,
listed by :func:`group_metadata` in row order, so a row tile shared by two groups is visited
twice in a row and the second visit's masked store keeps the first's rows. Metadata is
scalar-prefetched into SMEM. The visit count is static, ``ceil(M / tm) + G - 1``; visits past
the real ones repeat the last and store nothing.

Cost per call: HBM bytes ≈ ``visits · N·(K/2 + Gp)`` of weights (each visit streams its
group's tiles) + ``x`` once per column tile (``(N/tn) · M·K·itemsize``) + ``M·N·4`` out;
FLOPs ``2·M·N·K`` plus the row tiles' padding (and the scale selection's ``2·N·Gp·K`` per
visit on the MXU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import cost_estimates
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


def _decode_half(codes_u32, scales_u32):
    """``[tn, h]`` codes and their ``[tn, h]`` scale bytes (uint32) -> exact float32 ``[tn, h]``."""
    return jax.lax.bitcast_convert_type(_f32_bits_from_codes(codes_u32, scales_u32), jnp.float32)


def tile_scales(ws, kk, tk: int):
    """A ``[tn, G]`` scale-byte block (every group of the tile's rows, ``G >= K/32``) -> the
    scale of each weight of K tile ``kk`` as two uint32 ``[tn, tk/2]`` halves (elements
    ``kk·tk + j`` and ``kk·tk + tk/2 + j``). One matmul with a 0/1 matrix picks the tile's
    groups and repeats each 32 times: exact (bytes are exact in bfloat16, one term per
    output), with no lane slice at a dynamic offset (Mosaic rejects it) and no lane-expanding
    reshape (2.7x the VMEM; module doc)."""
    tn, G = ws.shape
    h = tk // 2
    w = ws.astype(jnp.int32).astype(jnp.float32).astype(jnp.bfloat16)
    g = jax.lax.broadcasted_iota(jnp.int32, (G, h), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (G, h), 1)
    first = kk * (tk // GROUP_SIZE) + (j >> 5)

    def pick(off):
        sel = jnp.where(g == first + off, 1.0, 0.0).astype(jnp.bfloat16)
        s = jax.lax.dot_general(w, sel, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return s.astype(jnp.int32).astype(jnp.uint32)

    return pick(0), pick(h // GROUP_SIZE)


def decode_tile(wp, s_lo, s_hi):
    """A repacked ``[tn, tk/2]`` byte tile and its two ``[tn, tk/2]`` uint32 scale halves
    (:func:`tile_scales`) -> the two exact float32 halves ``[tn, tk/2]`` (elements ``0..tk/2``
    and ``tk/2..tk``). The bytes are widened to uint32 before any shift: Mosaic has no 8-bit
    shift. Value ops only."""
    w = wp.astype(jnp.uint32)
    return _decode_half(w & 0xF, s_lo), _decode_half(w >> 4, s_hi)


def tile_k(K: int) -> int:
    """The ``tk`` for input width K: the largest of 512, 256, 128, 64, 32 dividing it (else K).
    Weights are repacked with it, so the repack and the calls must agree."""
    return next((t for t in (512, 256, 128, 64, 32) if K % t == 0), K)


def scale_groups(K: int) -> int:
    """Scale columns of the stored layout for input width K: ``K/32`` rounded up to 128."""
    return -(-K // (GROUP_SIZE * 128)) * 128


def pad_scales(scale):
    """Checkpoint scales ``[..., N, K/32]`` -> the stored layout ``[..., N, scale_groups(K)]``
    (zero columns appended; lossless, once at load). numpy or jax arrays; a jax array keeps
    its sharding (the padded dim is never split)."""
    G = scale.shape[-1]
    Gp = scale_groups(G * GROUP_SIZE)
    if G == Gp:
        return scale
    widths = [(0, 0)] * (scale.ndim - 1) + [(0, Gp - G)]
    if isinstance(scale, jax.core.Tracer):  # inside a jit (a placed repack): its out_shardings place it
        return jnp.pad(scale, widths)
    if isinstance(scale, jax.Array):
        return jax.jit(lambda s: jnp.pad(s, widths), out_shardings=scale.sharding)(scale)
    return np.pad(scale, widths)


VMEM_LIMIT = 32 * 2**20
"""The kernel's ``vmem_limit_bytes``: half of a v7x TensorCore's 64 MiB (the default scoped
limit), 6-20x what the chosen blocks use at K3's shapes."""


def vmem_estimate(tm: int, tk: int, tn: int, K: int, *, x_itemsize: int = 2, weights: int = 1) -> int:
    """Bytes of VMEM one call's blocks need (an upper bound, from the block shapes): ``x``,
    packed and scale tiles and the output/``existing`` tiles double-buffered, the float32
    accumulators, the decode's ``[tn, tk/2]`` 32-bit values (counted as eight per weight) and
    the scale-selection matrices."""
    Gp = scale_groups(K)
    x = 2 * tm * tk * x_itemsize
    w = weights * 2 * (tn * tk // 2 + tn * Gp)
    io = 2 * 2 * tm * tn * 4
    acc = weights * tm * tn * 4
    decode = weights * 8 * tn * (tk // 2) * 4 + 4 * Gp * (tk // 2) * 4
    return x + w + io + acc + decode


def choose_blocks(K: int, N: int, tm: int, *, x_itemsize: int = 2, weights: int = 1,
                  budget: int = VMEM_LIMIT // 2) -> tuple[int, int, int]:
    """``(tm, tk, tn)``: tk = :func:`tile_k` (fixed by the load-time repack) and the widest tn
    (a multiple of 128 dividing N, at most 2048) whose :func:`vmem_estimate` fits ``budget``
    (half the limit: room for Mosaic's own scratch). Why wide: each grid step costs ~0.35 us
    of overhead, and x is re-read once per column tile; the weights stream once per visit
    whatever tn is. N not a multiple of 128 (tests' toy shapes): tn = N."""
    tk = tile_k(K)
    fits = [t for t in range(min(N, 2048) // 128 * 128, 0, -128) if N % t == 0
            and vmem_estimate(tm, tk, t, K, x_itemsize=x_itemsize, weights=weights) <= budget]
    if not fits and N % 128 == 0:
        raise ValueError(f"no column block fits {budget} bytes of VMEM for tm={tm}, K={K}, N={N}")
    return tm, tk, fits[0] if fits else N


def default_blocks(K: int, N: int, tm: int, **kw) -> tuple[int, int, int]:
    """:func:`choose_blocks` (the name callers used before the VMEM budget)."""
    return choose_blocks(K, N, tm, **kw)


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
        w_lo, w_hi = (w.astype(x.dtype) for w in decode_tile(p_ref[...], *tile_scales(s_ref[...], kk, tk)))
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


@functools.partial(jax.jit, static_argnames=("num_experts", "group_offset", "blocks", "interpret", "act",
                                             "vmem_limit_bytes", "cost_rows"))
def mxfp4_gmm(x, w_packed, w_scale, group_sizes, layer=0, *, num_experts: int, group_offset: int = 0,
              blocks: tuple[int, int, int] = (128, 512, 256), existing=None, interpret=None, up=None, act=None,
              vmem_limit_bytes: int = VMEM_LIMIT, cost_rows: int | None = None):
    """``[M, N]`` float32: rows of group ``g`` times expert ``layer·E + group_offset + g``.

    ``w_packed`` must be :func:`repack_halves`-ed with ``blocks[1]`` (``tk``); ``w_scale`` is
    ``[L*E, N, scale_groups(K)]`` (:func:`pad_scales`) or the checkpoint's ``[L*E, N, K/32]``
    (same result; on a TPU XLA stores a minor dim of 96 or 112 transposed and copies the whole
    stack around the kernel). ``blocks = (tm, tk, tn)`` (:func:`choose_blocks`); M, N, K must
    be multiples of tm, tn, tk. ``vmem_limit_bytes``: the kernel's scoped VMEM limit.
    ``interpret``: a ``pltpu.InterpretParams`` (CPU tests) or None (compile for TPU).
    ``cost_rows``: the rows a call is expected to carry, for XLA's cost model only (the EP
    exchange's buffers hold its worst case, ``ep`` times the balanced load; None: M).

    Fused gate/up: with ``up = (packed, scale)`` (a second stack of the same shape, e.g. w3
    beside w1) and ``act`` (static, e.g. SiTU or ``silu(g) * u``, float32 in and out), the
    result is ``act(x W^T, x W_up^T)``: both weights' tiles are decoded in the same visit and
    x is read once."""
    tm, tk, tn = blocks
    M, K = x.shape
    LE, N, half = w_packed.shape
    if 2 * half != K or w_scale.shape not in ((LE, N, K // GROUP_SIZE), (LE, N, scale_groups(K))):
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

    def s_map(n, t, k, offsets, gids, tiles, num, base):
        return base[0] + gids[t], n, 0  # the same block for every k: fetched once per visit

    w_specs = [pl.BlockSpec((pl.Squeezed(), tn, tk // 2), w_map),
               pl.BlockSpec((pl.Squeezed(), tn, w_scale.shape[2]), s_map)]
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
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        input_output_aliases={6 + len(weights): 0},  # row tiles no group visits keep ``existing``
        cost_estimate=cost_estimates.mxfp4_gmm(x, w_packed, w_scale, num_experts, N, fused=up is not None,
                                               rows=cost_rows),
        interpret=interpret)(offsets, gids, tiles, num.reshape(1), base, x, *weights, existing)
