"""Kimi Delta Attention core: the recurrent step (decode) and the chunked form (prefill).

Both take already-gated inputs, per head:
  q, k  [..., T, H, dk]   L2-normalised (q also scaled by dk^-1/2)
  v     [..., T, H, dv]
  g     [..., T, H, dk]   per-channel log-decay (<= 0)
  beta  [..., T, H]
  state [..., H, dk, dv]  fp32, math layout S[k, v] (o = S^T q)
and run, per step: S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t.

A padded position is made a no-op by the caller with g = 0 and beta = 0 (no decay, no
write), so the state after a padded row equals the state after its last real token.

The chunked form (per chunk of C tokens, cumulative log-decay G within the chunk):
  A[t, j]  = beta_t sum_d k_t[d] k_j[d] exp(G_t[d] - G_j[d])   (j < t)
  U        = (I + A)^-1 (beta V - beta (K * exp(G)) S0)          (the values actually written)
  O[t]     = S0^T (q_t * exp(G_t)) + sum_{j<=t} (sum_d q_t k_j exp(G_t - G_j)) U_j
  S_C      = exp(G_C) * S0 + sum_j (k_j * exp(G_C - G_j)) U_j^T
Pairwise decays are formed as exp(G_t - G_j) with j <= t only (never exp(G_t)/exp(G_j)),
so nothing overflows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def kda_recurrent(q, k, v, g, beta, state):
    """Exact sequential recurrence. Shapes as in the module docstring (batch dims first)."""
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))

    def step(S, xs):
        qt, kt, vt, gt, bt = xs  # [..., H, dk], ..., [..., H]
        S = S * jnp.exp(gt)[..., :, None]
        pred = jnp.einsum("...hk,...hkv->...hv", kt, S)
        delta = (vt - pred) * bt[..., None]
        S = S + kt[..., :, None] * delta[..., None, :]
        ot = jnp.einsum("...hk,...hkv->...hv", qt, S)
        return S, ot

    T_axis = q.ndim - 3
    xs = tuple(jnp.moveaxis(x, T_axis, 0) for x in (q, k, v, g, beta))
    S, o = jax.lax.scan(step, state.astype(f32), xs)
    return jnp.moveaxis(o, 0, T_axis), S


def kda_decode_step(q, k, v, g, beta, state):
    """One token per row, exact: q, k, g [..., H, dk], v [..., H, dv], beta [..., H], state
    [..., H, dk, dv] -> (o [..., H, dv], new state).

    The same update as :func:`kda_recurrent`, rearranged so the state is read once by one
    batched matmul (``[k e^g ; q e^g] . S``) and written once: ``o = q . S'`` is
    ``(q e^g) . S + (q . k) delta``. Written as the recurrence, XLA fuses the prediction
    ``k . S`` (and the producers of ``k`` and ``g``) into the elementwise state update and
    recomputes them for every state element (0.2 ms per layer at one row of 8 x 64 x 64
    heads on the CPU, against 0.03 ms for reading and writing the state)."""
    f32 = jnp.float32
    q, k, v, g, beta, S = (x.astype(f32) for x in (q, k, v, g, beta, state))
    eg = jnp.exp(g)
    r = jnp.einsum("...jk,...kv->...jv", jnp.stack([k * eg, q * eg], axis=-2), S)  # [..., H, 2, dv]
    delta = (v - r[..., 0, :]) * beta[..., None]
    o = r[..., 1, :] + jnp.sum(q * k, axis=-1)[..., None] * delta
    # k (x) delta as a matmul over a padded pair: its operands are materialised, so the
    # producers of k and delta (the short conv, the key norm) run once, not once per state
    # element as they would fused into an elementwise outer product
    kz = jnp.stack([k, jnp.zeros_like(k)], axis=-2)  # [..., H, 2, dk]
    dz = jnp.stack([delta, jnp.zeros_like(delta)], axis=-2)  # [..., H, 2, dv]
    return o, S * eg[..., None] + jnp.einsum("...jk,...jv->...kv", kz, dz)


def unit_lower_solve(A, *rhs):
    """Solve ``(I + A) X = R`` for each ``R`` in ``rhs`` ([..., C, d]), A [..., C, C] strictly lower.

    Forward substitution, one row per loop step (row t needs rows < t, which are final by
    then). Written out instead of ``solve_triangular``: on CPU that lowers to LAPACK trsm,
    whose batched FFI kernel splits work onto the shared intra-op thread pool and blocks on
    it — with several virtual devices running the step at once every pool thread ended up
    waiting and the step never finished (seen with 32 KDA heads per chunk on a 2-core box).
    """
    R = jnp.concatenate(rhs, axis=-1)
    C = A.shape[-1]

    def row(t, X):
        xt = R[..., t, :] - jnp.einsum("...j,...jd->...d", A[..., t, :], X)
        return X.at[..., t, :].set(xt)

    X = jax.lax.fori_loop(1, C, row, R)
    out, o = [], 0
    for r in rhs:
        out.append(X[..., o : o + r.shape[-1]])
        o += r.shape[-1]
    return out


def blocked_unit_lower_solve(A, *rhs, block: int = 16):
    """``unit_lower_solve``'s contract, by blocks: the inverses of the C / block diagonal
    blocks by forward substitution, all blocks at once (block - 1 loop steps instead of C - 1),
    then block forward substitution with matmuls. Falls back to ``unit_lower_solve`` when C is
    not a multiple of ``block`` larger than it. Measured against the row loop (and against
    inverting the blocks as a Neumann product, which lost 3 digits when A is far from 0) in
    kernels/kda_ragged.py.
    """
    C = A.shape[-1]
    if C % block or C <= block:
        return unit_lower_solve(A, *rhs)
    R = jnp.concatenate(rhs, axis=-1)
    sl = [slice(i * block, (i + 1) * block) for i in range(C // block)]
    D = jnp.stack([A[..., s, s] for s in sl], axis=-3)  # [..., nb, block, block]
    (inv,) = unit_lower_solve(D, jnp.broadcast_to(jnp.eye(block, dtype=A.dtype), D.shape))
    X = []
    for i, s in enumerate(sl):
        r = R[..., s, :]
        if i:
            r = r - A[..., s, : i * block] @ jnp.concatenate(X, axis=-2)
        X.append(inv[..., i, :, :] @ r)
    X = jnp.concatenate(X, axis=-2)
    out, o = [], 0
    for r in rhs:
        out.append(X[..., o : o + r.shape[-1]])
        o += r.shape[-1]
    return out


def decay_scores(q, k, G, sub: int | None = None):
    """Akk[t, j] = sum_d k_t k_j e^{G_t - G_j} and Aqk[t, j] = sum_d q_t k_j e^{G_t - G_j} for
    j <= t (0 above the diagonal); q, k, G [..., C, dk] -> two [..., C, C].

    sub=None: from the pairwise decay tensor [..., C, C, dk], masked before the exp. With a
    sub-block size dividing C: pairs inside a sub-block the same way ([..., C, sub, dk]), pairs
    across sub-blocks as matmuls through the cumulative decay at the token r just before t's
    sub-block: e^{G_t - G_j} = e^{G_t - G_r} e^{G_r - G_j}, both exponents <= 0 (j <= r <= t),
    so nothing overflows. About 3x faster per 64-token chunk on CPU (H=8, dk=64).
    """
    C = q.shape[-2]
    if sub is None or sub >= C or C % sub:
        idx = jnp.arange(C)
        causal = idx[:, None] >= idx[None, :]
        diff = G[..., :, None, :] - G[..., None, :, :]
        P = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))  # [..., C(t), C(j), dk]
        return (jnp.einsum("...td,...jd,...tjd->...tj", k, k, P),
                jnp.einsum("...td,...jd,...tjd->...tj", q, k, P))
    nb, dk = C // sub, G.shape[-1]
    lead = G.shape[:-2]
    Gb, kb, qb = (x.reshape(*lead, nb, sub, dk) for x in (G, k, q))
    idx = jnp.arange(sub)
    causal = idx[:, None] >= idx[None, :]
    diff = Gb[..., :, None, :] - Gb[..., None, :, :]
    P = jnp.exp(jnp.where(causal[:, :, None], diff, -jnp.inf))  # [..., nb, sub, sub, dk]
    kk_in = jnp.einsum("...td,...jd,...tjd->...tj", kb, kb, P)
    qk_in = jnp.einsum("...td,...jd,...tjd->...tj", qb, kb, P)
    # G_r for each sub-block b: the last token of block b-1 (0 before the chunk)
    Gr = jnp.concatenate([jnp.zeros_like(Gb[..., :1, -1, :]), Gb[..., :-1, -1, :]], axis=-2)  # [..., nb, dk]
    dec_t = jnp.exp(Gb - Gr[..., None, :])  # t in block b
    before = jnp.arange(C)[None, :] < (jnp.arange(nb) * sub)[:, None]  # [nb, C(j)]: j <= r_b
    dec_j = jnp.exp(jnp.where(before[:, :, None], Gr[..., :, None, :] - G[..., None, :, :], -jnp.inf))
    kj = k[..., None, :, :] * dec_j  # [..., nb, C(j), dk]
    kk_x = jnp.einsum("...btd,...bjd->...btj", kb * dec_t, kj).reshape(*lead, C, C)
    qk_x = jnp.einsum("...btd,...bjd->...btj", qb * dec_t, kj).reshape(*lead, C, C)
    diag = jnp.eye(nb, dtype=G.dtype)  # place the in-block parts on the block diagonal
    place = lambda x: jnp.einsum("...bts,bc->...btcs", x, diag).reshape(*lead, C, C)
    return kk_x + place(kk_in), qk_x + place(qk_in)


def kda_chunk(q, k, v, beta, G, S, solve=unit_lower_solve, sub: int | None = None):
    """One chunk of the chunked form, batched over leading dims.

    q, k [..., C, dk]; v [..., C, dv]; beta [..., C]; G [..., C, dk] the inclusive cumulative
    log-decay within the chunk; S [..., dk, dv] the state before the chunk. ``solve`` solves
    ``(I + A) X = R`` (``unit_lower_solve``'s contract); ``sub`` as in ``decay_scores``.
    Returns (o [..., C, dv], the state after the chunk, U [..., C, dv] the values actually
    written). Positions with g = 0 and beta = 0 at the end of the chunk are no-ops for the state.
    """
    C = q.shape[-2]
    idx = jnp.arange(C)
    strict = idx[:, None] > idx[None, :]
    Akk, Aqk = decay_scores(q, k, G, sub)
    A = jnp.where(strict, Akk * beta[..., :, None], 0.0)
    rhs_v = v * beta[..., None]
    rhs_k = k * jnp.exp(G) * beta[..., None]
    u0, w = solve(A, rhs_v, rhs_k)
    U = u0 - jnp.einsum("...td,...dv->...tv", w, S)
    o = jnp.einsum("...td,...dv->...tv", q * jnp.exp(G), S) + jnp.einsum("...tj,...jv->...tv", Aqk, U)
    Glast = G[..., -1:, :]  # [..., 1, dk]
    kdec = k * jnp.exp(Glast - G)
    S = S * jnp.exp(Glast[..., 0, :])[..., None] + jnp.einsum("...jd,...jv->...dv", kdec, U)
    return o, S, U


def kda_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked KDA; same contract as kda_recurrent. Inputs [B, T, H, *]; state [B, H, dk, dv]."""
    f32 = jnp.float32
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    C = min(chunk_size, T)
    pad = (-T) % C
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if pad:
        padw = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = (padw(x) for x in (q, k, v, g, beta))
    N = (T + pad) // C

    # [N, B, H, C, *]
    def chunks(x):
        x = x.reshape(B, N, C, H, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))
    G = jnp.cumsum(gc, axis=-2)  # [N,B,H,C,dk]

    def step(S, xs):
        qi, ki, vi, bi, Gi = xs  # [B,H,C,dk], ..., [B,H,C]
        o, S, _ = kda_chunk(qi, ki, vi, bi, Gi, S)
        return S, o

    S, o = jax.lax.scan(step, state.astype(f32), (qc, kc, vc, bc, G))
    # o: [N, B, H, C, dv] -> [B, T, H, dv]
    o = jnp.moveaxis(o, 0, 1)  # [B,N,H,C,dv]
    o = jnp.moveaxis(o, 2, 3).reshape(B, N * C, H, dv)[:, :T]
    return o, S
