"""The small device programs of prefix caching, each a pure function of the device cache:
copy pages (copy-on-write of a shared tail page), copy slots (snapshot <-> request slot),
load a host-tier prefix into pages and a slot, read one out for offload. ``CacheManager``
jits each once (index arrays padded to a power of two, so few shapes compile).

What leaves the device (``read``) and comes back (``load``) is the conv window in its logical
form ``[nK, W-1, 3P]`` (channels ``q | k | v``), whatever the pool's rows (rank-major over
``conv_groups`` ranks when the KDA heads are split: ``model.cache.conv_pool_rows``), so
host-tier entries and P/D handoffs do not depend on the recipe.

Pages and slots are read and written per device when a pool's rows are split over devices
(the MLA pool's pages over DCP and attention DP, the KDA pools' slots over attention DP):
each device reads the rows it holds (the others' summed in as zeros over the split axes: a
few rows travel) and writes only the rows it holds. Indexed on the global pool, XLA's
partitioner copied the whole pool for a one-page copy or load (K3 under v7-32-decode: 15 GiB
of temporaries and 145 GB accessed per device, ``k3serve compile``; under
v7-32-decode-dp2 a one-slot load another 5.6 GiB for the KDA state pool).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ....model.cache import conv_pool_logical, conv_pool_rows


def split_of(pool):
    """``(mesh, spec, axes)`` when the placed pool's row dim (1: pages, slots) is split over
    mesh axes, else None: bound into the programs when they are jitted (their traced
    arguments do not carry the placement)."""
    sh = getattr(pool, "sharding", None)
    if not isinstance(sh, NamedSharding):
        return None
    spec = tuple(sh.spec) + (None,) * (pool.ndim - len(sh.spec))
    if spec[1] is None:
        return None
    axes = spec[1] if isinstance(spec[1], tuple) else (spec[1],)
    return sh.mesh, P(*spec), axes


def splits_of(cache) -> dict:
    """:func:`split_of` of the three pools, by the programs' keyword names."""
    return {"kv_split": split_of(cache.mla_kv), "st_split": split_of(cache.kda_state),
            "cv_split": split_of(cache.kda_conv)}


def _first_row(mesh, axes, n):
    """The global index of this device's first row (its block along ``axes``, row-major)."""
    i = 0
    for a in axes:
        i = i * mesh.shape[a] + jax.lax.axis_index(a)
    return i * n


def _rows_spec(spec):
    """The layout of rows taken from a pool laid out as ``spec``: the row dim whole."""
    return P(spec[0], None, *spec[2:])


def _read_rows(pool, idx, split=None):
    """``pool[:, idx]``, the rows whole on every device (their other dims as the pool's)."""
    if split is None:
        return pool[:, idx]
    mesh, spec, axes = split

    def local(pool, idx):
        n = pool.shape[1]
        loc = idx - _first_row(mesh, axes, n)
        mine = ((loc >= 0) & (loc < n)).reshape((1, -1) + (1,) * (pool.ndim - 2))
        rows = jnp.where(mine, pool[:, jnp.clip(loc, 0, n - 1)], jnp.zeros((), pool.dtype))
        return jax.lax.psum(rows, axes)  # each row held by one device: the others add zeros

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=_rows_spec(spec),
                         check_vma=False)(pool, idx)


def _write_rows(pool, idx, rows, split=None, keep=None):
    """``pool.at[:, idx].set(rows, mode="drop")`` (an index past the pool is dropped); ``keep``
    ([n, page_size] bool, pages only): positions not kept are written as zeros. The mask and
    the cast to the pool's dtype happen where the rows are written, not on a copy of them."""
    def put(pool, idx, rows, keep):
        if keep is not None:
            rows = jnp.where(keep[None, :, :, None], rows, jnp.zeros((), rows.dtype))
        return pool.at[:, idx].set(rows.astype(pool.dtype), mode="drop")

    if split is None:
        return put(pool, idx, rows, keep)
    mesh, spec, axes = split

    def local(pool, idx, rows, keep):
        n = pool.shape[1]
        loc = idx - _first_row(mesh, axes, n)
        return put(pool, jnp.where((loc >= 0) & (loc < n), loc, n), rows, keep)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), _rows_spec(spec), P()), out_specs=spec,
                         check_vma=False)(pool, idx, rows, keep)


def _copy_pages(cache, src, dst, *, kv_split=None, st_split=None, cv_split=None):
    kv = cache.mla_kv
    return dataclasses.replace(cache, mla_kv=_write_rows(kv, dst, _read_rows(kv, src, kv_split), kv_split))


def _copy_slots(cache, src, dst, *, kv_split=None, st_split=None, cv_split=None):
    st, cv = cache.kda_state, cache.kda_conv
    return dataclasses.replace(cache, kda_state=_write_rows(st, dst, _read_rows(st, src, st_split), st_split),
                               kda_conv=_write_rows(cv, dst, _read_rows(cv, src, cv_split), cv_split))


def _load_prefix(cache, idx, pos0, rows, tokens, slot, state, conv, *, conv_groups: int = 1, kv_split=None,
                 st_split=None, cv_split=None, window=None):
    """Pages ``idx`` := gathered pages ``rows`` ``[nM, P', page_size, W]``, zero from position
    ``tokens`` on (``pos0``: each page's first position); slot ``slot`` := the state. An
    index past the pool's end is padding: its rows are dropped."""
    ps = rows.shape[2]
    keep = (pos0[:, None] + jnp.arange(ps)[None, :]) < tokens
    at = jnp.reshape(slot, (1,))
    return dataclasses.replace(
        cache, mla_kv=_write_rows(cache.mla_kv, idx, rows, kv_split, keep),
        kda_state=_write_rows(cache.kda_state, at, state[:, None], st_split),
        kda_conv=_write_rows(cache.kda_conv, at, conv_pool_rows(conv, conv_groups, cache.kda_conv.shape[-1])[:, None],
                             cv_split))


def _read_prefix(cache, slot, idx, *, conv_groups: int = 1, kv_split=None, st_split=None, cv_split=None, window=None):
    at = jnp.reshape(slot, (1,))
    return (_read_rows(cache.kda_state, at, st_split)[:, 0],
            conv_pool_logical(_read_rows(cache.kda_conv, at, cv_split)[:, 0], conv_groups, window,
                              cache.kda_state.shape[2]),
            _read_rows(cache.mla_kv, idx, kv_split))


# name -> (body, returns the cache): the small device programs of prefix caching; ``load``
# and ``read`` also take the pool's ``conv_groups`` and the window's length ``window`` (W-1),
# all of them the pools' splits
# (``splits_of``; keywords, bound when jitted)
PROGRAMS = {"pages": (_copy_pages, True), "slots": (_copy_slots, True), "load": (_load_prefix, True),
             "read": (_read_prefix, False)}
