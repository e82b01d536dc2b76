"""Routed-expert FFN over top-k assignments, with four interchangeable strategies.

All compute ``sum_j w_j * w2_e(act(w1_e x, w3_e x))`` with fp32 accumulation; they differ in
how tokens meet experts, and the choice is static (by shapes, :func:`choose_strategy`):

* ``gather``  — fetch each token's k experts (dequantizing only those): N*k expert copies;
* ``dense``   — run every expert on every token and combine with a [N, E] weight matrix
  (zero for unselected experts): all E experts whatever N;
* ``grouped`` — sort (token, slot) pairs by expert and use ``jax.lax.ragged_dot`` over all E
  (dequantized) experts;
* ``blocked`` — sort the pairs by expert, pad each expert's group to a multiple of a row tile
  ``tm`` (:func:`blocked_tile_rows`) and loop (dynamic trip count: the real tiles only) over
  tiles, each one expert's: fetch/dequantize that expert alone, run its ``tm`` rows through
  w1/w3/act/w2, add the weighted rows into their tokens. Weights read per step: the touched
  experts (once per tile), never all E, never k copies per token.

``valid`` (bool [N]) marks padding tokens of a token bucket: they are routed nowhere
(``grouped``/``blocked``: a sentinel expert id outside every group, so no work) and come out
zero in every strategy (``gather``/``dense`` still compute them, masked).

Measured on a shared 2-core CPU (jax 0.10.2, XLA:CPU), jitted, median ms after warm-up,
uniform random top-k routing; (a) the 105M Kimi-Linear layer: E=32, k=4, I=256, K=512,
float32; (b) a small K3-like layer: E=64, k=8, I=128, K=256, float32; (c) = (b) with MXFP4
experts. "-": skipped (gather's copies would exceed 1 GiB)::

    PYTHONPATH=<dir holding k3serve> python tools/bench_moe_strategies.py

    shape     N    gather     dense   grouped   blocked  winner    chosen
    a         1      3.46     36.20     41.74      1.18  blocked   blocked
    a         8     53.27     47.71     54.00      6.35  blocked   blocked
    a        32    180.29     60.64     78.35     12.04  blocked   blocked
    a       128    754.05    108.14    196.41     19.54  blocked   blocked
    a       512         -    175.83    697.82     44.47  blocked   blocked
    b         1      0.74      8.46     13.74      0.60  blocked   blocked
    b         8      8.29      9.54     22.26      2.03  blocked   blocked
    b        32     81.35     22.63     75.75      5.35  blocked   blocked
    b       128    339.23     41.75    227.45     11.74  blocked   blocked
    b       512         -    112.92    791.10     36.42  blocked   blocked
    c         1      1.37     16.96     22.38      2.47  gather    gather
    c         8     11.67     30.18     34.40     13.27  gather    blocked
    c        32    114.69     34.67     66.52     21.21  blocked   blocked
    c       128    386.34     52.04    228.19     28.39  blocked   blocked
    c       512         -    107.13    792.82     59.10  blocked   blocked

Load from other jobs moves single numbers by up to ~2x between runs; the ranking held in
every run except (c) at N=8 (N*k = E), where gather and blocked traded places over four
runs (11.7 vs 13.3, 15.5 vs 19.3, 24.8 vs 15.1, 25.8 vs 18.3 ms). MXFP4 at N=1, 2, 4:
gather 1.2 / 2.4 / 6.0 ms, blocked 2.5 / 3.7 / 10.3 ms (blocked's per-tile dequantization
inside the loop costs ~2x the batched one). Hence the CPU rule: ``gather`` for MXFP4 while
N*k < E (and its copies stay under 32 MiB), otherwise ``blocked``; ``dense`` and ``grouped``
never win here and stay selectable by name (``grouped`` is the form accelerator grouped-
matmul kernels take). Tile size: ``--tiles`` times blocked at other tiles; the mean group
size (twice it for MXFP4) was within noise of the best tile at every N measured on the
shared box. On a quiet box (2026-12-02, ``--shapes a b --tokens 16 32 64 128 --tiles 1 4 8
16 32``) one exception was steady: a tile of 2 rows for dense experts. A two-row product
takes XLA:CPU's YNNPACK path and costs about what a four-row one does, while one row is a
plain matrix-vector product. At N=16 (mean 2) tile 1 gave 4.59 / 3.21 ms against 5.92 /
4.28 ms for tile 2 on (a) / (b), so a tile of 2 becomes 1. Twice the mean was 3–7 % faster
at N=32 and 64, within noise at 128, and is left alone.

Weights keep the checkpoint layout ``[E, out, in]``; MXFP4 pairs are dequantized inside.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .moe_pairs import pair_experts
from .mxfp4 import unpack_mxfp4


def dequant_experts(w, dtype):
    """``w`` is a dense [E, out, in] array or an (packed, scale) MXFP4 pair."""
    if isinstance(w, (tuple, list)):
        packed, scale = w
        return unpack_mxfp4(packed, scale, dtype=dtype)
    return w.astype(dtype)


def _take_experts(w, idx, dtype, layer=None):
    """Experts ``idx`` of ``w`` ([E, ...]; [L, E, ...] with ``layer``), dequantized: one gather
    from the whole array, never a copy of the layer's slice first."""
    take = (lambda a: jnp.asarray(a)[idx]) if layer is None else (lambda a: jnp.asarray(a)[layer, idx])
    if isinstance(w, (tuple, list)):
        return unpack_mxfp4(take(w[0]), take(w[1]), dtype=dtype)
    return take(w).astype(dtype)


def _layer_slice(w, layer):
    if isinstance(w, (tuple, list)):
        return tuple(jnp.asarray(a)[layer] for a in w)
    return jnp.asarray(w)[layer]


def _shape(w):
    """(E, out, in) of an expert stack, without a leading layer axis."""
    return w[0].shape[-3:-1] + (w[0].shape[-1] * 2,) if isinstance(w, (tuple, list)) else w.shape[-3:]


def blocked_tile_rows(N: int, k: int, E: int, mxfp4: bool = False) -> int:
    """Static row tile of the ``blocked`` strategy: the mean group size ``N*k/E`` (twice it
    for MXFP4 experts, whose per-tile dequantization favours fewer tiles) rounded up to a
    power of two, in [1, 128]; for dense experts never 2, which becomes 1 (XLA:CPU's
    two-row product costs about as much as a four-row one, see the module docstring).
    Smaller tiles waste less padding compute (up to ``tm - 1`` rows per touched expert),
    larger ones run fewer loop steps."""
    mean = -(-N * k * (2 if mxfp4 else 1) // E)
    tm = int(min(128, 1 << max(0, mean - 1).bit_length()))
    return 1 if tm == 2 and not mxfp4 else tm


def _blocked(x, topk_idx, topk_w, w1, w2, w3, act, E, compute_dtype, valid, tm, layer=None):
    """Pairs sorted by expert, each expert's group padded to a multiple of ``tm`` rows; a
    dynamic-trip-count loop over the real tiles, each tile one expert's: fetch (dequantize)
    that expert only, run its ``tm`` rows, add the weighted rows into their tokens."""
    f32, i32 = jnp.float32, jnp.int32
    N, K = x.shape
    k = topk_idx.shape[1]
    M = N * k
    flat_e = pair_experts(topk_idx, valid, E)  # [M], E = sentinel
    sizes = jnp.zeros((E + 1,), i32).at[flat_e].add(1)[:E]  # sentinel excluded
    tiles = (sizes + tm - 1) // tm  # per expert
    tile_end = jnp.cumsum(tiles)
    num_tiles = tile_end[-1]
    T = -(-M // tm) + min(E, M)  # static bound: sum ceil(s/tm) <= M/tm + #non-empty experts
    R = T * tm
    # tile t belongs to expert #{e : tile_end[e] <= t}; tiles >= num_tiles are never run
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(T, dtype=i32), side="right"), E - 1)
    order = jnp.argsort(flat_e, stable=True)  # expert-major, sentinel pairs last
    se = flat_e[order]
    group_start = jnp.concatenate([jnp.zeros((1,), i32), jnp.cumsum(sizes)])  # [E+1]
    row0 = jnp.concatenate([(tile_end - tiles) * tm, jnp.array([R], i32)])  # padded start, sentinel -> R
    dest = row0[se] + jnp.arange(M, dtype=i32) - group_start[se]
    dest = jnp.where(se < E, dest, R)  # dropped
    row_tok = jnp.full((R,), N, i32).at[dest].set((order // k).astype(i32), mode="drop")  # N = no token
    row_w = jnp.zeros((R,), f32).at[dest].set(topk_w.reshape(-1)[order].astype(f32), mode="drop")
    xp = jnp.concatenate([x.astype(compute_dtype), jnp.zeros((1, K), compute_dtype)])  # row N: zeros

    def tile(t, out):
        e = tile_expert[t]
        rows = jax.lax.dynamic_slice(row_tok, (t * tm,), (tm,))
        wr = jax.lax.dynamic_slice(row_w, (t * tm,), (tm,))
        xt = xp[rows]  # [tm, K]
        W1, W3, W2 = (_take_experts(w, e, compute_dtype, layer) for w in (w1, w3, w2))  # one expert
        g = jnp.einsum("rd,id->ri", xt, W1, preferred_element_type=f32)
        u = jnp.einsum("rd,id->ri", xt, W3, preferred_element_type=f32)
        h = act(g, u).astype(compute_dtype)
        y = jnp.einsum("ri,di->rd", h, W2, preferred_element_type=f32)
        return out.at[rows].add(jnp.where(rows[:, None] < N, y * wr[:, None], 0.0))

    out = jax.lax.fori_loop(0, num_tiles, tile, jnp.zeros((N + 1, K), f32))
    return out[:N]


def choose_strategy(N: int, k: int, E: int, I: int, K: int, mxfp4: bool = False, platform: str | None = None) -> str:
    """The strategy for N tokens (static), from the CPU measurements in the module docstring:
    ``gather`` for MXFP4 experts while the pairs are fewer than the experts (N*k < E) and the
    gathered copy stays small, else ``blocked``. Other platforms (unmeasured) keep the rule
    used before ``blocked`` existed."""
    platform = platform or jax.default_backend()
    gathered = N * k * 3 * I * K * 4  # bytes of the dequantized copies gather makes
    if platform != "cpu":
        if gathered <= 32 * 2**20:
            return "gather"
        return "dense" if E <= 16 * k else "grouped"
    if mxfp4 and N * k < E and gathered <= 32 * 2**20:
        return "gather"
    return "blocked"


STRATEGIES = ("gather", "dense", "grouped", "blocked")


def expert_ffn(x, topk_idx, topk_w, w1, w2, w3, act, num_experts: int, compute_dtype=jnp.float32,
               strategy: str | None = None, valid=None, tile_rows: int | None = None, layer=None,
               backend: str = "reference"):
    """x [N, K]; topk_idx/topk_w [N, k]; w1/w3 [E, I, K], w2 [E, K, I] (dense or MXFP4).

    ``act(gate, up)`` is the gated activation (SiTU or SiLU·up), computed in fp32.
    ``valid`` (bool [N], optional): tokens where it is False (padding of a token bucket) are
    routed nowhere and come out zero. ``strategy`` (default: :func:`choose_strategy`) and
    ``tile_rows`` (``blocked`` only; default :func:`blocked_tile_rows`) are static.
    ``layer`` (int, may be traced): the weights are layer stacks ``[L, E, ...]`` (the scanned
    layers, ``model.layer_plan``) and this layer's experts are used. ``gather`` and ``blocked``
    read the experts they need straight from the stack; ``dense`` and ``grouped``, which read
    every expert anyway, take the layer's slice.
    ``backend`` "pallas" / "pallas-interpret" with MXFP4 experts: the grouped-matmul kernel
    (``moe_gmm.py``; weights repacked at load), compiled for TPU or interpreted (CPU tests);
    dense experts, and the reference backend, use the strategies above.
    Returns float32 [N, K]: sum_j w_j * w2_e(act(w1_e x, w3_e x)).
    """
    x, topk_idx, topk_w = jnp.asarray(x), jnp.asarray(topk_idx), jnp.asarray(topk_w)
    N, K = x.shape
    k = topk_idx.shape[1]
    E, I, _ = _shape(w1)
    f32 = jnp.float32
    mx = isinstance(w1, (tuple, list))
    strategy = strategy or choose_strategy(N, k, E, I, K, mx)
    if valid is not None:
        valid = jnp.asarray(valid, bool).reshape(N)
    if backend != "reference" and mx:
        from .moe_gmm import gmm_experts, interpret_params

        return gmm_experts(x, topk_idx, topk_w, w1, w2, w3, act, num_experts, compute_dtype, valid, layer,
                           interpret_params() if backend == "pallas-interpret" else None)
    if strategy == "blocked":
        return _blocked(x, topk_idx, topk_w, w1, w2, w3, act, num_experts, compute_dtype, valid,
                        tile_rows or blocked_tile_rows(N, k, num_experts, mx), layer)
    keep = lambda out: out if valid is None else jnp.where(valid[:, None], out, 0.0)
    tw = topk_w.astype(f32)
    if valid is not None:
        tw = jnp.where(valid[:, None], tw, 0.0)
    if strategy == "gather":
        xc = x.astype(compute_dtype)
        W1, W3, W2 = (_take_experts(w, topk_idx, compute_dtype, layer) for w in (w1, w3, w2))  # [N, k, ...]
        g = jnp.einsum("nd,njid->nji", xc, W1, preferred_element_type=f32)
        u = jnp.einsum("nd,njid->nji", xc, W3, preferred_element_type=f32)
        h = act(g, u).astype(compute_dtype)
        y = jnp.einsum("nji,njdi->njd", h, W2, preferred_element_type=f32)
        return keep(jnp.einsum("njd,nj->nd", y, tw))
    if layer is not None:
        w1, w2, w3 = (_layer_slice(w, layer) for w in (w1, w2, w3))
    if strategy == "dense":
        xc = x.astype(compute_dtype)
        W1, W3, W2 = (dequant_experts(w, compute_dtype) for w in (w1, w3, w2))
        comb = jnp.zeros((N, num_experts), f32).at[jnp.arange(N)[:, None], topk_idx].add(tw)
        g = jnp.einsum("nd,eid->nei", xc, W1, preferred_element_type=f32)
        u = jnp.einsum("nd,eid->nei", xc, W3, preferred_element_type=f32)
        h = act(g, u).astype(compute_dtype)
        y = jnp.einsum("nei,edi,ne->nd", h, W2, comb.astype(compute_dtype), preferred_element_type=f32)
        return keep(y)
    if strategy != "grouped":
        raise ValueError(f"unknown expert strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    flat_e = pair_experts(topk_idx, valid, num_experts)  # sentinel E sorts last, outside every group
    order = jnp.argsort(flat_e, stable=True)
    tok = order // k
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[flat_e].add(1)[:num_experts]
    xs = x[tok].astype(compute_dtype)
    W1 = dequant_experts(w1, compute_dtype)
    W3 = dequant_experts(w3, compute_dtype)
    W2 = dequant_experts(w2, compute_dtype)
    g = jax.lax.ragged_dot(xs, jnp.swapaxes(W1, 1, 2), group_sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(xs, jnp.swapaxes(W3, 1, 2), group_sizes, preferred_element_type=f32)
    h = act(g, u).astype(compute_dtype)
    y = jax.lax.ragged_dot(h, jnp.swapaxes(W2, 1, 2), group_sizes, preferred_element_type=f32)
    live = flat_e[order] < num_experts  # rows past sum(group_sizes) are not read
    contrib = jnp.where(live[:, None], y * tw.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((N, y.shape[-1]), f32).at[tok].add(contrib)
