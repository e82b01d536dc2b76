"""The flattened step: what one model call computes, as token arrays and row arrays.

A step is ``T`` tokens (``T`` a static bucket) that belong to ``R`` rows (``R`` static: the
engine's ``max_num_seqs``, per attention-DP group). Row ``r``'s tokens are contiguous,
``[cu_q_lens[r], cu_q_lens[r + 1])``; rows without tokens (``q_lens == 0``) come last and
tokens past ``cu_q_lens[R]`` are padding (``tok_row == -1``). Per-token layers
(norms, projections, AttnRes, MoE, LM head) see ``[T, D]``; only KDA and MLA look at rows.

KDA state is read from ``read_slot`` and written to ``write_slot``: they differ on a prefix
hit (the request resumes from a snapshot slot without copying it first); a ``fresh`` row
starts from an empty state and conv window whatever its read slot holds; a row without
tokens writes nothing (its write slot is out of range, so the scatter drops it).

Snapshots (prefix caching): entry ``s`` asks for the KDA state and conv window of row
``snap_row[s]`` after its first ``snap_len[s]`` tokens of this step, written to slot
``snap_slot[s]``; unused entries have ``snap_row == -1`` and an out-of-range slot.

Logits are computed at ``logits_idx`` only (each row's last token; ``-1`` for none; ``[R, n]``
under speculative decoding: every verify position of a decode row).

Speculative decoding (``docs/speculative.md``): every row has an explicit kind, ``decode``; a
decode row carries its last token and ``q_len - 1`` drafts (0 allowed), whatever its length it
takes the decode path. Its first token is committed like plain decoding, its drafts are verified
from there and journaled (``kernels/kda_spec.py``) in entry ``jrow`` of the step's journal; the
next step first folds the ``fold_len`` accepted ones into the row's state and conv window. MLA
writes every position; a rejected draft's row is overwritten later (rollback is the length).

Attention DP (``dp`` groups): the token axis is ``dp`` blocks of ``T / dp`` tokens and the row
axis ``dp`` blocks of ``R / dp`` rows, group ``g``'s in block ``g``; ``cu_q_lens`` is ``dp``
blocks of ``R / dp + 1`` and ``tok_row``, ``cu_q_lens``, ``snap_row`` count *within* the
group's block (so the ragged ops run per group, unchanged, inside a ``shard_map``). Slots,
pages and ``logits_idx`` are global.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FlatBatch:
    ids: jax.Array  # [T] token ids
    pos: jax.Array  # [T] absolute position of each token in its sequence
    tok_row: jax.Array  # [T] row of each token (-1: padding)
    cu_q_lens: jax.Array  # [R + 1]
    start_pos: jax.Array  # [R] tokens of the row in the cache before this step
    q_lens: jax.Array  # [R] tokens of the row in this step
    read_slot: jax.Array  # [R] KDA slot the row's state is read from
    write_slot: jax.Array  # [R] KDA slot the row's state is written to (out of range: dropped)
    fresh: jax.Array  # [R] bool: start from an empty KDA state / conv window
    page_table: jax.Array  # [R, P] MLA pages of the row, in order
    logits_idx: jax.Array  # [R] token whose logits the row samples from (-1: none)
    snap_row: jax.Array  # [NS]
    snap_len: jax.Array  # [NS]
    snap_slot: jax.Array  # [NS]
    # the row's kind, explicit (speculative decoding): a decode row is its last token plus
    # q_len - 1 drafts; None: rows of one token decode (no drafts anywhere)
    decode: jax.Array | None = None  # [R] bool
    fold_len: jax.Array | None = None  # [R] journaled drafts to commit before the step (accepted last step)
    jrow: jax.Array | None = None  # [R] the row's journal entry (read by the fold, written by the verify)

    @property
    def num_rows(self) -> int:
        return self.q_lens.shape[0]

    @property
    def valid(self) -> jax.Array:
        return self.tok_row >= 0

    @property
    def kv_lens(self) -> jax.Array:
        return self.start_pos + self.q_lens


def flatten_padded(batch, num_slots: int, dp: int = 1):
    """A padded ``[B, T]`` :class:`~model.cache.StepBatch` as a :class:`FlatBatch` of ``B * T``
    tokens (inside jit: the lengths may be traced), and the index ``[B, T]`` of each padded
    position in the flat axis (``-1`` for padding) to map per-token results back. With ``dp``
    attention-DP groups, rows ``[g * B/dp, (g + 1) * B/dp)`` are group ``g``'s."""
    ids = batch.input_ids
    B, Tp = ids.shape
    if B % dp:
        raise ValueError(f"{B} rows do not split over dp={dp} attention groups")
    Bg, T = B // dp, B * Tp
    lens = batch.seq_lens.astype(jnp.int32)
    glens = lens.reshape(dp, Bg)
    cu = jnp.concatenate([jnp.zeros((dp, 1), jnp.int32), jnp.cumsum(glens, axis=1)], axis=1)  # [dp, Bg + 1]
    base = (jnp.arange(dp, dtype=jnp.int32) * Bg * Tp)[:, None]
    first = (cu[:, :-1] + base).reshape(B)  # each row's first token in the flat axis
    t = jnp.arange(Tp, dtype=jnp.int32)
    real = t[None, :] < lens[:, None]
    where = jnp.where(real, first[:, None] + t[None, :], T)  # T: dropped
    rows = jnp.broadcast_to((jnp.arange(B, dtype=jnp.int32) % Bg)[:, None], (B, Tp))
    put = lambda fill, v: jnp.full(T, fill, jnp.int32).at[where].set(v.astype(jnp.int32), mode="drop")  # noqa: E731
    fb = FlatBatch(
        ids=put(0, ids), pos=put(0, batch.start_pos[:, None] + t[None, :]), tok_row=put(-1, rows),
        cu_q_lens=cu.reshape(-1), start_pos=batch.start_pos.astype(jnp.int32), q_lens=lens,
        read_slot=batch.slot_ids.astype(jnp.int32),
        write_slot=jnp.where(lens > 0, batch.slot_ids, num_slots).astype(jnp.int32),
        fresh=batch.start_pos == 0, page_table=batch.page_table.astype(jnp.int32),
        logits_idx=jnp.where(lens > 0, first + lens - 1, -1),
        snap_row=jnp.full(dp, -1, jnp.int32), snap_len=jnp.zeros(dp, jnp.int32),
        snap_slot=jnp.full(dp, num_slots, jnp.int32))
    return fb, jnp.where(real, where, -1)


def unflatten(x, index):
    """Per-token ``x [T, ...]`` back to the padded ``[B, T', ...]`` layout of ``index``
    (zeros at padding)."""
    got = x[jnp.maximum(index, 0)]
    mask = (index >= 0).reshape(index.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, got, jnp.zeros((), x.dtype))


def token_buckets(budget: int, rows: int = 1, growth: int = 8) -> list[int]:
    """Token-count buckets (one compiled program each): 1 (a lone decode row), the row count
    rounded up to a power of two (every row decoding), that times powers of ``growth`` (steps
    with prefill chunks), then the budget itself as the largest (a step is never padded past
    ``max_num_batched_tokens``). 4 rows, budget 256: 1, 4, 32, 256."""
    if growth < 2:
        raise ValueError(f"bucket growth must be >= 2, got {growth}")
    out, b = [1], 1 << max(0, int(rows) - 1).bit_length()
    if b == 1:
        b = growth
    while b < budget:
        out.append(b)
        b *= growth
    if out[-1] != budget:
        out.append(budget)
    return out


def host_layout(q_lens) -> np.ndarray:
    """``cu_q_lens`` for rows of ``q_lens`` tokens (numpy, on the host)."""
    return np.concatenate([[0], np.cumsum(np.asarray(q_lens, np.int64))]).astype(np.int32)


def local_rows(index, num_rows: int):
    """A ``-1``-for-none row index as the ragged ops want it: ``num_rows`` for none."""
    return jnp.where(index < 0, num_rows, index)
