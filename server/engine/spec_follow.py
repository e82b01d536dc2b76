"""Rows that follow an in-flight verify row (speculative decoding with async scheduling).

The host plans step N+1 while step N runs. A request whose step-N row verified ``d`` drafts
emits between 1 and ``1 + d`` tokens there, and the host does not know how many until step N
returns. Its step-N+1 row is planned as if all ``d`` were accepted (``assumed = d``: start,
token positions and the sampler's ``step`` all counted from there, pages reserved for it);
inside step N+1's program, with step N's accepted count ``a`` on the device, the row is moved
back by ``d - a``: its start, its tokens' positions (so MLA writes and reads the right rows),
its sampler step (the keys and ``min_new_tokens`` of the tokens it really samples), and the
KDA fold (the ``a`` drafts step N accepted are folded at the start of step N+1, as the host
would have asked for had it waited).

Its drafts: a host drafter proposed them after step N's drafts and a guessed last token
(``guess``); they stand only if step N accepted every draft and emitted that token, otherwise
the row verifies none of them (``ndraft = 0``: position 0's sample is emitted, the rest of
the row is padding that is overwritten later). A device drafter's (DSpark) drafts are step
N's block, proposed after the tokens step N really emitted: copied into the row's draft
positions and always standing.

Everything here is a function of device values that every process of a multi-host engine
has alike, so they all make the same corrections.
"""
from __future__ import annotations

import jax.numpy as jnp


def follow_rows(rows, ids, pos, tok_row, last, acc, block, lay, cols: tuple, dev_drafts_bit: int):
    """Correct a step's rows that follow the previous step's rows (``from_prev >= 0``).

    ``rows`` ``[R, C]`` (int columns named by ``cols``), ``ids``/``pos``/``tok_row`` ``[T]``
    (``tok_row``: the token's row within its attention-DP group, -1 for padding); per row, the
    previous step's row it follows: ``last`` its last emitted token, ``acc`` its accepted
    drafts, ``block`` ``[R, k]`` the block proposed after it (zeros when the previous step
    proposed none). ``lay``: the step's layout (``T``, ``R``, ``dp``). Returns the corrected
    ``(rows, ids, pos)``."""
    c = {name: i for i, name in enumerate(cols)}
    col = lambda name: rows[:, c[name]]  # noqa: E731
    follows = col("from_prev") >= 0
    delta = jnp.where(follows, acc - col("assumed"), 0)  # <= 0: the drafts step N rejected
    # the drafts: the device's block, or the host's, if its guess of step N's outcome held
    k = block.shape[1]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    dev = follows & ((col("flags") & dev_drafts_bit) != 0)
    live = dev[:, None] & (j < col("ndraft")[:, None])
    at = jnp.where(live, col("first_tok")[:, None] + 1 + j, lay.T)
    ids = ids.at[at.reshape(-1)].set(block.reshape(-1), mode="drop")
    guess = col("guess")
    stands = (guess < 0) | (dev) | ((delta == 0) & (last == guess))
    ndraft = jnp.where(follows & ~stands, 0, col("ndraft"))
    fold = jnp.where(follows, acc, col("fold"))
    rows = (rows.at[:, c["start"]].add(delta).at[:, c["step"]].add(delta)
            .at[:, c["ndraft"]].set(ndraft).at[:, c["fold"]].set(fold))
    # each token's row (global: group g's rows are block g of the row axis)
    Tg, Rg = lay.T // lay.dp, lay.R // lay.dp
    grow = (jnp.arange(lay.T, dtype=jnp.int32) // Tg) * Rg + jnp.maximum(tok_row, 0)
    pos = pos + jnp.where(tok_row >= 0, delta[grow], 0)
    return rows, ids, pos
