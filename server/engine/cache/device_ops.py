"""The small device programs of prefix caching, each a pure function of the device cache:
copy pages (copy-on-write of a shared tail page), copy slots (snapshot <-> request slot),
load a host-tier prefix into pages and a slot, read one out for offload. ``CacheManager``
jits each once (index arrays padded to a power of two, so few shapes compile).

What leaves the device (``read``) and comes back (``load``) has the conv window's channels in
the logical ``q | k | v`` order, whatever the pool's (rank-major over ``conv_groups`` ranks
when the KDA heads are split: ``model.cache.conv_rank_major``), so host-tier entries and P/D
handoffs do not depend on the recipe.

Pages are read and written per device when the MLA pool's pages are split over devices (DCP,
attention DP): each device reads the pages it holds (the others' rows summed in as zeros over
the page axes: a few pages travel) and writes only the pages it holds. Indexed on the global
pool, XLA's partitioner copied the whole pool for a one-page copy or load (K3 under
v7-32-decode: 15 GiB of temporaries and 145 GB accessed per device, ``k3serve compile``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ....model.cache import conv_logical, conv_rank_major


def page_split(kv):
    """``(mesh, spec, axes)`` when the placed MLA pool ``kv``'s page dim (1) is split over mesh
    axes, else None: bound into the programs when they are jitted (their traced arguments do
    not carry the placement)."""
    sh = getattr(kv, "sharding", None)
    if not isinstance(sh, NamedSharding):
        return None
    spec = tuple(sh.spec) + (None,) * (kv.ndim - len(sh.spec))
    if spec[1] is None:
        return None
    axes = spec[1] if isinstance(spec[1], tuple) else (spec[1],)
    return sh.mesh, P(*spec), axes


def _first_page(mesh, axes, ppr):
    """The global id of this device's first page (its block along ``axes``, row-major)."""
    i = 0
    for a in axes:
        i = i * mesh.shape[a] + jax.lax.axis_index(a)
    return i * ppr


def _read_pages(kv, idx, split=None):
    """``kv[:, idx]`` whole on every device (``split``: :func:`page_split` of the pool)."""
    if split is None:
        return kv[:, idx]
    mesh, spec, axes = split

    def local(kv, idx):
        ppr = kv.shape[1]
        loc = idx - _first_page(mesh, axes, ppr)
        mine = (loc >= 0) & (loc < ppr)
        rows = jnp.where(mine[None, :, None, None], kv[:, jnp.clip(loc, 0, ppr - 1)], jnp.zeros((), kv.dtype))
        return jax.lax.psum(rows, axes)  # each page held by one device: the others add zeros

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=P(), check_vma=False)(kv, idx)


def _write_pages(kv, idx, rows, split=None, keep=None):
    """``kv.at[:, idx].set(rows, mode="drop")`` (an index past the pool is dropped); ``keep``
    ([n, page_size] bool, optional): positions not kept are written as zeros. The mask and the
    cast to the pool's dtype happen where the rows are written, not on a copy of all of them."""
    def put(kv, idx, rows, keep):
        if keep is not None:
            rows = jnp.where(keep[None, :, :, None], rows, jnp.zeros((), rows.dtype))
        return kv.at[:, idx].set(rows.astype(kv.dtype), mode="drop")

    if split is None:
        return put(kv, idx, rows, keep)
    mesh, spec, axes = split

    def local(kv, idx, rows, keep):
        ppr = kv.shape[1]
        loc = idx - _first_page(mesh, axes, ppr)
        return put(kv, jnp.where((loc >= 0) & (loc < ppr), loc, ppr), rows, keep)

    return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P(), P()), out_specs=spec,
                         check_vma=False)(kv, idx, rows, keep)


def _copy_pages(cache, src, dst, *, split=None):
    kv = cache.mla_kv
    return dataclasses.replace(cache, mla_kv=_write_pages(kv, dst, _read_pages(kv, src, split), split))


def _copy_slots(cache, src, dst):
    st, cv = cache.kda_state, cache.kda_conv
    return dataclasses.replace(cache, kda_state=st.at[:, dst].set(st[:, src]), kda_conv=cv.at[:, dst].set(cv[:, src]))


def _load_prefix(cache, idx, pos0, rows, tokens, slot, state, conv, *, conv_groups: int = 1, split=None):
    """Pages ``idx`` := gathered pages ``rows`` ``[nM, P', page_size, W]``, zero from position
    ``tokens`` on (``pos0``: each page's first position); slot ``slot`` := the state. An
    index past the pool's end is padding: its rows are dropped."""
    ps = rows.shape[2]
    keep = (pos0[:, None] + jnp.arange(ps)[None, :]) < tokens
    return dataclasses.replace(cache, mla_kv=_write_pages(cache.mla_kv, idx, rows, split, keep),
                               kda_state=cache.kda_state.at[:, slot].set(state),
                               kda_conv=cache.kda_conv.at[:, slot].set(conv_rank_major(conv, conv_groups)))


def _read_prefix(cache, slot, idx, *, conv_groups: int = 1, split=None):
    return (cache.kda_state[:, slot], conv_logical(cache.kda_conv[:, slot], conv_groups),
            _read_pages(cache.mla_kv, idx, split))


# name -> (body, returns the cache): the small device programs of prefix caching; ``load``
# and ``read`` also take the pool's ``conv_groups``, and those and ``pages`` the MLA pool's
# ``split`` (keywords, bound when jitted)
PROGRAMS = {"pages": (_copy_pages, True), "slots": (_copy_slots, True), "load": (_load_prefix, True),
             "read": (_read_prefix, False)}
