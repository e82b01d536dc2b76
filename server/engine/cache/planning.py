"""Capacity planning: how many KDA slots and MLA pages a device budget buys.

Budget rule (``plan_capacity``): KDA slots are fixed-size and needed per *running request*,
MLA pages grow with tokens. So slots come first: ``max_num_seqs`` request slots plus the
scratch slot, at float32 state + conv window, whatever the model dtype. A P/D server sets
``handoff_bytes`` aside next (the bound on handoff arrays held outside the pools,
``server/pd/budget.py``). Everything left of the budget becomes MLA pages. A plan must hold at least one page per sequence, or it
raises. A model without MLA layers has pages that cost 0 bytes; it gets a nominal page pool
of ``max_num_seqs * ceil(tokens_per_seq / page_size)`` pages with ``tokens_per_seq =
cfg.max_position_embeddings`` (or ``NOMINAL_TOKENS_PER_SEQ`` when unset), so page
accounting never limits it below its context length.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ....intmath import cdiv
from ....model.cache import cache_bytes

NOMINAL_TOKENS_PER_SEQ = 131072  # page accounting for a model with no MLA layers and no max_position_embeddings


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    num_pages: int
    num_slots: int  # including the scratch slot
    page_size: int
    bytes_per_page: int  # one page across all MLA layers
    bytes_per_slot: int  # one slot's state + conv window across all KDA layers
    total_bytes: int  # the whole device cache
    max_tokens_in_kv: int  # num_pages * page_size
    max_tokens_per_request: int  # num_pages / dp * page_size (a request lives in one DP group)
    max_concurrent_slots: int  # num_slots - dp (one scratch slot per attention DP group)
    dp: int = 1  # attention DP groups: slots and pages split into dp equal ranges
    dcp: int = 1  # decode context parallel ranks per group: each group's pages in dcp blocks
    snapshot_slots: int = 0  # KDA prefix snapshot slots (issue #6), split evenly over the DP groups
    handoff_bytes: int = 0  # set aside for P/D handoff arrays outside the pools, all processes' (not in total_bytes)
    journal_bytes: int = 0  # speculative decoding's KDA journal, an entry per request slot (not in total_bytes)
    conv_groups: int = 1  # rank blocks of the conv pool's rows (``model.cache.conv_pool_rows``)


def plan_capacity(cfg, *, page_size: int, dtype, kv_memory_bytes: int | None = None,
                  max_num_seqs: int, num_pages: int | None = None, dp: int = 1, dcp: int = 1,
                  snapshot_slots: int = 0, handoff_bytes: int = 0, num_speculative_tokens: int = 0,
                  conv_groups: int = 1) -> CapacityPlan:
    """Size the cache: ``max_num_seqs`` slots (+ scratch), then pages from what is left.

    Give ``kv_memory_bytes`` (the device budget for the whole cache) or ``num_pages``
    (explicit; if a budget is also given it is checked against it).

    Under a recipe with attention DP (``dp`` groups) and DCP (``dcp`` ranks per group) the
    slots split into ``dp`` equal groups (``ceil(max_num_seqs / dp)`` + a scratch slot each)
    and the pages into ``dp * dcp`` equal blocks (rounded down to a multiple); a request
    lives in one group, so it can hold at most ``num_pages / dp`` pages.

    ``snapshot_slots`` (prefix caching, rounded up to a multiple of ``dp``) are extra KDA slots
    for prefix state snapshots; like request slots they are paid for before the pages.

    ``handoff_bytes`` (a P/D server's ``--pd-handoff-memory-gb``) is taken off the budget
    after the slots: the pages get only what is left.

    ``num_speculative_tokens`` (``k``): the KDA journal of speculative decoding
    (``model.k3.journal_shapes``, an entry of ``k`` drafts per request slot) is paid before the
    pages too, like the slots.
    """
    if dp < 1 or dcp < 1:
        raise ValueError(f"dp and dcp must be >= 1, got {dp}, {dcp}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if kv_memory_bytes is None and num_pages is None:
        raise ValueError("plan_capacity needs kv_memory_bytes or num_pages")
    dtype = jnp.dtype(dtype)
    if snapshot_slots < 0:
        raise ValueError(f"snapshot_slots must be >= 0, got {snapshot_slots}")
    snap = dp * cdiv(snapshot_slots, dp)
    num_slots = dp * (cdiv(max_num_seqs, dp) + 1) + snap
    blocks = dp * dcp
    # per-unit costs straight from the model's own layout, so they cannot drift from it
    bytes_per_slot = cache_bytes(cfg, 1, 0, page_size, dtype, conv_groups)
    bytes_per_page = cache_bytes(cfg, 0, 1, page_size, dtype, conv_groups)
    if handoff_bytes < 0:
        raise ValueError(f"handoff_bytes must be >= 0, got {handoff_bytes}")
    slot_bytes = num_slots * bytes_per_slot
    journal_bytes = 0
    if num_speculative_tokens:
        from ....model.k3 import journal_shapes

        entries = num_slots - dp - snap
        journal_bytes = sum(int(np.prod(sh)) * jnp.dtype(d).itemsize
                            for sh, d in journal_shapes(cfg, entries, num_speculative_tokens, dtype))
    fixed = slot_bytes + handoff_bytes + journal_bytes  # paid before any page

    if num_pages is not None:
        if num_pages < blocks:
            raise ValueError(f"num_pages must be >= {blocks} (dp × dcp blocks), got {num_pages}")
        num_pages -= num_pages % blocks
        total = fixed + num_pages * bytes_per_page
        if kv_memory_bytes is not None and total > kv_memory_bytes:
            raise ValueError(f"cache of {num_slots} slots and {num_pages} pages (+ {handoff_bytes} bytes for P/D "
                             f"handoffs) needs {total} bytes, over the budget of {kv_memory_bytes} bytes")
    else:
        need = fixed + max_num_seqs * bytes_per_page
        if kv_memory_bytes < need:
            raise ValueError(
                f"kv_memory_bytes={kv_memory_bytes} cannot hold {max_num_seqs} sequences: "
                f"{num_slots} KDA slots ({bytes_per_slot} bytes each, incl. scratch) plus one "
                f"{page_size}-token MLA page per sequence ({bytes_per_page} bytes each)"
                + (f" plus {handoff_bytes} bytes set aside for P/D handoffs" if handoff_bytes else "")
                + f" need {need} bytes; raise the budget or lower max_num_seqs / page_size")
        if bytes_per_page == 0:
            tokens = cfg.max_position_embeddings or NOMINAL_TOKENS_PER_SEQ
            num_pages = max_num_seqs * cdiv(tokens, page_size)
        else:
            num_pages = (kv_memory_bytes - fixed) // bytes_per_page
        num_pages -= num_pages % blocks
        if num_pages < blocks:
            raise ValueError(f"kv_memory_bytes={kv_memory_bytes} leaves fewer pages than the {blocks} dp × dcp blocks")
    total = cache_bytes(cfg, num_slots, num_pages, page_size, dtype, conv_groups)
    return CapacityPlan(num_pages=int(num_pages), num_slots=num_slots, page_size=int(page_size),
                     bytes_per_page=bytes_per_page, bytes_per_slot=bytes_per_slot, total_bytes=total,
                     max_tokens_in_kv=int(num_pages) * int(page_size),
                     max_tokens_per_request=int(num_pages) // dp * int(page_size), max_concurrent_slots=num_slots - dp - snap,
                     dp=dp, dcp=dcp, snapshot_slots=snap, handoff_bytes=int(handoff_bytes),
                     journal_bytes=journal_bytes, conv_groups=conv_groups)
