"""MLA attention over a paged latent cache, in the absorbed form.

The cache holds, per token, one row ``[c (kv_lora_rank) | k_r (rope dims)]`` where ``c`` is the
normed latent. Instead of expanding every cached row into per-head keys and values, the
query is absorbed into latent space: ``q_lat_h = W_UK_h^T q_nope_h`` so the score of head h
against token s is ``q_lat_h . c_s + q_r_h . k_r_s``, and the output in latent space
``sum_s a_hs c_s`` is mapped up per head by ``W_UV_h`` afterwards (by the caller).

Pages: ``kv_pages [num_pages, page_size, W]``; ``page_table [B, max_pages]`` lists a row's
pages in order, so token position p of row b lives in page ``page_table[b, p // page_size]``
at offset ``p % page_size``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv_pages(kv_pages, rows, page_table, positions, valid, layer=None):
    """Scatter new cache rows. rows [B,T,W]; positions [B,T] absolute; valid [B,T] bool.

    Invalid (padding) rows are dropped, never written, so no page outside a row's own table
    is touched. With ``layer``, ``kv_pages`` is the stacked pool ``[L, pages, page_size, W]``
    and only that layer's pages are written (in place when the pool is donated).
    """
    num_pages, page_size, W = kv_pages.shape[-3:]
    page_idx = jnp.take_along_axis(page_table, jnp.clip(positions // page_size, 0, page_table.shape[1] - 1), axis=1)
    page_idx = jnp.where(valid, page_idx, num_pages)  # out of range -> dropped
    off = positions % page_size
    if layer is not None:
        return kv_pages.at[layer, page_idx, off].set(rows.astype(kv_pages.dtype), mode="drop")
    return kv_pages.at[page_idx, off].set(rows.astype(kv_pages.dtype), mode="drop")


def mla_paged_attention(q_lat, q_rope, kv_pages, page_table, q_positions, kv_lens, scale, latent_dim, layer=None,
                        page_ordinals=None, return_lse=False):
    """Reference paged MLA attention (absorbed form).

    q_lat   [B, T, H, latent_dim]   (q_nope absorbed through W_UK)
    q_rope  [B, T, H, R]
    kv_pages [num_pages, page_size, latent_dim + R]
    page_table [B, J] int32; q_positions [B, T] absolute positions of the queries;
    kv_lens [B]: number of valid cached tokens of each row (including this step's).
    ``page_ordinals`` [J] or [B, J] (default ``0..J-1``): which page of the sequence each table
    column is — under decode context parallelism a rank holds only every N-th page of a
    sequence and attends over those alone. A column whose page id is out of range
    (``>= num_pages`` or negative) is skipped.
    Returns out_lat [B, T, H, latent_dim] in float32 (softmax and sums in fp32), and with
    ``return_lse`` also the log-sum-exp of the scores [B, T, H] (``-inf`` where the query saw
    no key here): what :func:`merge_partials` needs to combine ranks exactly.
    """
    B, T, H, _ = q_lat.shape
    num_pages, page_size, W = kv_pages.shape[-3:]
    J = page_table.shape[1]
    ordinals = jnp.arange(J, dtype=jnp.int32) if page_ordinals is None else page_ordinals
    ordinals = jnp.broadcast_to(ordinals, (B, J)) if ordinals.ndim == 2 else jnp.broadcast_to(ordinals[None], (1, J))
    present = (page_table >= 0) & (page_table < num_pages)  # [B, J]
    ids = jnp.clip(page_table, 0, num_pages - 1)
    kv = kv_pages[ids] if layer is None else kv_pages[layer, ids]  # [B, J, page_size, W]
    S = J * page_size
    kv = kv.reshape(B, S, W).astype(jnp.float32)
    c, kr = kv[..., :latent_dim], kv[..., latent_dim:latent_dim + q_rope.shape[-1]]  # zeros may follow
    scores = jnp.einsum("bthl,bsl->bths", q_lat.astype(jnp.float32), c) + jnp.einsum(
        "bthr,bsr->bths", q_rope.astype(jnp.float32), kr
    )
    scores = scores * scale
    kpos = (ordinals[..., None] * page_size + jnp.arange(page_size)).reshape(-1, S)[:, None, :]  # [B|1, 1, S]
    kpresent = jnp.repeat(present, page_size, axis=1)  # [B, S]
    mask = ((kpos <= q_positions[:, :, None]) & (kpos < kv_lens[:, None, None]) & kpresent[:, None, :])
    scores = jnp.where(mask[:, :, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully-masked (padding) queries give zeros, not NaN
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bths,bsl->bthl", p / jnp.where(denom > 0, denom, 1.0), c)
    if not return_lse:
        return out
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0)), -jnp.inf)
    return out, lse


def merge_partials(outs, lses):
    """Exact online-softmax merge of partial attentions over disjoint key sets.

    outs [N, ..., D] (each normalised over its own keys), lses [N, ...]; returns [..., D].
    ``sum_i exp(lse_i - M) out_i / sum_i exp(lse_i - M)`` with ``M = max_i lse_i``; parts
    with ``lse = -inf`` (no keys) weigh 0; a query with no keys anywhere gives zeros.
    """
    M = jnp.max(lses, axis=0)
    M = jnp.where(jnp.isfinite(M), M, 0.0)
    w = jnp.exp(lses - M)
    den = jnp.sum(w, axis=0)
    return jnp.sum(outs * w[..., None], axis=0) / jnp.where(den > 0, den, 1.0)[..., None]
