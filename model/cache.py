"""The decode-time state the model reads and returns, and the per-step batch description.

Layouts (allocated here; the engine's ``CacheManager`` holds the live arrays as ``device_cache``):
  kda_state [nK, slots, H, dk, dv] float32   recurrent state per KDA layer and slot, S[k, v]
  kda_conv  [nK, slots, W-1, 3P]   float32   last W-1 raw q|k|v projections, oldest first;
                                             channels q|k|v, or rank-major when the KDA heads
                                             are split over G ranks (``conv_rank_major``)
  mla_kv    [nM, pages, page_size, Wp] (model dtype)   latent rows: kv_lora_rank + rope, zeros
                                                        up to Wp = cfg.mla_pool_width; nM counts
                                                        the target's MLA layers, then a draft
                                                        model's (``cfg.draft_kv_layers``)

A running sequence owns one slot (``slot_ids``) and the pages listed in its row of
``page_table``. A row with ``start_pos == 0`` starts from a zero KDA state and conv window
regardless of what its slot held, so slots need no reset between requests; a row with
``start_pos > 0`` continues from its slot (after a chunk, or a restored prefix snapshot). Rows of a padded batch that carry no tokens (``seq_lens == 0``) leave their
slot untouched, but should still point at a slot no live request owns (the engine keeps a
scratch slot for this) because scatters with duplicate indices have no defined order.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    kda_state: jax.Array
    kda_conv: jax.Array
    mla_kv: jax.Array

    @property
    def page_size(self) -> int:
        return self.mla_kv.shape[2]

    @property
    def num_pages(self) -> int:
        return self.mla_kv.shape[1]

    @property
    def num_slots(self) -> int:
        return self.kda_state.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """One model step: B rows of up to T new tokens each (right-padded)."""

    input_ids: jax.Array  # [B, T] int32
    start_pos: jax.Array  # [B] tokens already in the cache before this step
    seq_lens: jax.Array  # [B] valid new tokens in this row (0..T)
    slot_ids: jax.Array  # [B] KDA state slot of the row
    page_table: jax.Array  # [B, max_pages] MLA pages of the row, in order


def _swap_channel_blocks(x, outer: int, inner: int):
    """The last axis read as ``[outer, inner, rest]`` blocks, rewritten ``[inner, outer, rest]``."""
    v = x.reshape(x.shape[:-1] + (outer, inner, x.shape[-1] // (outer * inner)))
    return jnp.swapaxes(v, -3, -2).reshape(x.shape)


def conv_rank_major(x, groups: int):
    """Conv-window channels (last axis, ``3P``) from the logical order ``q | k | v`` to the
    rank-major order of a pool whose KDA heads are split over ``groups`` ranks: block ``j``
    holds ``q_j | k_j | v_j`` (rank ``j``'s heads of each), so a rank's shard of the channel
    axis is exactly what its KDA kernels read. ``groups == 1``: unchanged."""
    return x if groups == 1 else _swap_channel_blocks(x, 3, groups)


def conv_logical(x, groups: int):
    """The inverse of :func:`conv_rank_major`: rank-major channels back to ``q | k | v``."""
    return x if groups == 1 else _swap_channel_blocks(x, groups, 3)


def conv_groups_of(conv_pool) -> int:
    """How many channel blocks a placed conv pool's channel axis is split into (its layout
    is rank-major over them: :func:`conv_rank_major`); 1 for a whole-channel pool."""
    sharding = getattr(conv_pool, "sharding", None)
    if sharding is None or not hasattr(sharding, "shard_shape"):
        return 1
    C = conv_pool.shape[-1]
    return C // sharding.shard_shape(conv_pool.shape)[-1]


def cache_shapes(cfg, num_slots: int, num_pages: int, page_size: int, dtype) -> dict:
    nK, nM = len(cfg.kda_layers), len(cfg.mla_layers) + getattr(cfg, "draft_kv_layers", 0)
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    return {
        "kda_state": ((nK, num_slots, H, dk, dk), jnp.float32),
        "kda_conv": ((nK, num_slots, cfg.conv_kernel_size - 1, 3 * H * dk), jnp.float32),
        "mla_kv": ((nM, num_pages, page_size, cfg.mla_pool_width), jnp.dtype(dtype)),
    }


def allocate_cache(cfg, num_slots: int, num_pages: int, page_size: int, dtype=jnp.float32) -> Cache:
    shapes = cache_shapes(cfg, num_slots, num_pages, page_size, dtype)
    return Cache(**{k: jnp.zeros(s, d) for k, (s, d) in shapes.items()})


def cache_bytes(cfg, num_slots: int, num_pages: int, page_size: int, dtype) -> int:
    return sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in cache_shapes(cfg, num_slots, num_pages, page_size, dtype).values())


def make_batch(input_ids, start_pos, seq_lens, slot_ids, page_table) -> StepBatch:
    as32 = lambda a: jnp.asarray(np.asarray(a, dtype=np.int32))
    return StepBatch(as32(input_ids), as32(start_pos), as32(seq_lens), as32(slot_ids), as32(page_table))
