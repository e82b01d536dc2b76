"""Explicit expert-parallel (EP) dispatch and combine for the routed-expert FFN.

:func:`expert_ffn_ep` computes exactly what ``kernels.moe.expert_ffn`` computes
(``sum_j w_j * w2_e(act(w1_e x, w3_e x))``, float32), but inside one ``jax.shard_map`` over
the whole mesh, with the token exchange written out instead of left to XLA's partitioner.

Layout (what :func:`sharding.mesh.param_spec` gives the routed experts, consumed as is):
``w1``/``w3`` ``[E, I, K]`` and ``w2`` ``[E, K, I]`` (or their MXFP4 ``packed``/``scale``
pairs, same leading dims) have the expert dim over the ``ep`` EP ranks (``EXPERTS =
("dp", "ep")`` flattened, rank ``r`` owns experts ``[r*E/ep, (r+1)*E/ep)``) and dim 1 over
``"tp"``: the intermediate rows ``I`` of ``w1``/``w3``, but the *output* rows ``K`` of ``w2``.

Algorithm, per device (EP rank ``r``, tp rank ``t``):

1. Split tokens over the EP ranks: N is padded to ``N_pad = ep * n``; rank ``r`` owns tokens
   ``[r*n, (r+1)*n)`` (replicated over ``"tp"``). Padding tokens (and tokens the caller marks
   invalid with ``valid``) get expert id -1 and weight 0 and are never dispatched.
2. Dispatch: each of the ``n*k`` (token, choice) pairs goes to EP rank ``expert // (E/ep)``
   with its local expert id ``expert % (E/ep)``. The pairs are ordered by (destination, local
   expert) with a one-hot cumsum (a stable counting sort, no ``argsort``), which gives each
   pair's rank among the pairs with the same destination (``pos``), where each destination's
   pairs start (``start[d]``) and how many go to each (destination, expert). One small
   exchange of those sizes tells every receiver how many rows each source sends and how
   many of them are for each of its experts; the rows arrive sorted by expert, so no per-row
   expert id travels. Where they land in the receive buffer depends on the exchange (below).
3. Local experts: the receiver groups its rows by local expert (same counting sort) and runs
   ``jax.lax.ragged_dot`` against its ``E/ep`` experts (MXFP4 dequantized with
   ``kernels.mxfp4.unpack_mxfp4``; with a Pallas backend and MXFP4 weights instead the MXFP4
   grouped-matmul kernel, which decodes only the visited experts' tiles, ``_local_experts_gmm``):
   ``h = act(x W1ᵀ, x W3ᵀ)`` on its ``I/tp`` slice, ``all_gather`` of ``h`` over ``"tp"`` (w2
   is split over its output rows, so no partial sums arise: the result is the single-device
   arithmetic, only the expert's K columns are split), then ``y = h W2ᵀ`` on its ``K/tp`` columns.
4. Combine: the rows go back to their source with the inverse exchange; the source puts
   them back in (token, choice) order, weights by ``topk_w`` and sums the ``k`` choices (fp32),
   then one ``all_gather`` over the EP axes and ``"tp"`` together (tokens and K columns)
   leaves all ``N`` tokens on every device; the padding is stripped.

The latent MoE's input arrives split by columns over the attention group (``x_split``: the
down-projection's layout) and each rank gathers its own tokens' rows inside the exchange;
its RMSNorm runs inside too, on the combined rows (``post``). Collectives per MoE layer on a
decode step under EP×TP (ragged): the input gather, the sizes, the dispatch, the gather of
``h`` over ``"tp"``, the combine, the output gather (docs/compile.md, "Collectives").

A dim that ``param_spec`` leaves whole (it does not divide by tp) is consumed whole: no
gather of ``h`` when ``I % tp``, full K columns on every tp rank when ``K % tp``. Experts
that do not divide by ep are refused (ValueError), as ``Recipe.validate`` refuses them.

Capacity: ``C = n * k`` rows per (source, destination) pair -- everything a source holds,
so no token is ever dropped, whatever the routing (the worst case, every pair of every
source on one rank, fills exactly ``ep * C`` receive rows). That worst case is ``ep`` times the
balanced load, and every buffer after the dispatch (the received rows, their grouping by
expert, the gather of ``h``, the results) is sized by it.

Two exchanges implement steps 2 and 4 (same results):

* ``impl="padded"``: ``jax.lax.all_to_all`` of a dense ``[ep, C, K]`` send buffer (unused
  rows are zeros) -- moves ``ep * C`` rows per rank each way; the receive layout is one block
  of ``C`` rows per source. Runs everywhere; the one used on CPU, whose XLA backend has no
  ``ragged-all-to-all`` (jax 0.10.2: "HLO opcode `ragged-all-to-all` is not supported by
  XLA:CPU ThunkEmitter").
* ``impl="ragged"``: ``jax.lax.ragged_all_to_all`` sends only the used rows (the pairs in
  destination-major order, ``input_offsets = start``, ``send_sizes = count``). Instead of the
  sizes' ``all_to_all`` every rank ``all_gather``s every rank's sizes (one collective either
  way; ``[ep, ep, 2 + E/ep]`` int32, 29 KB at K3), so each rank knows the whole routing: where
  its rows land in each receiver's *compact* buffer (after the lower ranks' rows), and whether
  any receiver gets more than :func:`receive_capacity` rows, twice the balanced load. All ranks
  then take the same branch of a ``lax.cond``: receive buffers of that capacity, or, when some
  rank would overflow them, the worst-case ``ep * C`` rows in blocks of ``C`` per source. Both
  branches are exact; at 64 decode tokens under v7-32-decode the usual one's buffers move
  63 MB against the worst case's 167 MB (one MoE layer's exchange compiled for tpu7x: 403 MB
  accessed against 507 MB, 340 MB of both the expert tiles). XLA's cost analysis counts a
  ``cond`` at its larger branch, so a compiled step's "bytes accessed" shows the worst case.
* ``impl="ragged-usual"``: the ragged exchange's usual branch alone (no ``cond``): what a step
  whose routing fits the capped buffers runs. Pairs past a receiver's capacity would be lost,
  so it is for cost programs only (``k3serve compile``'s decode figures), never for serving.
* ``impl="auto"`` (default): ``"padded"`` when the mesh's devices are CPUs, else
  ``"ragged"`` (GPU and TPU implement the ragged collective; checked on one H200 with
  jax 0.11.2 at ep=1 only -- the CPU tests check its offsets with an emulated collective).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..kernels.mxfp4 import unpack_mxfp4
from .mesh import EXPERTS, param_spec

IMPLS = ("auto", "padded", "ragged", "ragged-usual")
# a split input this small (the whole group's rows, all columns) is gathered whole in one
# collective: at decode sizes a collective's latency, not its bytes, is the cost
_GATHER_WHOLE_BYTES = 1 << 20
_ragged_all_to_all = jax.lax.ragged_all_to_all  # module-level so a CPU test can check the offsets with an emulation
_EXPERT_PATH = "layers.0.block_sparse_moe.experts."


def _is_pair(w) -> bool:
    return isinstance(w, (tuple, list))


def _shape(w, stacked: bool = False) -> tuple:
    """Logical [E, out, in] of a dense weight or an MXFP4 (packed, scale) pair (``stacked``:
    behind a leading layer axis)."""
    s = 1 if stacked else 0
    return (*w[0].shape[s:s + 2], w[0].shape[s + 2] * 2) if _is_pair(w) else tuple(w.shape[s:])


def _weight_specs(name: str, w, mesh_shape: dict, stacked: bool = False) -> list:
    """The param_spec entries of this expert weight's arrays (two for an MXFP4 pair), without
    the layer axis of a stack."""
    s = 1 if stacked else 0
    if _is_pair(w):
        return [param_spec(_EXPERT_PATH + f"{name}_{part}", tuple(a.shape[s:]), mesh_shape)
                for part, a in zip(("packed", "scale"), w)]
    return [param_spec(_EXPERT_PATH + name, tuple(w.shape[s:]), mesh_shape)]


def _local_dense(w, dtype):
    """This device's block of an expert weight, dense in ``dtype``."""
    if _is_pair(w):
        return unpack_mxfp4(w[0], w[1], dtype=dtype)
    return w.astype(dtype)


def resolve_impl(impl: str, mesh) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown EP exchange impl {impl!r} (one of {', '.join(IMPLS)})")
    if impl == "auto":
        return "padded" if mesh.devices.flat[0].platform == "cpu" else "ragged"
    return impl


def expert_ffn_ep(x, topk_idx, topk_w, w1, w2, w3, act, num_experts: int, compute_dtype=jnp.float32, *,
                  mesh, impl: str = "auto", valid=None, layer=None, backend: str = "reference",
                  x_split: bool = False, post=None):
    """Expert-parallel ``expert_ffn``: x [N, K]; topk_idx/topk_w [N, k]; w1/w3 [E, I, K] and
    w2 [E, K, I] (dense or MXFP4 pairs) placed by ``param_spec`` on ``mesh`` (a
    ``build_mesh`` mesh). Call it under ``jax.jit`` with global arrays. Returns float32
    [N, K], replicated over the mesh. ``impl``: "padded", "ragged" or "auto" (module doc).
    ``valid`` (bool [N], optional): tokens where it is False are treated like the padding
    tokens (expert id -1: never dispatched) and come out zero. ``layer``: the weights are layer
    stacks ``[L, E, ...]`` (scanned layers). ``backend`` "pallas" / "pallas-interpret" with MXFP4
    weights (repacked at load, ``kernels.moe_gmm.repack_experts``): each rank's local experts
    run through the MXFP4 grouped-matmul kernel (``_local_experts_gmm``), which reads the
    whole stack in place with the layer as an index; otherwise this layer's slice is taken
    and the experts are dequantized for ``ragged_dot``.

    ``x_split``: ``x`` comes as the latent down-projection leaves it, columns split over the
    attention group ``("ep", "tp")`` (rows over the DP groups); each rank gathers its tokens'
    whole rows itself (a gather over ``"tp"`` and an all-to-all over ``"ep"``) instead of the
    partitioner's three collectives. ``post``: ``(fn, args)``, applied as ``fn(out, *args)``
    to the combined rows inside the exchange, where every device holds them whole (the latent
    RMSNorm: outside, the partitioner computed it on column blocks and all-reduced the sums)."""
    gmm = backend != "reference" and _is_pair(w1)
    stacked = layer is not None and gmm  # the kernel indexes the stack: no per-layer slice
    if layer is not None and not gmm:
        w1, w2, w3 = (tuple(a[layer] for a in w) if _is_pair(w) else w[layer] for w in (w1, w2, w3))
    impl = resolve_impl(impl, mesh)
    mshape = dict(mesh.shape)
    ep = int(np.prod([mshape[a] for a in EXPERTS]))
    N, K = x.shape
    k = topk_idx.shape[1]
    E, I, K1 = _shape(w1, stacked)
    if E != num_experts or K1 != K or _shape(w3, stacked) != (E, I, K) or _shape(w2, stacked) != (E, K, I):
        raise ValueError(f"expert weights do not match: x {x.shape}, w1 {_shape(w1, stacked)}, "
                         f"w3 {_shape(w3, stacked)}, w2 {_shape(w2, stacked)}, num_experts {num_experts}")
    weights = {"w1": w1, "w2": w2, "w3": w3}
    specs = {n: _weight_specs(n, w, mshape, stacked) for n, w in weights.items()}
    for n, ss in specs.items():
        if any(s[0] != EXPERTS for s in ss):
            raise ValueError(f"expert-parallel dispatch needs the {E} experts divisible by ep = {ep}; "
                             f"{n} is placed as {ss}")
        if len({s[1] for s in ss}) != 1:
            raise ValueError(f"{n}'s MXFP4 arrays are split differently over tp: {ss}")
    h_split = specs["w1"][0][1] == "tp"  # I of w1/w3 split over tp (else whole)
    if h_split != (specs["w3"][0][1] == "tp"):
        raise ValueError("w1 and w3 are split differently over tp")
    y_split = specs["w2"][0][1] == "tp"  # K of w2 split over tp (else whole)
    lead = (None,) if stacked else ()  # the layer axis of a stack stays whole
    in_w = {n: tuple(P(*lead, *s) for s in specs[n]) if _is_pair(w) else P(*lead, *specs[n][0])
            for n, w in weights.items()}

    n = -(-N // ep)  # tokens per EP rank
    pad = n * ep - N
    xp = jnp.pad(x, ((0, pad), (0, 0)))
    idx = topk_idx.astype(jnp.int32)
    if valid is not None:
        idx = jnp.where(jnp.asarray(valid, bool).reshape(N, 1), idx, -1)
    idxp = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=-1)
    wp = jnp.pad(topk_w.astype(jnp.float32), ((0, pad), (0, 0)))

    interpret = None
    if backend == "pallas-interpret":
        from ..kernels.moe_gmm import interpret_params

        interpret = interpret_params()
    # cost_rows: the balanced load (n*k rows a rank receives on average; its buffer holds ep times that)
    experts = functools.partial(_local_experts_gmm, interpret=interpret, cost_rows=n * k) if gmm else _local_experts
    post_fn, post_args = post if post is not None else (None, ())
    body = functools.partial(_ep_body, act=act, E=E, ep=ep, n=n, k=k, compute_dtype=compute_dtype,
                             impl=impl, h_split=h_split, y_split=y_split, experts=experts, tp_size=mshape["tp"],
                             gather_x={a: mshape[a] for a in ("tp", "ep")} if x_split else None, post_fn=post_fn)
    tok = P(EXPERTS, None)
    w1, w2, w3 = (tuple(w) if _is_pair(w) else w for w in (w1, w2, w3))  # pytrees match in_w
    lay = jnp.asarray(0 if layer is None or not stacked else layer, jnp.int32)
    x_spec = P("dp", ("ep", "tp")) if x_split else tok
    out = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, tok, tok, in_w["w1"], in_w["w2"], in_w["w3"], P(),
                                                   tuple(P() for _ in post_args)),
                        out_specs=P(), check_vma=False)(xp, idxp, wp, w1, w2, w3, lay, tuple(post_args))
    return out[:N]


def _group_slots(group, num_groups: int):
    """Stable group-major order without a sort. ``group`` [M] holds ids in ``[0, num_groups]``
    (``num_groups`` = "none", ordered last). Returns ``slot`` (each element's row in that
    order, a permutation of ``[0, M)``), ``pos`` (its rank inside its group) and the
    ``count``/``start`` of the real groups ([num_groups] each)."""
    onehot = (group[:, None] == jnp.arange(num_groups + 1, dtype=group.dtype)[None, :]).astype(jnp.int32)
    csum = jnp.cumsum(onehot, axis=0)
    pos = jnp.take_along_axis(csum, group[:, None], axis=1)[:, 0] - 1
    count = csum[-1]
    start = jnp.cumsum(count) - count
    return start[group] + pos, pos, count[:num_groups], start[:num_groups]


def _ep_body(x, idx, wts, w1, w2, w3, layer, post_args, *, act, E, ep, n, k, compute_dtype, impl, h_split,
             y_split, experts, tp_size, gather_x, post_fn):
    """Per device: x [n, K] (or, ``gather_x``, this DP group's rows and this device's column
    block), idx/wts [n, k] (this EP rank's tokens), this device's expert blocks. Returns
    float32 [n*ep, K] (or ``post_fn``'s result): every token, on every device."""
    if gather_x is not None:  # columns block ep_rank * tp + tp_rank of the group's rows
        whole = x.size * x.dtype.itemsize * gather_x["ep"] * gather_x["tp"]
        if gather_x["tp"] > 1 and gather_x["ep"] > 1 and whole <= _GATHER_WHOLE_BYTES:
            # few rows (a decode step): one gather of the whole group, then this rank's rows
            x = jax.lax.all_gather(x, ("ep", "tp"), axis=1, tiled=True)
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("ep") * n, n, 0)
        else:  # two collectives, each moving only what its receiver keeps
            if gather_x["tp"] > 1:
                x = jax.lax.all_gather(x, "tp", axis=1, tiled=True)  # column block ep_rank of the rows
            if gather_x["ep"] > 1:  # rows to their EP rank, column blocks from every EP rank
                x = jax.lax.all_to_all(x, "ep", 0, 1, tiled=True)
    out = _dispatch_combine(x, idx, wts, w1, w2, w3, layer, act=act, E=E, ep=ep, n=n, k=k,
                            compute_dtype=compute_dtype, impl=impl, h_split=h_split, y_split=y_split,
                            experts=experts, tp_size=tp_size)
    return out if post_fn is None else post_fn(out, *post_args)


def _dispatch_combine(x, idx, wts, w1, w2, w3, layer, *, act, E, ep, n, k, compute_dtype, impl, h_split, y_split,
                      experts, tp_size):
    """:func:`_ep_body` from this EP rank's whole token rows x [n, K]."""
    El = E // ep
    C = n * k  # capacity per (source, destination) = every pair this rank holds: exact
    i32 = jnp.int32
    K = x.shape[1]

    # ---- dispatch bookkeeping: (token, choice) pair p = t*k + j goes to EP rank dest[p], to
    # its local expert lid[p]; pairs are ordered by (dest, lid), so each receiver's block from
    # a source is sorted by local expert and the per-expert counts (sent with the sizes) say
    # which rows are whose: no per-row expert ids are exchanged
    flat = idx.reshape(-1)
    valid = flat >= 0  # padding tokens carry -1 and are never sent
    dest = jnp.where(valid, flat // El, ep)  # ep = "nowhere"
    lid = jnp.where(valid, flat % El, El).astype(i32)  # El = "no expert" sentinel
    key = jnp.where(valid, dest * El + lid, ep * El).astype(i32)
    slot, _, count_de, start_de = _group_slots(key, ep * El)
    count_de = count_de.reshape(ep, El)  # pairs for (destination, its local expert)
    count = count_de.sum(axis=1)  # pairs per destination
    start = start_de.reshape(ep, El)[:, 0]  # where destination d's pairs begin in the send list
    pos = slot - start[jnp.minimum(dest, ep - 1)]  # rank among the pairs for the same destination
    xs = x.astype(compute_dtype)[jnp.arange(n * k) // k]  # [n*k, K], pair order

    # ---- exchange. Row d of the sizes: (rows for d, where they start here, rows per local expert)
    sizes = jnp.concatenate([count[:, None], start[:, None], count_de], axis=1).astype(i32)  # [ep, 2 + El]
    if impl == "padded":  # every receiver ends with ep*C rows, block j (C rows) from EP rank j
        meta = jax.lax.all_to_all(sizes, EXPERTS, 0, 0, tiled=True)
        rcount_e = meta[:, 2:]  # from EP rank j: rows per local expert
        send_x = jnp.zeros((ep, C, K), xs.dtype).at[dest, pos].set(xs, mode="drop")
        recv_x = jax.lax.all_to_all(send_x, EXPERTS, 0, 0, tiled=True).reshape(ep * C, K)
        recv_l = _row_expert_ids(rcount_e, jnp.arange(ep, dtype=i32) * C, ep * C, El)
        y_recv = experts(recv_x, recv_l, w1, w2, w3, act, El, compute_dtype, h_split, layer)  # [ep*C, K_loc]
        K_loc = y_recv.shape[1]
        back = jax.lax.all_to_all(y_recv.reshape(ep, C, K_loc), EXPERTS, 0, 0, tiled=True)
        y_pairs = back[jnp.minimum(dest, ep - 1), pos]
    elif impl in ("ragged", "ragged-usual"):
        # every rank learns the whole routing (sizes of every source for every destination) in
        # one gather, so each sender knows where its rows land in a compact receive buffer, and
        # every rank takes the same branch: buffers of `cap` rows (twice the balanced load)
        # unless some receiver gets more, then the worst case (ep*C rows, block j from rank j)
        every = jax.lax.all_gather(sizes, EXPERTS, axis=0, tiled=False)  # [ep (source), ep (dest), 2 + El]
        me = jax.lax.axis_index(EXPERTS)
        meta = every[:, me]  # what each source sends here
        rcount, rstart, rcount_e = meta[:, 0], meta[:, 1], meta[:, 2:]
        counts = every[:, :, 0]  # [source, dest]
        cap = receive_capacity(n, k, ep)
        # x_sorted: pairs in destination order (rows start[d] .. start[d]+count[d] go to rank d)
        x_sorted = jnp.zeros_like(xs).at[slot].set(xs)

        def exchange(rows, out_off, roff):
            """Dispatch to `rows`-row receive buffers (this rank's rows land at out_off[d] of
            rank d; source j's rows sit at roff[j] here), experts, combine."""
            recv_x = _ragged_all_to_all(x_sorted, jnp.zeros((rows, K), xs.dtype), start, count, out_off, rcount,
                                        axis_name=EXPERTS)
            recv_l = _row_expert_ids(rcount_e, roff, rows, El)
            y_recv = experts(recv_x, recv_l, w1, w2, w3, act, El, compute_dtype, h_split, layer)  # [rows, K_loc]
            back = _ragged_all_to_all(y_recv, jnp.zeros((n * k, y_recv.shape[1]), y_recv.dtype), roff, rcount,
                                      rstart, count, axis_name=EXPERTS)
            return back[slot]

        def worst():  # block j of C rows from rank j
            return exchange(ep * C, jnp.full((ep,), me * C, i32), jnp.arange(ep, dtype=i32) * C)

        if cap < ep * C:
            offs = jnp.cumsum(counts, axis=0) - counts  # [source, dest]: source s's rows at dest d start here
            fits = jnp.max(jnp.sum(counts, axis=0)) <= cap  # the same on every rank
            usual = lambda: exchange(cap, offs[me], offs[:, me])  # noqa: E731
            y_pairs = usual() if impl == "ragged-usual" else jax.lax.cond(fits, usual, worst)
        else:
            y_pairs = worst()
        K_loc = y_pairs.shape[1]
    else:
        raise ValueError(impl)

    y_pairs = jnp.where(valid[:, None], y_pairs, 0.0).reshape(n, k, K_loc)
    out = jnp.einsum("njd,nj->nd", y_pairs, wts.astype(jnp.float32))  # [n, K_loc], fp32

    if not y_split:
        return jax.lax.all_gather(out, EXPERTS, axis=0, tiled=True)  # [n*ep, K]: all tokens
    # every (EP rank, tp rank)'s [n, K_loc] block in one gather (not tokens, then columns):
    # block e*tp + t holds EP rank e's tokens, columns t*K_loc .. (t+1)*K_loc
    tp = tp_size
    out = jax.lax.all_gather(out, EXPERTS + ("tp",), axis=0, tiled=False)  # [ep*tp, n, K_loc]
    return out.reshape(ep, tp, n, K_loc).transpose(0, 2, 1, 3).reshape(ep * n, tp * K_loc)


def receive_capacity(n: int, k: int, ep: int) -> int:
    """Receive rows of the ragged exchange's usual path: twice the balanced load (``n * k``
    pairs a rank receives on average), in whole 8-row tiles, at most the worst case ``ep * n *
    k`` (a step whose routing sends more to some rank takes the worst-case buffers)."""
    return min(ep * n * k, -(-2 * n * k // 8) * 8)


def _row_expert_ids(counts, offsets, rows: int, El: int):
    """The local expert of each of ``rows`` receive rows: source ``j``'s rows start at
    ``offsets[j]``, sorted by local expert, ``counts[j, e]`` of them for expert ``e``; rows in no
    source's range are unused (``El``). Segments are in increasing order of row (the block and
    the compact layouts both), so one ``searchsorted`` finds each row's."""
    seg_end = (offsets[:, None] + jnp.cumsum(counts, axis=1)).reshape(-1)  # [ep * El], non-decreasing
    seg_start = seg_end - counts.reshape(-1)
    i = jnp.arange(rows, dtype=seg_end.dtype)
    s = jnp.searchsorted(seg_end, i, side="right")  # the first segment ending after row i
    inside = (s < seg_end.shape[0]) & (seg_start[jnp.minimum(s, seg_end.shape[0] - 1)] <= i)
    return jnp.where(inside, s % El, El).astype(jnp.int32)


def _local_experts(xr, lr, w1, w2, w3, act, El, compute_dtype, h_split, layer=None):
    """Rows xr [R, K] with local expert ids lr [R] (El = none) through this device's experts,
    grouped by expert with ``ragged_dot``. Returns float32 [R, K_loc] (this device's columns
    of w2's output); rows without an expert hold junk that no source reads."""
    f32 = jnp.float32
    slot, _, sizes, _ = _group_slots(lr, El)
    xs = jnp.zeros(xr.shape, compute_dtype).at[slot].set(xr.astype(compute_dtype))
    W1 = jnp.swapaxes(_local_dense(w1, compute_dtype), 1, 2)  # [El, K, I_loc]
    W3 = jnp.swapaxes(_local_dense(w3, compute_dtype), 1, 2)
    W2 = jnp.swapaxes(_local_dense(w2, compute_dtype), 1, 2)  # [El, I, K_loc]
    g = jax.lax.ragged_dot(xs, W1, sizes, preferred_element_type=f32)
    u = jax.lax.ragged_dot(xs, W3, sizes, preferred_element_type=f32)
    h = act(g, u).astype(compute_dtype)  # [R, I_loc]
    if h_split:
        h = jax.lax.all_gather(h, "tp", axis=1, tiled=True)  # [R, I]: w2 splits K, not I
    y = jax.lax.ragged_dot(h, W2, sizes, preferred_element_type=f32)
    return y[slot]


def _row_tile(rows_per_group: int) -> int:
    """The kernel's row tile: the mean rows per local expert rounded up to a power of two, in
    [8, 128] (padding waste is at most a tile per visited expert)."""
    return int(min(128, max(8, 1 << max(0, rows_per_group - 1).bit_length())))


def _local_experts_gmm(xr, lr, w1, w2, w3, act, El, compute_dtype, h_split, layer, *, interpret=None,
                       cost_rows=None):
    """:func:`_local_experts` with the MXFP4 grouped-matmul kernel (``kernels.gmm_mxfp4``):
    the received rows, grouped by local expert, times only the visited experts' packed tiles
    -- never a dequantized copy of all ``El`` local experts (at K3 size that copy is tens of
    GB per MoE layer per device). Weights are this device's blocks of the stacks, ``[L, El,
    ...]`` (``layer``: the row, read in place) or ``[El, ...]``, repacked at load. w1 and w3
    run fused (``act`` inside the kernel); ``h`` is all-gathered over ``"tp"`` when w1/w3 split
    the intermediate dim, as in the reference."""
    from ..kernels.gmm_mxfp4 import default_blocks, mxfp4_gmm

    M, K = xr.shape
    slot, _, sizes, _ = _group_slots(lr, El)  # rows without an expert sort last: no group
    tm = _row_tile(M // max(1, El) + 1)
    Mp = -(-M // tm) * tm
    xs = jnp.zeros((Mp, K), compute_dtype).at[slot].set(xr.astype(compute_dtype))

    def flat(w):  # [L, El, n, c] -> [L*El, n, c]: indexed by layer * El + expert
        return tuple(a.reshape(-1, *a.shape[-2:]) for a in w)

    def gmm(h, w, **fused):
        p, s = flat(w)
        return mxfp4_gmm(h, p, s, sizes, layer, num_experts=El, blocks=default_blocks(h.shape[1], p.shape[1], tm),
                         interpret=interpret, cost_rows=cost_rows, **fused)

    h = gmm(xs, w1, up=flat(w3), act=act).astype(compute_dtype)  # [Mp, I_loc]
    if h_split:
        h = jax.lax.all_gather(h, "tp", axis=1, tiled=True)  # [Mp, I]: w2 splits K, not I
    y = gmm(h, w2)  # [Mp, K_loc] float32
    return y[slot]
