"""Warm-up of the engine's small programs: which ones this configuration can call while
serving, at which index lengths, compiled before the first request.

Why: besides the step and sampling programs (``Runner.warmup``), serving calls small
programs whose index vectors vary in length — cache page and slot copies (prefix hits),
host-tier reads and loads, P/D exports, imports and cuts — and the token-table row write
(penalties). Each length is a separate compile, and a compile on the engine thread stalls
every running request. Lengths are padded to a fixed set (``programs.pow2_widths`` /
``sparse_widths``), so the set is known up front and compiled here, and only for features
the configuration turns on:

* always: the token-table row write (one program);
* prefix caching: page and slot copies at ``CacheManager.copy_widths``;
* the host tier: reads and loads of ``1, 2, 4, …`` pages up to the page-table width;
* P/D prefill: reads (the export) at those widths, and the cuts (``deal.warm_cuts``);
* P/D decode: loads of ``dp * dcp * Pb`` pages (``HandoffTarget.load_index``).
"""
from __future__ import annotations

from ...intmath import cdiv
from .cache import deal
from .programs import pow2_widths


def small_program_widths(engine, pd_role: str | None) -> dict[str, list[int]]:
    """``{"read": [...], "load": [...]}``: page counts the cache reads and loads are called with."""
    pages = pow2_widths(engine.runner.page_width)
    read, load = set(), set()
    if engine.prefix_cache is not None and engine.prefix_cache.host is not None:
        read.update(pages)
        load.update(pages)
    if pd_role == "prefill":
        read.update(pages)
    elif pd_role == "decode":
        mgr = engine.cache_mgr
        load.update(mgr.dp * mgr.dcp * pb for pb in pow2_widths(cdiv(engine.runner.page_width, mgr.dcp)))
    return {"read": sorted(read), "load": sorted(load)}


def warm_small_programs(engine, pd_role: str | None) -> int:
    """Compile (by running once, harmlessly) every small program ``engine`` can call while
    serving; returns how many compiled."""
    runner, mgr = engine.runner, engine.cache_mgr
    before = runner.num_compiles
    runner.warm_table_row()
    widths = small_program_widths(engine, pd_role)
    mgr.warm_programs(copies=engine.prefix_cache is not None, **widths)
    if pd_role == "prefill" and mgr.device_cache is not None:
        import jax.numpy as jnp
        import numpy as np

        slot = jnp.int32(mgr.scratch_slot(0))
        if mgr.spans_processes:  # multi-host: the export is replicated, each process cuts its local copy
            exports = [tuple(a.addressable_shards[0].data for a in mgr._program("read_replicated")(
                mgr.device_cache, slot, jnp.asarray(np.zeros(w, np.int32)))) for w in widths["read"]]
        else:
            exports = [mgr._program("read")(mgr.device_cache, slot, jnp.asarray(np.zeros(w, np.int32)))
                       for w in widths["read"]]
        deal.warm_cuts(exports)
    runner.warm_fixed += runner.num_compiles - before
    return runner.num_compiles - before
