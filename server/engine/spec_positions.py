"""The sampler's inputs for every verify position of a speculative step.

Position ``j`` of a decode row (its last token plus ``d`` drafts) samples the token plain
decoding would sample after emitting drafts ``x_1 .. x_j``. So its sampler row must look like
plain decoding's at that point: the same settings and seed, ``step + j`` tokens generated
(the key, ``sampler._row_keys``), the drafts before ``j`` counted as output in the token table
(frequency / presence / repetition penalties), and suppression (``min_new_tokens``) as it would
stand after ``step + j`` tokens. :func:`verify_sampler_inputs` builds that from a row-per-request
:class:`~k3serve.server.engine.sampler.SamplerInputs`; ``server/spec/accept.py`` then keeps the
drafts the samples agree with.

The token table grows only when some row reads it: a batch without penalties or suppression
keeps the engine's table and repeats its row indices; otherwise each position gets its own row,
its request's row plus the draft prefix's counts (``[R · n, V]`` int32, built on the device).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .sampler import SamplerInputs


def suppress_positions(step, min_new_tokens, suppress_any, positions: int) -> np.ndarray:
    """Whether each verify position suppresses its row's stop ids, ``[R, n]`` bool: while fewer
    than ``min_new_tokens`` tokens are generated (``step + j``), for rows that have ids to
    suppress (``suppress_any``). Host-side numpy (tests); the runner's speculative step decides
    the same on the device, from each row's ``step`` as corrected there (``spec_follow``)."""
    step = np.asarray(step)[:, None] + np.arange(positions)[None, :]
    return (step < np.asarray(min_new_tokens)[:, None]) & np.asarray(suppress_any, bool)[:, None]


def verify_sampler_inputs(inp: SamplerInputs, drafts, num_drafts, suppress, *, use_table: bool) -> SamplerInputs:
    """Row ``r * n + j`` samples position ``j`` of row ``r``. ``inp``: one row per decode row
    (``step`` its tokens generated so far); ``drafts`` ``[R, n − 1]`` and ``num_drafts`` ``[R]``
    (drafts past a row's count are ignored); ``suppress`` ``[R, n]`` (:func:`suppress_positions`);
    ``use_table`` (static): some row uses penalties or suppression (the host knows), so the
    positions need their own table rows."""
    R, d = drafts.shape
    n = d + 1
    rep = lambda a: jnp.repeat(a, n, axis=0)  # noqa: E731
    j = jnp.tile(jnp.arange(n, dtype=jnp.int32), R)
    fields = dict(temperature=rep(inp.temperature), top_k=rep(inp.top_k), top_p=rep(inp.top_p),
                  min_p=rep(inp.min_p), repetition_penalty=rep(inp.repetition_penalty),
                  frequency_penalty=rep(inp.frequency_penalty), presence_penalty=rep(inp.presence_penalty),
                  seed=rep(inp.seed), step=rep(inp.step) + j, suppress=jnp.asarray(suppress, bool).reshape(-1),
                  bias=rep(inp.bias))
    if not use_table:
        return SamplerInputs(**fields, table_rows=rep(inp.table_rows), table=inp.table)
    rows = rep(inp.table[inp.table_rows])  # [R*n, V + EXTRA_COLS]: each position starts from its request's row
    drafts = jnp.asarray(drafts, jnp.int32)
    live = jnp.arange(d)[None, :] < jnp.asarray(num_drafts)[:, None]  # [R, d]
    # position j counts drafts i < j (those emitted before it, when they are accepted)
    before = (jnp.arange(d)[None, :] < jnp.arange(n)[:, None])  # [n, d]
    count = (before[None, :, :] & live[:, None, :]).astype(rows.dtype)  # [R, n, d]
    tok = jnp.broadcast_to(drafts[:, None, :], (R, n, d)).reshape(R * n, d)
    rows = rows.at[jnp.arange(R * n)[:, None], tok].add(count.reshape(R * n, d), mode="drop")
    return SamplerInputs(**fields, table_rows=jnp.arange(R * n, dtype=jnp.int32), table=rows)
