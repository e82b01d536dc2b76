"""The decode-time state the model reads and returns, and the per-step batch description.

Layouts (allocated here; the engine's ``CacheManager`` holds the live arrays as ``device_cache``):
  kda_state [nK, slots, H, dk, dv] float32   recurrent state per KDA layer and slot, S[k, v]
  kda_conv  [nK, slots, G*B, dk] float32     last W-1 raw q|k|v projections, oldest first,
                                             as rows of one head's ``dk`` values: row
                                             ``(g, t, part, h)`` when the KDA heads are split
                                             over G ranks (G = 1 when whole), so a rank's block
                                             of B rows is its heads' windows, B = (W-1)*3H/G
                                             rounded up to 8 when G > 1 (``conv_pool_rows``;
                                             the logical window is ``[W-1, 3P]``, ``q | k | v``)
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


def conv_block_rows(window: int, heads: int, groups: int = 1) -> int:
    """Rows of one rank's block of the conv pool (:func:`conv_pool_rows`): its ``heads //
    groups`` heads' ``window * 3`` rows each; with the heads split over ranks (``groups > 1``)
    rounded up to whole TPU tiles of 8 rows. A block of 27 rows (3 heads a device, K3 under
    v7-32-decode) made XLA:TPU give the pool a slot-minor layout and copy the whole pool in
    and out around the step's layer loop (docs/compile.md); the padding rows are never read."""
    rows = window * 3 * (heads // groups)
    return rows if groups == 1 else -(-rows // 8) * 8


def conv_pool_rows(x, groups: int, head_dim: int):
    """Logical conv windows ``[..., W-1, 3P]`` (channels ``q | k | v``, heads in order) as the
    conv pool stores them, ``[..., groups * B, head_dim]`` with ``Hl`` heads a rank and ``B =
    conv_block_rows(W-1, groups * Hl, groups)`` rows a block: row ``(g, t, part, h)`` holds
    head ``g * Hl + h``'s ``head_dim`` values of window position ``t`` of ``part`` (q, k, v),
    the block's last ``B - (W-1) * 3 * Hl`` rows zeros. Rank ``g``'s block of rows is then the
    row layout the KDA kernels read (``kernels/kda_decode_kernel.py``) for its heads, and the
    pool's default TPU layout is row-major (a ``W-1``-long second-minor dim would be padded to
    8 sublanes, so XLA picked a slot-major layout and copied the whole pool in and out around
    every kernel call)."""
    *lead, W1, C = x.shape
    Hl = C // (3 * groups * head_dim)
    v = jnp.reshape(x, (*lead, W1, 3, groups, Hl, head_dim))
    v = jnp.reshape(jnp.moveaxis(v, -3, -5), (*lead, groups, W1 * 3 * Hl, head_dim))
    pad = conv_block_rows(W1, groups * Hl, groups) - W1 * 3 * Hl
    if pad:
        v = jnp.pad(v, [(0, 0)] * (len(lead) + 1) + [(0, pad), (0, 0)])
    return jnp.reshape(v, (*lead, groups * (W1 * 3 * Hl + pad), head_dim))


def conv_pool_logical(y, groups: int, window: int, heads: int):
    """The inverse of :func:`conv_pool_rows`: pool rows back to ``[..., window, 3P]``
    (``window`` = W-1, ``heads`` the KDA heads of the whole pool)."""
    *lead, rows, d = y.shape
    Hl = heads // groups
    v = jnp.reshape(y, (*lead, groups, rows // groups, d))[..., :window * 3 * Hl, :]
    v = jnp.reshape(v, (*lead, groups, window, 3, Hl, d))
    return jnp.reshape(jnp.moveaxis(v, -5, -3), (*lead, window, 3 * groups * Hl * d))


def conv_window_shape(cfg, num_layers: int) -> tuple:
    """``(nK, W-1, 3P)``: one slot's logical conv windows (what leaves the device: prefix
    offload, P/D handoffs) of a model with ``num_layers`` KDA layers."""
    return (num_layers, cfg.conv_kernel_size - 1, 3 * cfg.kda_num_heads * cfg.kda_head_dim)


def conv_groups_of(conv_pool) -> int:
    """How many rank blocks a placed conv pool's rows are split into (:func:`conv_pool_rows`);
    1 for a pool whose rows are whole on every device."""
    sharding = getattr(conv_pool, "sharding", None)
    if sharding is None or not hasattr(sharding, "shard_shape"):
        return 1
    rows = conv_pool.shape[-2]
    return rows // sharding.shard_shape(conv_pool.shape)[-2]


def cache_shapes(cfg, num_slots: int, num_pages: int, page_size: int, dtype, conv_groups: int = 1) -> dict:
    """Shape and dtype of each pool; ``conv_groups``: the rank blocks of the conv pool's rows
    (the KDA heads split over that many devices, ``StepParallel.conv_groups``)."""
    nK, nM = len(cfg.kda_layers), len(cfg.mla_layers) + getattr(cfg, "draft_kv_layers", 0)
    H, dk = cfg.kda_num_heads, cfg.kda_head_dim
    rows = conv_groups * conv_block_rows(cfg.conv_kernel_size - 1, H, conv_groups)
    return {
        "kda_state": ((nK, num_slots, H, dk, dk), jnp.float32),
        "kda_conv": ((nK, num_slots, rows, dk), jnp.float32),
        "mla_kv": ((nM, num_pages, page_size, cfg.mla_pool_width), jnp.dtype(dtype)),
    }


def allocate_cache(cfg, num_slots: int, num_pages: int, page_size: int, dtype=jnp.float32,
                   conv_groups: int = 1) -> Cache:
    shapes = cache_shapes(cfg, num_slots, num_pages, page_size, dtype, conv_groups)
    return Cache(**{k: jnp.zeros(s, d) for k, (s, d) in shapes.items()})


def cache_bytes(cfg, num_slots: int, num_pages: int, page_size: int, dtype, conv_groups: int = 1) -> int:
    shapes = cache_shapes(cfg, num_slots, num_pages, page_size, dtype, conv_groups)
    return sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in shapes.values())


def make_batch(input_ids, start_pos, seq_lens, slot_ids, page_table) -> StepBatch:
    as32 = lambda a: jnp.asarray(np.asarray(a, dtype=np.int32))
    return StepBatch(as32(input_ids), as32(start_pos), as32(seq_lens), as32(slot_ids), as32(page_table))
