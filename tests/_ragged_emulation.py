"""A stand-in for ``jax.lax.ragged_all_to_all`` on CPU (XLA:CPU has no ``ragged-all-to-all``):
an ``all_gather`` plus a scatter with the collective's documented semantics, for checking the
EP exchange's offsets and sizes (``sharding.ep._ragged_all_to_all`` is swapped for it). Not
the real op. Received sizes that differ from what the sources send poison the output (-1)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def emulated_ragged_all_to_all(operand, output, in_off, send, out_off, recv, *, axis_name):
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [ep, M, ...]
    lo = jax.lax.all_gather(in_off, axis_name)[:, me][:, None]
    sz = jax.lax.all_gather(send, axis_name)[:, me]
    dst = jax.lax.all_gather(out_off, axis_name)[:, me][:, None]
    rows = jnp.arange(operand.shape[0])[None, :]
    ok = (rows >= lo) & (rows < lo + sz[:, None])
    tgt = jnp.where(ok, dst + rows - lo, output.shape[0]).reshape(-1)
    res = output.at[tgt].set(ops.reshape(-1, *operand.shape[1:]), mode="drop")
    bad = jnp.any(recv != sz)  # recv_sizes must be what the sources send
    return jnp.where(bad, jnp.full_like(res, -1), res)
