"""The small device programs of prefix caching, each a pure function of the device cache:
copy pages (copy-on-write of a shared tail page), copy slots (snapshot <-> request slot),
load a host-tier prefix into pages and a slot, read one out for offload. ``CacheManager``
jits each once (index arrays padded to a power of two, so few shapes compile).

What leaves the device (``read``) and comes back (``load``) has the conv window's channels in
the logical ``q | k | v`` order, whatever the pool's (rank-major over ``conv_groups`` ranks
when the KDA heads are split: ``model.cache.conv_rank_major``), so host-tier entries and P/D
handoffs do not depend on the recipe.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ....model.cache import conv_logical, conv_rank_major


def _copy_pages(cache, src, dst):
    kv = cache.mla_kv
    return dataclasses.replace(cache, mla_kv=kv.at[:, dst].set(kv[:, src]))


def _copy_slots(cache, src, dst):
    st, cv = cache.kda_state, cache.kda_conv
    return dataclasses.replace(cache, kda_state=st.at[:, dst].set(st[:, src]), kda_conv=cv.at[:, dst].set(cv[:, src]))


def _load_prefix(cache, idx, pos0, rows, tokens, slot, state, conv, *, conv_groups: int = 1):
    """Pages ``idx`` := gathered pages ``rows`` ``[nM, P', page_size, W]``, zero from position
    ``tokens`` on (``pos0``: each page's first position); slot ``slot`` := the state. An
    index past the pool's end is padding: its rows are dropped."""
    ps = rows.shape[2]
    keep = (pos0[:, None] + jnp.arange(ps)[None, :]) < tokens
    rows = jnp.where(keep[None, :, :, None], rows, 0)
    return dataclasses.replace(cache, mla_kv=cache.mla_kv.at[:, idx].set(rows.astype(cache.mla_kv.dtype), mode="drop"),
                               kda_state=cache.kda_state.at[:, slot].set(state),
                               kda_conv=cache.kda_conv.at[:, slot].set(conv_rank_major(conv, conv_groups)))


def _read_prefix(cache, slot, idx, *, conv_groups: int = 1):
    return cache.kda_state[:, slot], conv_logical(cache.kda_conv[:, slot], conv_groups), cache.mla_kv[:, idx]


# name -> (body, returns the cache): the small device programs of prefix caching; ``load``
# and ``read`` also take the pool's ``conv_groups`` (a keyword, bound when jitted)
PROGRAMS = {"pages": (_copy_pages, True), "slots": (_copy_slots, True), "load": (_load_prefix, True),
             "read": (_read_prefix, False)}
