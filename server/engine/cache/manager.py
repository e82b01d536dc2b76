"""The per-request cache bookkeeping the scheduler and runner share, and the device cache.

Why this split: the device ``Cache`` (``k3serve.model.cache``) is just three arrays; which
slot and which pages a request owns is host-side state that the scheduler must consult
before admitting or growing a request, and that the runner turns into ``slot_ids`` and
``page_table`` rows each step. Keeping both here, behind one small API, means finish,
abort and preemption all go through the same ``release`` and cannot leak pages or slots;
``check_invariants`` makes that checkable.

Capacity planning (how many slots and pages a budget buys) is in ``planning.py``; the
device copy programs are in ``device_ops.py``. They are jitted through the engine's
``programs.Programs`` (counted in ``num_compiles``) and compiled at warm-up for every index
length serving can give them (:meth:`CacheManager.warm_programs`).

Device layout (allocated by ``allocate_cache`` with the plan's sizes):
  kda_state [nK, num_slots, H, dk, dv]      float32, slot 0 = scratch (padding rows)
  kda_conv  [nK, num_slots, (W-1)*3*H, dk]  float32 (``model.cache.conv_pool_rows``)
  mla_kv    [nM, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]   model dtype

The device cache is *committed* to its devices from the start (:func:`committed`), so every
program's output is too. Why: jax keys a compiled program by whether each input is committed
(not only by shapes and shardings), and a step lowered on an uncommitted cache returns an
uncommitted one, while the copy and load programs (``out_shardings``) return committed ones.
The cache would then reach a read or a load in either state depending on which program ran
last, and the one warm-up did not see would compile again while serving.

Single-threaded by design: the engine loop owns the manager.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping

import jax.numpy as jnp
import numpy as np

from ....intmath import cdiv, next_pow2, pad_pow2
from ....model.cache import allocate_cache, cache_bytes, conv_groups_of, conv_window_shape

from ..programs import Programs, sparse_widths, width_for
from .device_ops import PROGRAMS, splits_of
from .host import HostCopy
from .pages import PagePool
from .planning import CapacityPlan
from .slots import SCRATCH, SlotPool


def committed(tree):
    """``tree``'s arrays committed to the devices they are on (no copy)."""
    import jax

    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), tree)


def _padded(xs, width: int) -> np.ndarray:
    """``xs`` as int32 padded to ``width`` with repeats of its first entry (the same index
    copied or written twice writes the same value)."""
    xs = list(xs)
    return np.asarray(xs + [xs[0]] * (width - len(xs)), np.int32)


@dataclasses.dataclass
class _Request:
    slot: int
    pages: list[int]
    group: int = 0
    rank0: int = 0  # DCP rank of the sequence's first page (page k on rank (k + rank0) mod dcp)
    shared: int = 0  # leading pages mapped from the prefix cache (map_shared): read-only


class CacheManager:
    """The device cache plus who owns which slot and pages.

    ``self.device_cache`` is the live device ``Cache``; the runner replaces it after each step
    (``cache_mgr.device_cache = new_cache``). ``allocate=False`` keeps only the bookkeeping
    (scheduler tests, planning) and leaves ``device_cache`` as None.
    """

    def __init__(self, cfg, plan: CapacityPlan, dtype, *, allocate: bool = True, dispatch=None,
                 programs: Programs | None = None):
        from ..dispatch import LocalDispatch

        dtype = jnp.dtype(dtype)
        expect = cache_bytes(cfg, plan.num_slots, plan.num_pages, plan.page_size, dtype, plan.conv_groups)
        if expect != plan.total_bytes:
            raise ValueError(f"plan does not match this config/dtype ({dtype}): it budgets "
                             f"{plan.total_bytes} bytes, the cache would take {expect}")
        self.cfg, self.capacity_plan, self.dtype = cfg, plan, dtype
        self.page_size = plan.page_size
        self.dp, self.dcp = plan.dp, plan.dcp
        self.pages = PagePool(plan.num_pages, plan.dp * plan.dcp)
        self.slots = SlotPool(plan.num_slots, plan.dp, plan.snapshot_slots)
        self._reqs: dict[Hashable, _Request] = {}
        self._page_copies: list[tuple[int, int]] = []  # (src page, dst page), dispatched by flush_copies
        self._slot_copies: list[tuple[int, int]] = []  # (src slot, dst slot)
        self._copy_fns: dict = {}
        self.programs = programs if programs is not None else Programs()  # counts every jit of the engine
        # index lengths of one copy program call: the copies queued between two flushes come
        # from the admissions of one schedule, at most one page and one slot copy per request
        self.copy_widths = sparse_widths(plan.max_concurrent_slots)
        self.num_copies = 0
        self.device_cache = (committed(allocate_cache(cfg, plan.num_slots, plan.num_pages, plan.page_size, dtype,
                                                      plan.conv_groups))
                             if allocate else None)
        self.dispatch = dispatch if dispatch is not None else LocalDispatch()
        self.dispatch.register("cache_copy", self._run_copy)
        self.dispatch.register("host_offload", self._run_offload)
        self.dispatch.register("host_reload", self._run_reload)
        self.dispatch.register("host_drop", self._run_drop)
        self._host: dict[int, HostCopy] = {}  # this process's parts of host-tier entries, by entry id
        self._next_eid = 0

    # ------------------------------------------------------------------ per request
    def admit(self, rid: Hashable, group: int | None = None, rank0: int | None = None) -> bool:
        """Give ``rid`` a slot and no pages; False if no slot is free.

        Under attention DP the request joins ``group``, or by default the group with the most
        free slots (ties: the most free pages) — the balance by load. ``rank0`` fixes the DCP
        rank of its first page (a prefix hit must continue the layout of the pages it maps)."""
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already admitted")
        if group is None:
            group = max(range(self.dp), key=lambda g: (self.slots.num_free_in(g), self.free_pages_in(g), -g))
        slot = self.slots.alloc(group)
        if slot is None:
            return False
        # start the round-robin on the group's DCP rank with the most free pages, so short
        # sequences do not all pile onto rank 0
        if rank0 is None:
            rank0 = max(range(self.dcp), key=lambda r: (self.pages.num_free_in(group * self.dcp + r), -r))
        self._reqs[rid] = _Request(slot, [], group, rank0)
        return True

    def placement_of_page(self, page: int, k: int) -> tuple[int, int]:
        """(group, rank0) a request must have for ``page`` to be its page number ``k``."""
        block = self.pages.block_of(page)
        return block // self.dcp, (block % self.dcp - k) % self.dcp

    def placement_of(self, rid: Hashable) -> tuple[int, int]:
        """(group, rank0) of ``rid``: where its page k lives is block group * dcp + (k + rank0) % dcp."""
        req = self._req(rid)
        return req.group, req.rank0

    def map_shared(self, rid: Hashable, pages: list[int]) -> None:
        """Map already-written ``pages`` (read-only, refcounted) as ``rid``'s first pages."""
        req = self._req(rid)
        if req.pages:
            raise ValueError(f"request {rid!r} already holds pages")
        for k, p in enumerate(pages):
            if self.pages.block_of(p) != self.block_for(req, k):
                raise ValueError(f"page {p} cannot be page {k} of request {rid!r} (wrong DCP/DP block)")
        self.pages.incref(pages)
        req.pages.extend(pages)
        req.shared = len(pages)

    def copy_on_write(self, rid: Hashable, src_page: int) -> bool:
        """Give ``rid`` a fresh next page holding a copy of ``src_page``'s rows (a shared, partly
        filled tail page it is about to write into); False if no page is free in its block."""
        req = self._req(rid)
        new = self.pages.alloc_in([self.block_for(req, len(req.pages))])
        if new is None:
            return False
        req.pages.extend(new)
        self._page_copies.append((src_page, new[0]))
        return True

    def copy_slot(self, src: int, dst: int) -> None:
        """Queue a copy of KDA slot ``src`` (state + conv window) onto slot ``dst``."""
        self._slot_copies.append((src, dst))

    def flush_copies(self) -> int:
        """Dispatch the queued page and slot copies (in one device program each, in the order
        the device sees the cache: after every step launched so far, before the next). All
        sources are read before any destination is written. Returns the copies made."""
        n = len(self._page_copies) + len(self._slot_copies)
        if self.device_cache is None:  # bookkeeping only (no device cache)
            self._page_copies.clear()
            self._slot_copies.clear()
            return n
        # more copies than the widest program (never from one schedule's admissions) go in
        # several calls: sources (prefix-cache pages, request slots) and destinations (fresh
        # pages, snapshot slots) are disjoint, so the order between calls does not matter
        widest = self.copy_widths[-1]
        for name, copies in (("pages", self._page_copies), ("slots", self._slot_copies)):
            for i in range(0, len(copies), widest):
                src, dst = zip(*copies[i:i + widest])
                w = width_for(len(src), self.copy_widths)
                self.dispatch("cache_copy", name, _padded(src, w), _padded(dst, w))
            copies.clear()
        self.num_copies += n
        return n

    def _run_copy(self, name: str, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy pages or slots (``name``: "pages", "slots") ``src`` onto ``dst``, index arrays
        padded to one of ``copy_widths`` with repeats of the first copy (identical writes,
        defined) — the dispatched operation "cache_copy"."""
        if name not in ("pages", "slots"):
            raise ValueError(f"no cache copy program {name!r}")
        self.device_cache = self._program(name)(self.device_cache, jnp.asarray(src), jnp.asarray(dst))

    # ------------------------------------------------------------------ host tier copies
    def offload_prefix(self, slot: int, pages: list[int], tokens: int) -> tuple[int, int]:
        """Copy snapshot ``slot`` and the ``pages`` of a ``tokens``-long prefix out for the
        host tier (dispatched: every process keeps its own shards). Returns (entry id, bytes
        of the entry). Dispatched now, so it reads what those hold after every launched step."""
        eid = self._next_eid
        self._next_eid += 1
        nbytes = self.dispatch("host_offload", eid, slot, np.asarray(pad_pow2(pages), np.int32), tokens)
        return eid, nbytes

    def reload_prefix(self, rid: Hashable, eid: int, tokens: int) -> None:
        """Write host-tier entry ``eid`` (a ``tokens``-long prefix) into ``rid``'s pages, which
        must cover it, and its slot."""
        req = self._req(rid)
        idx, pos0 = self._prefix_index(req, tokens)  # padded as the offload gathered them
        self.flush_copies()
        self.dispatch("host_reload", eid, idx, pos0, req.slot, tokens)

    def drop_host(self, eid: int) -> None:
        """Host-tier entry ``eid`` left the tier: every process frees its copy."""
        self.dispatch("host_drop", eid)

    def drain_host(self) -> None:
        """Move this process's finished offload copies to host memory (device memory is given
        back). Local: each process drains its own copies whenever it likes."""
        for c in self._host.values():
            if not c.on_host and c.ready():
                c.to_host()

    def _run_offload(self, eid: int, slot: int, idx: np.ndarray, tokens: int) -> int:
        state, conv, rows = self._program("read")(self.device_cache, jnp.int32(slot), jnp.asarray(idx))
        self._host[eid] = HostCopy((state, conv, rows))
        row_bytes = rows.shape[0] * rows.shape[-1] * rows.dtype.itemsize
        return sum(int(a.size) * a.dtype.itemsize for a in (state, conv)) + tokens * row_bytes

    def _run_reload(self, eid: int, idx: np.ndarray, pos0: np.ndarray, slot: int, tokens: int) -> None:
        self._load(self._host[eid].device_arrays(), idx, pos0, slot, tokens, f"host entry {eid}")

    def _load(self, arrays, idx: np.ndarray, pos0: np.ndarray, slot: int, tokens: int, what: str) -> None:
        state, conv, rows = arrays
        if rows.shape[1] != len(idx):
            raise ValueError(f"{what} holds {rows.shape[1]} pages, the load writes {len(idx)}")
        self.device_cache = self._program("load")(self.device_cache, jnp.asarray(idx), jnp.asarray(pos0), rows,
                                                  jnp.int32(tokens), jnp.int32(slot), state, conv)

    # ------------------------------------------------------------------ P/D handoff (one process)
    def _prefix_index(self, req: _Request, tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``ceil(tokens / page_size)`` pages of ``req`` padded to a power of two with
        repeats of the first (the same gather or write), and each page's first position."""
        P = cdiv(tokens, self.page_size)
        if len(req.pages) < P:
            raise ValueError(f"the request holds {len(req.pages)} pages, fewer than the {P} of {tokens} tokens")
        idx = np.asarray(pad_pow2(req.pages[:P]), np.int32)
        pos0 = np.asarray(pad_pow2([p * self.page_size for p in range(P)]), np.int32)
        return idx, pos0

    def export_request(self, rid: Hashable, tokens: int) -> tuple:
        """``rid``'s KDA state and conv window (its slot) and the MLA rows of its first
        ``tokens`` tokens, as new device arrays ``(state [nK, H, dk, dv], conv [nK, W-1, 3P],
        rows [nM, P', page_size, W])`` in page order, whatever this cache's layout (``P'``:
        pages padded to a power of two). Dispatched after every step launched so far, so the
        request may be released right after. ``deal.py`` cuts it for the decode's layout."""
        if self.dispatch.num_processes > 1:
            raise NotImplementedError("a P/D handoff out of a multi-process engine is not supported yet")
        req = self._req(rid)
        self.flush_copies()
        idx, _ = self._prefix_index(req, tokens)
        # under multi-host every process gets the whole export (on each of its devices), so
        # that it can cut the pieces it stages by itself (deal.cut_local_pieces)
        name = "read_replicated" if self.spans_processes else "read"
        return self._program(name)(self.device_cache, jnp.int32(req.slot), jnp.asarray(idx))

    @property
    def spans_processes(self) -> bool:
        """The cache lives on the devices of more than one process (multi-host)."""
        return self.device_cache is not None and len(
            {d.process_index for d in self.device_cache.mla_kv.sharding.device_set}) > 1

    def handoff_target(self, rid: Hashable, tokens: int):
        """What ``rid``'s reservation needs of a ``tokens``-token handoff, laid out for this
        cache (``deal.HandoffTarget``: the destination to send the prefill, where to pull each
        piece, the load's block-order index). A pure function of the reservation. Pages the
        request maps from this engine's prefix cache are neither asked for nor written."""
        from .deal import Destination, without_slot_axis

        req = self._req(rid)
        n = cdiv(tokens, self.page_size)
        if len(req.pages) < n:
            raise ValueError(f"the request holds {len(req.pages)} pages, fewer than the {n} of {tokens} tokens")
        group_blocks = tuple(req.group * self.dcp + r for r in range(self.dcp))
        per = [[k for k in range(req.shared, n) if self.block_for(req, k) == b] for b in group_blocks]
        pb = next_pow2(max(1, max(len(x) for x in per)))
        st = self.device_cache.kda_state
        shape = (st.shape[0],) + st.shape[2:]
        heads = {(sl[1].start or 0, sl[1].stop or shape[1])
                 for sl in without_slot_axis(st.sharding, st.ndim).devices_indices_map(shape).values()}
        dest = Destination(first_page=req.shared, head_count=next(iter(heads))[1] - next(iter(heads))[0],
                           head_starts=tuple(sorted(h for h, _ in heads)),
                           page_lists=tuple(tuple(x + [-1] * (pb - len(x))) for x in per))
        index = np.full(self.dp * self.dcp * pb, self.pages.num_pages, np.int32)  # past the pool: dropped
        pos0 = np.zeros_like(index)
        for b, pages in zip(group_blocks, per):
            index[b * pb: b * pb + len(pages)] = [req.pages[k] for k in pages]
            pos0[b * pb: b * pb + len(pages)] = [k * self.page_size for k in pages]
        target = self.target_for(dest, group_blocks, index, pos0)
        if self.spans_processes:  # each process that needs a piece pulls its own copy
            target.dest = dataclasses.replace(dest, pulls=tuple(len(r) for r in target.readers()))
        return target

    def target_for(self, dest, group_blocks: tuple, index: np.ndarray, pos0: np.ndarray):
        """The ``deal.HandoffTarget`` of ``dest`` on this cache (its load's shapes and
        shardings), the load writing block-order row i to page ``index[i]`` — what every
        process of a multi-host decode rebuilds from the leader's ``handoff_target``."""
        from .deal import HandoffTarget, replicated, without_slot_axis

        cache = self.device_cache
        st, cv, kv = cache.kda_state, cache.kda_conv, cache.mla_kv
        pb = dest.pages_per_block
        shapes = ((st.shape[0],) + st.shape[2:], conv_window_shape(self.cfg, st.shape[0]),
                  (kv.shape[0], self.dp * self.dcp * pb) + kv.shape[2:])
        # the conv window comes whole (q|k|v order) to every device; the load deals its channels
        shardings = (without_slot_axis(st.sharding, st.ndim), replicated(cv.sharding), kv.sharding)
        return HandoffTarget(dest, shapes, (st.dtype, cv.dtype, kv.dtype), shardings, tuple(group_blocks), index, pos0)

    def import_request(self, rid: Hashable, arrays: tuple, tokens: int, destination=None) -> None:
        """Write a handoff into ``rid``'s pages, which must cover ``tokens``, and its slot:
        ``arrays`` either an :meth:`export_request` of another engine (same model and page
        size, any layout; dealt here) or, with ``destination``, the load inputs
        ``deal.HandoffTarget.assemble`` built from pieces cut for that destination."""
        if self.dispatch.num_processes > 1:
            raise NotImplementedError("a P/D handoff into a multi-process engine is not supported yet")
        from .deal import cut_pieces

        req = self._req(rid)
        target = self.handoff_target(rid, tokens)
        if destination is None:  # cut and put together here (one device cuts; assemble copies)
            arrays = target.assemble(cut_pieces(arrays, target.dest, target.pull_devices()[:1]))
        elif destination != target.dest:
            raise ValueError("the handoff was cut for another reservation than this request holds")
        self.flush_copies()
        self._load(arrays, target.load_index, target.load_pos0, req.slot, tokens, "the handoff")

    def _run_drop(self, eid: int) -> None:
        self._host.pop(eid, None)

    def _program(self, name: str):
        """The jitted cache program ``name`` (``PROGRAMS``), built once and counted in
        ``programs`` as ``cache_<name>``. Programs that return a cache donate it and keep the
        layout the step expects (its shardings)."""
        fn = self._copy_fns.get(name)
        if fn is None:
            import jax

            import functools

            body, writes = PROGRAMS["read" if name == "read_replicated" else name]
            if name in ("read", "read_replicated", "load"):  # the conv window leaves and comes back in q|k|v order
                body = functools.partial(body, conv_groups=conv_groups_of(self.device_cache.kda_conv),
                                         window=self.cfg.conv_kernel_size - 1)
            body = functools.partial(body, **splits_of(self.device_cache))  # rows read and written where they live
            kw = (dict(donate_argnums=0, out_shardings=jax.tree.map(lambda a: a.sharding, self.device_cache))
                  if writes else {})
            if name == "read_replicated":
                from .deal import replicated

                kw = dict(out_shardings=replicated(self.device_cache.mla_kv.sharding))
            fn = self._copy_fns[name] = self.programs.jit(body, f"cache_{name}", **kw)
        return fn

    def warm_programs(self, *, copies: bool, read: list[int] = (), load: list[int] = ()) -> None:
        """Compile the cache programs serving will call, at each index length it can give
        them, by running them once on harmless indices (warm-up; not dispatched: every process
        runs it by itself). ``copies``: the page and slot copies of prefix caching, at
        ``copy_widths``; ``read`` / ``load``: the page counts (padded) that host-tier offloads
        and P/D exports read, and host-tier reloads and P/D imports write.

        The copies write page 0 and the scratch slot onto themselves; a read gathers page 0;
        a load drops its pages (an index past the pool) and writes the scratch slot's own
        state back, so the cache is unchanged."""
        if self.device_cache is None:
            return
        scratch = self.scratch_slot(0)
        if copies:
            for w in self.copy_widths:
                self._run_copy("pages", _padded([0], w), _padded([0], w))
                self._run_copy("slots", _padded([scratch], w), _padded([scratch], w))
        import jax

        for w in sorted(set(read) | set(load)):
            idx = np.zeros(w, np.int32)
            copy = HostCopy(self._program("read")(self.device_cache, jnp.int32(scratch), jnp.asarray(idx)))
            if w in load:  # as a reload gets them: still on the device, and back from host memory
                drop = np.full(w, self.pages.num_pages, np.int32)
                for _ in range(2):
                    self._load(copy.device_arrays(), drop, np.zeros(w, np.int32), scratch, 0, "warm-up")
                    copy.to_host()
        jax.block_until_ready(self.device_cache)

    def block_for(self, req: _Request, k: int) -> int:
        return req.group * self.dcp + (k + req.rank0) % self.dcp

    def free_pages_in(self, group: int) -> int:
        return sum(self.pages.num_free_in(group * self.dcp + r) for r in range(self.dcp))

    def group_of(self, rid: Hashable) -> int:
        return self._req(rid).group

    def scratch_slot(self, group: int = 0) -> int:
        """The slot padding rows of DP group ``group`` point at."""
        return self.slots.scratch_of(group)

    def pages_needed(self, rid: Hashable, total_tokens: int) -> int:
        """Extra pages ``rid`` needs to hold ``total_tokens`` (0 if it already can)."""
        have = len(self._req(rid).pages)
        return max(0, cdiv(max(total_tokens, 0), self.page_size) - have)

    def ensure_tokens(self, rid: Hashable, total_tokens: int) -> bool:
        """Grow ``rid``'s pages to cover ``total_tokens``; all or nothing. Never shrinks."""
        n = self.pages_needed(rid, total_tokens)
        if n == 0:
            return True
        req = self._reqs[rid]
        have = len(req.pages)
        # page k of the sequence lives on DCP rank (k + rank0) mod dcp of the request's group
        new = self.pages.alloc_in([self.block_for(req, k) for k in range(have, have + n)])
        if new is None:
            return False
        req.pages.extend(new)
        return True

    def release(self, rid: Hashable) -> None:
        """Return ``rid``'s pages (decref) and slot. Finish, abort and preemption alike."""
        req = self._reqs.pop(rid)  # KeyError for an unknown rid
        # a copy queued into what it gives back must not land after the next owner's
        if self._page_copies:
            gone = set(req.pages)
            self._page_copies = [c for c in self._page_copies if c[1] not in gone or self.pages.refcount(c[1]) > 1]
        self._slot_copies = [c for c in self._slot_copies if c[1] != req.slot]
        self.pages.decref(req.pages)
        self.slots.free(req.slot)

    def pages_of(self, rid: Hashable) -> list[int]:
        return list(self._req(rid).pages)

    def slot_of(self, rid: Hashable) -> int:
        return self._req(rid).slot

    def page_table_row(self, rid: Hashable, width: int) -> np.ndarray:
        """``rid``'s pages in order, padded with page 0 (masked reads) to ``width``; int32."""
        pages = self._req(rid).pages
        if len(pages) > width:
            raise ValueError(f"request {rid!r} holds {len(pages)} pages, more than the page-table width {width}")
        row = np.zeros((width,), np.int32)
        row[: len(pages)] = pages
        return row

    def page_table(self, rids: Iterable[Hashable | None], width: int) -> np.ndarray:
        """``[len(rids), width]`` int32; a None entry is a padding row (all page 0)."""
        rids = list(rids)
        out = np.zeros((len(rids), width), np.int32)
        for i, rid in enumerate(rids):
            if rid is not None:
                out[i] = self.page_table_row(rid, width)
        return out

    def slot_ids(self, rids: Iterable[Hashable | None]) -> np.ndarray:
        """``[len(rids)]`` int32 slots; a None entry is a padding row (the scratch slot)."""
        return np.asarray([self.scratch_slot(0) if r is None else self._req(r).slot for r in rids], np.int32)

    def live_requests(self) -> list[Hashable]:
        return list(self._reqs)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._reqs

    def _req(self, rid: Hashable) -> _Request:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"unknown request {rid!r}") from None

    # ------------------------------------------------------------------ totals
    @property
    def num_free_pages(self) -> int:
        return self.pages.num_free

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def capacity(self) -> dict:
        p = self.capacity_plan
        return {"max_tokens_in_kv": p.max_tokens_in_kv, "max_concurrent_slots": p.max_concurrent_slots,
                "max_tokens_per_request": p.max_tokens_per_request, "dp": p.dp, "dcp": p.dcp,
                "page_size": p.page_size, "num_pages": p.num_pages, "num_slots": p.num_slots,
                "total_bytes": p.total_bytes}

    def check_invariants(self, extra_page_refs: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError unless pools and per-request state agree.

        ``extra_page_refs`` counts holders outside the live requests (e.g. a prefix cache).
        """
        self.pages.check_invariants()
        self.slots.check_invariants()
        holders: Counter[int] = Counter({p: k for p, k in (extra_page_refs or {}).items() if k})
        slots_seen: dict[int, Hashable] = {}
        for rid, req in self._reqs.items():
            assert len(set(req.pages)) == len(req.pages), f"request {rid!r} holds a page twice: {req.pages}"
            holders.update(req.pages)
            assert req.slot % self.slots.per_group != SCRATCH, f"request {rid!r} holds a scratch slot"
            assert self.slots.group_of(req.slot) == req.group, f"request {rid!r} holds a slot of another group"
            for k, p in enumerate(req.pages):
                want = self.block_for(req, k)
                assert self.pages.block_of(p) == want, f"request {rid!r}: page {k} is in block {self.pages.block_of(p)}, not {want}"
            assert req.slot not in slots_seen, f"slot {req.slot} held by both {slots_seen[req.slot]!r} and {rid!r}"
            assert self.slots.is_used(req.slot), f"request {rid!r} holds slot {req.slot}, which the pool marks free"
            slots_seen[req.slot] = rid
        for p in range(self.pages.num_pages):
            r = self.pages.refcount(p)
            assert r == holders.get(p, 0), f"page {p}: refcount {r}, but {holders.get(p, 0)} holders"
        assert self.pages.num_free + self.pages.num_used == self.pages.num_pages, "page counts do not add up"
        assert self.pages.num_used == len(holders), f"{self.pages.num_used} pages in use, {len(holders)} held"
        assert self.slots.num_used == len(self._reqs), f"{self.slots.num_used} slots in use for {len(self._reqs)} requests"
        if self.device_cache is not None:
            c = self.device_cache
            assert (c.num_slots, c.num_pages, c.page_size) == (self.capacity_plan.num_slots, self.capacity_plan.num_pages, self.page_size), \
                f"device cache (slots, pages, page_size) = {(c.num_slots, c.num_pages, c.page_size)} differs from the plan"
