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


def mla_paged_attention(q_lat, q_rope, kv_pages, page_table, q_positions, kv_lens, scale, latent_dim, layer=None):
    """Reference paged MLA attention (absorbed form).

    q_lat   [B, T, H, latent_dim]   (q_nope absorbed through W_UK)
    q_rope  [B, T, H, R]
    kv_pages [num_pages, page_size, latent_dim + R]
    page_table [B, max_pages] int32; q_positions [B, T] absolute positions of the queries;
    kv_lens [B]: number of valid cached tokens of each row (including this step's).
    Returns out_lat [B, T, H, latent_dim] in float32 (softmax and sums in fp32).
    """
    B, T, H, _ = q_lat.shape
    num_pages, page_size, W = kv_pages.shape[-3:]
    kv = kv_pages[page_table] if layer is None else kv_pages[layer, page_table]  # [B, max_pages, page_size, W]
    S = kv.shape[1] * page_size
    kv = kv.reshape(B, S, W).astype(jnp.float32)
    c, kr = kv[..., :latent_dim], kv[..., latent_dim:]
    scores = jnp.einsum("bthl,bsl->bths", q_lat.astype(jnp.float32), c) + jnp.einsum(
        "bthr,bsr->bths", q_rope.astype(jnp.float32), kr
    )
    scores = scores * scale
    kpos = jnp.arange(S)
    mask = (kpos[None, None, :] <= q_positions[:, :, None]) & (kpos[None, None, :] < kv_lens[:, None, None])
    scores = jnp.where(mask[:, :, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # fully-masked (padding) queries give zeros, not NaN
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("bths,bsl->bthl", p, c)
