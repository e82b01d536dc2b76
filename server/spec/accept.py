"""Acceptance of weight-free drafts: sample every verify position as plain decoding would, keep
the drafts up to the first disagreement.

A decode row under speculation verifies ``n = 1 + d`` positions: position ``j`` has seen the
row's last token and drafts ``x_1 .. x_j``. The target's distribution there, ``p_j``, is what
plain decoding would sample from after emitting those drafts (the sampler's penalties and
suppression counting the drafts before ``j`` as generated). Each position is sampled with the
key plain decoding would use for that token, ``fold_in(key(seed), step + j)``
(:func:`position_steps`), giving ``y_j``; the row keeps drafts while ``y_j == x_{j+1}`` and
emits ``y_0 .. y_a`` (:func:`accepted_lengths`), ``a`` accepted drafts and one token more
(the correction, or the bonus after the last draft).

Why this is rejection sampling for a one-hot proposal: a weight-free drafter proposes ``x``
with probability 1. Standard rejection sampling accepts ``x`` with probability ``min(1,
p(x)/q(x)) = p(x)`` and on rejection samples ``norm(max(p − q, 0))``, which is ``p`` with ``x``
removed, renormalised. Sampling ``y ~ p`` and accepting iff ``y == x`` accepts with probability
``p(x)``, and a rejected ``y`` is distributed as ``p`` conditioned on ``y ≠ x``: the same two
laws. It is more than equal in distribution: because ``y_j`` uses plain decoding's key for that
token, a seeded request emits exactly the tokens it would emit without speculation, and every
process of a multi-host engine reaches the same decision without exchanging anything
(``tests/test_spec_accept.py`` checks both). Greedy rows are the ``temperature = 0`` case:
``y_j`` is the argmax. The rule stays exact for a drafter with a real distribution (the
emitted tokens are always the target's samples): DSpark samples its drafts with the same
Gumbel noise, so they agree with ``y_j`` about as often as rejection sampling against the
draft's ``q`` would accept (docs/speculative.md, ``tools/dspark_coupling.py``).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def position_steps(step, positions: int):
    """The sampler's ``step`` (tokens generated so far) of each verify position: ``step + j``
    for ``j < positions``, ``[R, positions]``. Works on numpy and jax arrays."""
    xp = jnp if not isinstance(step, np.ndarray) else np
    return xp.asarray(step)[:, None] + xp.arange(positions, dtype=xp.asarray(step).dtype)[None, :]


def accepted_lengths(sampled, drafts, num_drafts):
    """Drafts accepted per row: the leading positions ``j < num_drafts`` where the target's
    sample ``sampled[:, j]`` equals ``drafts[:, j]``.

    ``sampled`` ``[R, n]`` (the target's token at each verify position), ``drafts`` ``[R, n −
    1]`` (position ``j + 1``'s input; entries past ``num_drafts`` are ignored), ``num_drafts``
    ``[R]`` in ``0 .. n − 1``. Row ``r`` emits ``sampled[r, :a_r + 1]``. Works on numpy and jax
    arrays (the same arithmetic on either)."""
    xp = jnp if not isinstance(sampled, np.ndarray) else np
    n = sampled.shape[1]
    if drafts.shape != (sampled.shape[0], n - 1):
        raise ValueError(f"drafts {drafts.shape} must be [rows, positions - 1] = {(sampled.shape[0], n - 1)}")
    live = xp.arange(n - 1)[None, :] < xp.asarray(num_drafts)[:, None]
    match = (sampled[:, : n - 1] == drafts) & live
    return xp.sum(xp.cumprod(match.astype(xp.int32), axis=1), axis=1).astype(xp.int32)


def emitted(sampled, accepted) -> list[list[int]]:
    """The tokens each row emits (host side): ``sampled[r, :accepted[r] + 1]``."""
    s, a = np.asarray(sampled), np.asarray(accepted)
    return [s[r, : int(a[r]) + 1].tolist() for r in range(s.shape[0])]
