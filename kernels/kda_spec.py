"""Speculative verification of KDA decode rows without state copies: a journal and a fold.

A decode row under speculation carries its last token and ``d ≥ 0`` drafts: ``n = 1 + d``
positions. Verifying them needs the state after every position (each position's output reads
it), but only the state after the *accepted* positions may be committed, and which those are is
known only after sampling. Keeping ``n`` state copies per row (vLLM, SGLang, tpu-inference) costs
``n`` × 414 MiB per K3 request. Here instead (``../shared/design/spec-decode.md``, "Recommended
design", items 4-5):

* :func:`kda_verify` runs the ``n`` positions from the committed state ``S`` in registers and
  writes nothing back. Per position it journals what advancing the state takes: the key ``k_t``,
  the decay ``e^{g_t}`` and the written value ``δ_t = β_t (v_t − (k_t e^{g_t})·S_{t−1})``, fp32.
* :func:`kda_fold` commits the first ``a`` positions (``a`` per row, 0..n) after acceptance:
  ``S ← S · e^{g_t} + k_t ⊗ δ_t`` for ``t < a``.

Both advance the state with :func:`advance`, the same function :func:`kda_decode_step_journal`
uses for a plain decode token, so a committed state equals plain decoding of the accepted
tokens bit for bit (``tests/test_kda_spec.py`` checks every accept length). The state is never
rebuilt backwards (dividing by ``1 − β`` is ill-conditioned).

The causal-conv window (the last ``W − 1`` pre-conv rows of a slot) is committed the same way:
the journal keeps the ``n`` pre-conv rows and :func:`conv_window_commit` shifts the accepted ones
in, a copy, exact.

Memory (:func:`journal_bytes_per_request`): for K3 at ``k = 7`` (8 positions, 69 KDA layers,
96 heads of 128, 36,864 conv channels in bf16) 116 MiB per running request, against 3.23 GiB
for eight state copies.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def advance(S, k, eg, delta):
    """One position's state update, ``S · e^{g} + k ⊗ δ`` (state ``[..., H, dk, dv]``, ``k`` and
    ``eg`` ``[..., H, dk]``, ``delta`` ``[..., H, dv]``, fp32). The outer product is a matmul
    over a padded pair so that its operands are materialised (``kernels.kda.kda_decode_step``
    explains why)."""
    kz = jnp.stack([k, jnp.zeros_like(k)], axis=-2)
    dz = jnp.stack([delta, jnp.zeros_like(delta)], axis=-2)
    return S * eg[..., None] + jnp.einsum("...jk,...jv->...kv", kz, dz)


def _position(q, k, v, g, beta, S):
    """Output and journal entry of one position read from ``S`` (fp32 inputs)."""
    eg = jnp.exp(g)
    r = jnp.einsum("...jk,...kv->...jv", jnp.stack([k * eg, q * eg], axis=-2), S)  # [..., H, 2, dv]
    delta = (v - r[..., 0, :]) * beta[..., None]
    o = r[..., 1, :] + jnp.sum(q * k, axis=-1)[..., None] * delta
    return o, eg, delta


def kda_decode_step_journal(q, k, v, g, beta, state):
    """Plain decode of one token per row through the journal's arithmetic: ``(o, new state)``,
    the contract of ``kernels.kda.kda_decode_step``. A speculative engine decodes its rows
    without drafts with this, so that speculation on and off commit identical states."""
    q, k, v, g, beta, S = (x.astype(F32) for x in (q, k, v, g, beta, state))
    o, eg, delta = _position(q, k, v, g, beta, S)
    return o, advance(S, k, eg, delta)


def kda_verify(q, k, v, g, beta, state, valid=None):
    """Verify ``n`` positions per row from the committed ``state``, writing nothing.

    ``q, k, g`` ``[..., n, H, dk]``, ``v`` ``[..., n, H, dv]``, ``beta`` ``[..., n, H]``,
    ``state`` ``[..., H, dk, dv]``; ``valid`` (bool ``[..., n]``, optional): positions past a
    row's drafts, which do not advance the running state (their outputs are junk). Returns
    ``(o [..., n, H, dv], journal)``, ``journal = (k, eg, delta)`` fp32 with the position axis
    where the inputs have it."""
    q, k, v, g, beta, S = (x.astype(F32) for x in (q, k, v, g, beta, state))
    ax = q.ndim - 3  # the position axis
    xs = tuple(jnp.moveaxis(x, ax, 0) for x in (q, k, v, g, beta))
    ok = None if valid is None else jnp.moveaxis(jnp.asarray(valid, bool), ax, 0)

    def step(S, i):
        qt, kt, vt, gt, bt = (x[i] for x in xs)
        o, eg, delta = _position(qt, kt, vt, gt, bt, S)
        nxt = advance(S, kt, eg, delta)
        if ok is not None:
            nxt = jnp.where(ok[i][..., None, None, None], nxt, S)
        return nxt, (o, eg, delta)

    _, (o, eg, delta) = jax.lax.scan(step, S, jnp.arange(xs[0].shape[0]))
    k_j = jnp.moveaxis(xs[1], 0, ax)
    return jnp.moveaxis(o, 0, ax), (k_j, jnp.moveaxis(eg, 0, ax), jnp.moveaxis(delta, 0, ax))


def kda_fold(state, journal, accepted):
    """Commit the first ``accepted`` positions of ``journal`` (:func:`kda_verify`'s) into
    ``state`` ``[..., H, dk, dv]``. ``accepted``: int ``[...]`` (per row, 0..n; 0 leaves the
    state as it is). Returns the new state, fp32, equal bit for bit to decoding the accepted
    tokens one by one with :func:`kda_decode_step_journal`."""
    k, eg, delta = journal
    S = state.astype(F32)
    ax = k.ndim - 3
    ks, es, ds = (jnp.moveaxis(x, ax, 0) for x in (k, eg, delta))
    a = jnp.asarray(accepted, jnp.int32)

    def step(S, i):
        nxt = advance(S, ks[i], es[i], ds[i])
        return jnp.where((i < a)[..., None, None, None], nxt, S), None

    S, _ = jax.lax.scan(step, S, jnp.arange(ks.shape[0]))
    return S


def conv_window_commit(window, rows, accepted):
    """The conv window after ``accepted`` of a row's ``n`` journaled pre-conv ``rows``: the last
    ``W − 1`` rows of ``window ++ rows[:accepted]``. ``window`` ``[..., W−1, C]``, ``rows``
    ``[..., n, C]``, ``accepted`` int ``[...]``. A copy: exact."""
    w = window.shape[-2]
    cat = jnp.concatenate([window, rows.astype(window.dtype)], axis=-2)  # [..., W-1+n, C]
    idx = jnp.asarray(accepted, jnp.int32)[..., None] + jnp.arange(w)  # rows a .. a+W-2 of cat
    return jnp.take_along_axis(cat, idx[..., None], axis=-2)


def journal_bytes_per_request(cfg, num_speculative_tokens: int, conv_itemsize: int = 2) -> int:
    """Bytes one running request's journal holds over all KDA layers for ``k`` drafts: per
    position and layer ``k_t``, ``e^{g_t}`` (``H × dk`` each) and ``δ_t`` (``H × dv``) in fp32,
    and the pre-conv q, k, v row (``3 H d`` channels)."""
    n = num_speculative_tokens + 1
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    per_layer = n * (H * (2 * d + d) * 4 + 3 * H * d * conv_itemsize)
    return len(cfg.kda_layers) * per_layer


def state_copies_bytes_per_request(cfg, num_speculative_tokens: int, state_itemsize: int = 4) -> int:
    """What the ``k + 1`` state copies of the anchors' scheme hold per request (for comparison)."""
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    return len(cfg.kda_layers) * (num_speculative_tokens + 1) * H * d * d * state_itemsize
