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
    idx = jnp.arange(C)
    causal = idx[:, None] >= idx[None, :]  # j <= t
    strict = idx[:, None] > idx[None, :]

    def pairwise(Gi):  # exp(G_t - G_j) for j <= t, else 0:  [.., C(t), C(j), dk]
        diff = Gi[..., :, None, :] - Gi[..., None, :, :]
        diff = jnp.where(causal[:, :, None], diff, -jnp.inf)
        return jnp.exp(diff)

    def step(S, xs):
        qi, ki, vi, bi, Gi = xs  # [B,H,C,dk], ..., [B,H,C]
        P = pairwise(Gi)
        A = jnp.einsum("bhtd,bhjd,bhtjd->bhtj", ki, ki, P) * bi[..., :, None]
        A = jnp.where(strict, A, 0.0)
        rhs_v = vi * bi[..., None]
        rhs_k = ki * jnp.exp(Gi) * bi[..., None]
        u0, w = unit_lower_solve(A, rhs_v, rhs_k)
        U = u0 - jnp.einsum("bhtd,bhdv->bhtv", w, S)
        Aqk = jnp.einsum("bhtd,bhjd,bhtjd->bhtj", qi, ki, P)  # zero above the diagonal via P
        o = jnp.einsum("bhtd,bhdv->bhtv", qi * jnp.exp(Gi), S) + jnp.einsum("bhtj,bhjv->bhtv", Aqk, U)
        Glast = Gi[..., -1:, :]  # [B,H,1,dk]
        kdec = ki * jnp.exp(Glast - Gi)
        S = S * jnp.exp(Glast[..., 0, :])[..., None] + jnp.einsum("bhjd,bhjv->bhdv", kdec, U)
        return S, o

    S, o = jax.lax.scan(step, state.astype(f32), (qc, kc, vc, bc, G))
    # o: [N, B, H, C, dv] -> [B, T, H, dv]
    o = jnp.moveaxis(o, 0, 1)  # [B,N,H,C,dv]
    o = jnp.moveaxis(o, 2, 3).reshape(B, N * C, H, dv)[:, :T]
    return o, S
