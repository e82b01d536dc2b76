"""One KDA layer's core on a flattened step, straight on the cache pools, with the Pallas
kernels: what ``model/kda.py`` does on gathered rows (``_flat_core`` + the gated output norm),
but every row's state and conv window is read from and written to the pools in place.

* rows with one token (decode rows, and a prompt's last single token) go through
  :func:`kda_decode_kernel.kda_decode`: conv window, SiLU, norms, gate, delta step and the
  gated output norm in one kernel, the state and window written to the row's write slot and,
  when a snapshot entry of length 1 names the row, to the snapshot slot;
* rows with two tokens or more: the causal conv in XLA (each row's window gathered from the
  conv pool by read slot; the new windows and the snapshot windows scattered back), then
  :func:`kda_prefill_kernel.kda_prefill` for the delta rule (state carried across a row's
  chunks, written to the write slot, snapshots at any offset), then the gated output norm.

The conv pool may be ``[L, S, W-1, 3P]`` or the row layout ``[L, S, (W-1)*3H, d]`` (the same
elements, the rows possibly padded to a multiple of 8: ``model.cache.conv_block_rows``;
``kda_decode_kernel`` docstring): on TPU only the latter compiles without XLA
copying the whole pool in and out around the decode kernel. Block sizes and VMEM limits are
the kernels' own (derived from their VMEM budgets).

Rows of two tokens or more are rare in a decode step: the prefill path runs under a ``cond``
(only when some row has two tokens or more: ``any_prefill``, the step's own test by default; a
caller on several devices passes one for the whole step, so every device takes the same branch,
which TPU interpret mode needs: its kernels synchronise all devices), and ``prefill_rows=False``
leaves it out (a caller that knows every row has at most one token;
``sharding.parallel.StepParallel.kda_prefill_rows``).

Rows with no tokens are untouched. A caller that masks a whole layer (``q_lens`` all zero, as
the layer scan does for a non-KDA layer) gets zeros and unchanged pools: neither kernel visits
a row and no window is scattered.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .kda_decode_kernel import _l2_normalize, _log_decay, _rms_normalize, conv_slot_rows, conv_slot_window, kda_decode
from .kda_prefill_kernel import kda_prefill
from .kda_ragged import ragged_causal_conv
from .kda_spec_kernel import kda_spec_decode

F32, I32 = jnp.float32, jnp.int32


def kda_layer_on_pools(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool, layer,
                       tok_row, cu_q_lens, q_lens, start_pos, read_slot, write_slot, fresh, snap_row, snap_len,
                       snap_slot, *, lower_bound, eps, interpret=None, journal=None, decode=None, jrow=None,
                       fold_len=None, prefill_rows: bool = True, any_prefill=None):
    """``(o [T, H, d] float32 after the gated output norm, state_pool, conv_pool)``, and the
    journal fourth when one is given.

    Token inputs as :func:`kda_decode_kernel.kda_decode` (raw ``q|k|v`` projections, raw forget
    projection, beta, raw output gate); pools ``[L, S, ...]`` with ``layer``; ``tok_row`` local
    rows (``R`` for padding); the row arrays and snapshot entries of ``model.step.FlatBatch``.
    Same slot discipline as the kernels: written slots distinct, no row reads a slot another
    row writes.

    Speculative decoding: ``journal`` (``model.k3.journal_shapes``, all KDA layers) with the
    step's ``decode`` row kinds, ``jrow`` and ``fold_len``. Decode rows (``decode`` with a token,
    or one token) then run the record-mode kernel (``kda_spec_kernel.kda_spec_decode``: last
    step's accepted drafts folded in, the first token committed, the drafts verified and
    journaled in entry ``jrow``), whatever their length; the other rows of two tokens or more
    take the prefill path. Only decode rows fold (the engine folds nothing into a prefill row).

    ``prefill_rows=False``: no row has two tokens or more (or, with a journal, no row that is
    not a decode row does): the prefill path is not built. ``any_prefill``: a bool scalar, whether
    the path runs (None: whether some row here takes it). Module docstring."""
    T = qkv_raw.shape[0]
    R = q_lens.shape[0]
    ql = q_lens.astype(I32)
    cu = cu_q_lens.astype(I32)
    tok_row = tok_row.astype(I32)
    if journal is not None:
        return _with_journal(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool, layer,
                             tok_row, cu, ql, start_pos, read_slot, write_slot, fresh, snap_row, snap_len, snap_slot,
                             journal, decode, jrow, fold_len, lower_bound=lower_bound, eps=eps, interpret=interpret,
                             prefill_rows=prefill_rows, any_prefill=any_prefill)
    one, pre = ql == 1, ql >= 2

    # ---- one-token rows: the decode kernel (a row's token is its first)
    row_snap = jnp.where(one, _first_token_snapshots(snap_row, snap_len, snap_slot, R), -1)
    o_dec, state_pool, conv_pool = kda_decode(
        qkv_raw, f, beta, gate_out, state_pool, conv_pool, layer, jnp.minimum(cu[:R], T - 1), read_slot,
        jnp.where(one, write_slot, -1), row_snap, fresh, jnp.where(jnp.any(one), R, 0), conv_w, A_log, dt_bias,
        o_norm, lower_bound=lower_bound, eps=eps, interpret=interpret)

    o_pre, state_pool, conv_pool = _prefill_if_any(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm,
                                                   state_pool, conv_pool, layer, tok_row, cu, ql, pre, start_pos,
                                                   read_slot, write_slot, fresh, snap_row, snap_len, snap_slot,
                                                   lower_bound=lower_bound, eps=eps, interpret=interpret,
                                                   build=prefill_rows, run=any_prefill)

    # ---- each token's output: its row's decode output or its prefill output
    r = jnp.minimum(tok_row, R - 1)
    live = tok_row < R
    o = jnp.where((live & one[r])[:, None, None], o_dec[r], jnp.where((live & pre[r])[:, None, None], o_pre, 0.0))
    return o, state_pool, conv_pool


def _first_token_snapshots(snap_row, snap_len, snap_slot, R: int):
    """Per row, the slot of a snapshot entry after its first token (``-1``: none)."""
    e_row = jnp.where((snap_row < R) & (snap_len == 1), snap_row, R)
    return jnp.full((R,), -1, I32).at[e_row].set(snap_slot.astype(I32), mode="drop")


def _with_journal(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool, layer, tok_row,
                  cu, ql, start_pos, read_slot, write_slot, fresh, snap_row, snap_len, snap_slot, journal, decode, jrow,
                  fold_len, *, lower_bound, eps, interpret, prefill_rows, any_prefill):
    """:func:`kda_layer_on_pools` of a speculative step: decode rows by the record-mode kernel."""
    T, R = qkv_raw.shape[0], ql.shape[0]
    D = journal[0].shape[2]
    is_dec = (jnp.asarray(decode, bool) & (ql >= 1)) | (ql == 1)  # as kda_ragged's decode branch
    pre = ~is_dec & (ql >= 2)
    row_snap = _first_token_snapshots(snap_row, snap_len, snap_slot, R)  # a decode row's covers its first token only
    jr = jnp.where(is_dec, jrow.astype(I32), -1)
    o_dec, state_pool, conv_pool, journal = kda_spec_decode(
        qkv_raw, f, beta, gate_out, state_pool, conv_pool, journal, layer, jnp.minimum(cu[:R], T - 1),
        jnp.where(is_dec, ql - 1, 0), jr, jnp.where(jr >= 0, fold_len, 0), read_slot,
        jnp.where(is_dec, write_slot, -1), jnp.where(is_dec, row_snap, -1), fresh,
        jnp.where(jnp.any(is_dec), R, 0), conv_w, A_log, dt_bias, o_norm, lower_bound=lower_bound, eps=eps,
        interpret=interpret)
    o_pre, state_pool, conv_pool = _prefill_if_any(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm,
                                                   state_pool, conv_pool, layer, tok_row, cu, ql, pre, start_pos,
                                                   read_slot, write_slot, fresh, snap_row, snap_len, snap_slot,
                                                   lower_bound=lower_bound, eps=eps, interpret=interpret,
                                                   build=prefill_rows, run=any_prefill)
    r = jnp.minimum(tok_row, R - 1)
    live = tok_row < R
    i = jnp.clip(jnp.arange(T, dtype=I32) - cu[r], 0, D)  # each token's position in its row
    o = jnp.where((live & is_dec[r])[:, None, None], o_dec[r, i],
                  jnp.where((live & pre[r])[:, None, None], o_pre, 0.0))
    return o, state_pool, conv_pool, journal


def _prefill_if_any(*args, build: bool, run=None, **kw):
    """:func:`_prefill_rows` when ``run`` (None: some row is in ``pre``, argument 14), else zeros
    and the pools unchanged; ``build=False``: no row is (the branch is not built). The ``cond`` keeps a decode
    step off the prefill path's conv gather and scatter and the prefill kernel's grid (measured
    with ``k3serve compile``: docs/compile.md)."""
    qkv_raw, f, beta = args[0], args[1], args[2]
    T, H = qkv_raw.shape[0], beta.shape[-1]

    def skip(a):
        return jnp.zeros((T, H, f.shape[-1] // H), F32), a[8], a[9]

    if not build:
        return skip(args)
    run = jnp.any(args[14]) if run is None else jnp.asarray(run, bool).reshape(())
    return jax.lax.cond(run, lambda a: _prefill_rows(*a, **kw), skip, args)


def _prefill_rows(qkv_raw, f, beta, gate_out, conv_w, A_log, dt_bias, o_norm, state_pool, conv_pool, layer, tok_row,
                  cu, ql, pre, start_pos, read_slot, write_slot, fresh, snap_row, snap_len, snap_slot, *, lower_bound,
                  eps, interpret):
    """The rows ``pre`` (two tokens or more): the conv in XLA, the delta rule in the prefill
    kernel, the gated output norm. Returns ``(o_pre [T, H, d], state_pool, conv_pool)``."""
    T = qkv_raw.shape[0]
    H = beta.shape[-1]
    P = f.shape[-1]
    d = P // H
    R = ql.shape[0]
    S = state_pool.shape[1]
    # ---- rows of two tokens or more: conv in XLA, the delta rule in the prefill kernel
    qlp = jnp.where(pre, ql, 0)
    tok_pre = jnp.where(pre[jnp.minimum(tok_row, R - 1)] & (tok_row < R), tok_row, R)
    W1 = conv_w.shape[1] - 1
    conv_rows = conv_slot_window(conv_pool[layer, jnp.clip(read_slot, 0, S - 1)], W1 + 1, P)  # either pool layout
    conv_rows = jnp.where((fresh | ~pre)[:, None, None], 0.0, conv_rows)
    y, new_conv, snap_conv = ragged_causal_conv(qkv_raw, conv_rows, conv_w, tok_pre, cu, qlp, snap_row, snap_len)
    y = jax.nn.silu(y)
    q, k, v = (t.reshape(T, H, d) for t in (y[:, :P], y[:, P:2 * P], y[:, 2 * P:]))
    q = _l2_normalize(q) * (d ** -0.5)
    k = _l2_normalize(k)
    a = jnp.exp(A_log.astype(F32))[:, None]
    g = _log_decay(f.astype(F32).reshape(T, H, d), a, dt_bias.astype(F32).reshape(H, d), lower_bound)
    o_pre, state_pool = kda_prefill(q, k, v, g, beta.astype(F32), state_pool, layer, tok_pre, cu, qlp, start_pos,
                                    read_slot, write_slot, fresh, snap_row, snap_len, snap_slot, interpret=interpret)
    s_row = jnp.minimum(snap_row, R - 1)
    s_ok = (snap_row < R) & pre[s_row] & (snap_len >= 1) & (snap_len <= qlp[s_row])
    win = lambda x: conv_slot_rows(x, conv_pool.shape).astype(conv_pool.dtype)  # noqa: E731
    conv_pool = conv_pool.at[layer, jnp.where(pre, write_slot, S)].set(win(new_conv), mode="drop")
    conv_pool = conv_pool.at[layer, jnp.where(s_ok, snap_slot, S)].set(win(snap_conv), mode="drop")
    gate = jax.nn.sigmoid(gate_out.astype(F32).reshape(T, H, d))
    o_pre = _rms_normalize(o_pre, eps) * o_norm.astype(F32) * gate
    return o_pre, state_pool, conv_pool
