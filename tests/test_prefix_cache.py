"""Prefix caching without a device: the scheduler + cache manager + prefix cache driven by
thousands of random operations, with a shadow of what every slot, snapshot and page would
hold on the device (the token prefix a KDA state is of; the token written at each page row).

Each step the shadow applies the queued copies exactly as ``flush_copies`` would (all sources
read before any destination is written) and the rows' writes; every scheduled row is then
checked: its slot holds the state of exactly ``tokens[:start]`` and its pages hold exactly
``tokens[:start]`` — so a wrong hit, a missing copy-on-write, a snapshot copied before it
was registered, or a page shared with a writer would all fail. After every step the pool
invariants hold (refcounts = requests' + the index's holds, snapshot slots accounted for,
the byte budget kept), and everything is free at the end.

Modes: synchronous (a row's token is on the host right after its step); **async** (one step
in flight, as ``Engine._step`` with async scheduling: the token arrives one step later, so
``Request.pending`` is set at plan time, decode rows read their input from the previous step
and stops/aborts land with a row on the device); **host tier** (``host_bytes > 0``: device
evictions are offloaded and deeper host hits reloaded, through shadow host-tier
operations)."""
from __future__ import annotations

import random
import types

import numpy as np
import pytest

from k3serve.intmath import pad_pow2
from k3serve.server.engine.cache import CacheManager, plan_capacity
from k3serve.server.engine.cache.prefix_keys import tenant_salt
from k3serve.server.engine.cache.prefix_cache import PrefixCache
from k3serve.server.engine.request import Request, Status
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.server.engine.scheduler import Scheduler


class ShadowManager(CacheManager):
    """A bookkeeping-only manager whose copies move shadow contents instead of device rows.

    ``host=True``: the host tier's dispatched offload, reload and drop move shadow contents
    too — an offload records what the evicted slot and pages hold at that point of the
    program order, a reload writes it into the request's pages and slot."""

    def __init__(self, *a, host: bool = False, **k):
        super().__init__(*a, allocate=False, **k)
        self.slot_state: dict[int, tuple] = {}  # slot -> token prefix its state is of
        self.page_rows: dict[int, list] = {}  # page -> token id per row (None = never written)
        if host:
            # not None, so the prefix cache offloads evictions; the shape the invariants check
            plan = self.capacity_plan
            self.device_cache = types.SimpleNamespace(num_slots=plan.num_slots, num_pages=plan.num_pages,
                                                      page_size=plan.page_size)
        self.num_reads = 0
        self.reloaded: dict = {}  # rid -> tokens reloaded from the host tier
        self.shadow_host: dict[int, tuple] = {}  # host-tier entry id -> (slot state, page rows)

    def flush_copies(self) -> int:
        pc, sc = list(self._page_copies), list(self._slot_copies)
        pages = {d: list(self.page_rows.get(s, [None] * self.page_size)) for s, d in pc}
        slots = {d: self.slot_state.get(s) for s, d in sc}
        self.page_rows.update(pages)
        self.slot_state.update(slots)
        dc, self.device_cache = self.device_cache, None  # the bookkeeping, no device program
        try:
            return super().flush_copies()
        finally:
            self.device_cache = dc

    def _run_offload(self, eid: int, slot: int, idx, tokens: int) -> int:
        ps = self.page_size
        rows = np.empty((len(idx), ps), object)  # as on the device: the pages padded with repeats
        for i, p in enumerate(idx):
            rows[i] = self.page_rows.get(int(p), [None] * ps)
        self.shadow_host[eid] = (self.slot_state.get(slot), rows)
        self.num_reads += 1
        return 16 + 8 * tokens  # the device's formula with 8-byte items: state, conv, a row per token

    def reload_prefix(self, rid, eid: int, tokens: int) -> None:
        self.reloaded[rid] = tokens
        super().reload_prefix(rid, eid, tokens)

    def _run_reload(self, eid: int, idx, pos0, slot: int, tokens: int) -> None:
        state, rows = self.shadow_host[eid]
        assert len(rows) == len(idx), "the reload writes as many pages as the offload read"
        for i, p in enumerate(idx):  # whole pages, nothing past the prefix
            self.page_rows[int(p)] = [rows[i, j] if pos0[i] + j < tokens else None for j in range(self.page_size)]
        self.slot_state[slot] = state

    def _run_drop(self, eid: int) -> None:
        del self.shadow_host[eid]


def _cfg():
    from k3serve.checkpoints.synthetic import k3_config
    from k3serve.model.config import K3Config

    return K3Config.from_dict(k3_config(vocab_size=256, hidden_size=32, num_hidden_layers=4, full_attn_layers=[4],
                                          kda_num_heads=1, kda_head_dim=8, mla_heads=1, q_lora_rank=8,
                                          kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                          num_experts=2, num_experts_per_token=1, num_shared_experts=1,
                                          moe_intermediate_size=32, routed_expert_hidden_size=32,
                                          intermediate_size=16, attn_res_block_size=2))


@pytest.mark.parametrize("seed,interval,budget_pages,dp,dcp", [(0, 0, None, 1, 1), (1, 8, 12, 1, 1), (2, 4, 6, 1, 1),
                                                               (3, 0, None, 2, 2)])
def test_prefix_cache_randomized_against_shadow(seed, interval, budget_pages, dp, dcp):
    """(dp, dcp) = (2, 2): two attention-DP groups with two DCP ranks each; a hit must join
    the group and DCP rank order of the pages it maps (checked by the manager's invariants:
    page k of every request in block group * dcp + (k + rank0) % dcp)."""
    _fuzz(seed, interval, budget_pages, dp, dcp)


@pytest.mark.parametrize("seed,interval,budget_pages,dp,dcp,num_pages", [(10, 0, None, 1, 1, 40), (11, 4, 6, 1, 1, 40),
                                                                         (12, 0, None, 2, 2, 40), (13, 4, None, 1, 1, 16)])
def test_prefix_cache_randomized_async(seed, interval, budget_pages, dp, dcp, num_pages):
    """One step in flight, as ``Engine._step`` with async scheduling: a row's sampled token
    reaches the host one ``step()`` later, so decode rows read their input from the previous
    step, registrations wait for the token, and stops and aborts land with a row in flight.
    16 pages: requests are preempted, some with a token on the device."""
    st = _fuzz(seed, interval, budget_pages, dp, dcp, async_=True, num_pages=num_pages)
    assert st["late"] > 20, st  # requests finished with a token still on the device
    if num_pages < 40:
        assert st["preempted_pending"] > 10, st


@pytest.mark.parametrize("seed,async_", [(20, False), (21, True)])
def test_prefix_cache_randomized_host_tier(seed, async_):
    """A small device budget and a host tier: evicted prefixes are offloaded (what the slot and
    pages hold at eviction) and deeper host hits reload them into the request's pages and slot;
    the row checks then prove a reload restores exactly the prefix's rows and state."""
    st = _fuzz(seed, 4, 6, 1, 1, async_=async_, host_bytes=8 * 400)
    assert st["prefix_host_offloads"] > 20 and st["prefix_host_reloads"] > 5, st
    assert st["host_rows"] > 5, st  # rows that started from a reloaded prefix were checked


def _fuzz(seed, interval, budget_pages, dp, dcp, *, async_=False, host_bytes=0, num_pages=40,
          steps=1500) -> dict:
    rng = random.Random(seed)
    cfg = _cfg()
    ps, unit = 8, 4
    cplan = plan_capacity(cfg, page_size=ps, dtype="float32", max_num_seqs=4, num_pages=num_pages, snapshot_slots=16,
                          dp=dp, dcp=dcp)
    mgr = ShadowManager(cfg, cplan, "float32", host=host_bytes > 0)
    max_bytes = None if budget_pages is None else budget_pages * cplan.bytes_per_page + 3 * cplan.bytes_per_slot
    pc = PrefixCache(mgr, unit=unit, interval=interval, max_bytes=max_bytes, host_bytes=host_bytes)
    sched = Scheduler(mgr, max_num_seqs=4, max_num_batched_tokens=24, chunk_size=12, max_model_len=80, prefix_cache=pc)
    bases = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    convs: list[list[int]] = []  # finished conversations, extended by later turns
    tenants = [b"", tenant_salt("a"), tenant_salt("b")]
    live: list[Request] = []
    on_device: dict[str, list[int]] = {}  # rid -> sampled tokens the host has not seen yet
    inflight = None  # (step, rows) launched and not yet processed (async)
    n_checked = n_hit_rows = n_late = n_host_rows = n_preempted_pending = 0

    def finish(req):  # Engine._finish
        sched.remove(req)
        req.status = Status.FINISHED

    def process(done):  # Engine._process: the step's sampled tokens reach the host
        nonlocal n_late
        _, rows = done
        for row in rows:
            req = row.req
            if not row.samples:
                continue
            req.pending -= 1
            tok = on_device[req.rid].pop(0)
            if req.finished:  # stopped late or aborted while the step ran: the token is dropped
                n_late += 1
                continue
            req.output.append(tok)
            if len(req.output) >= req.params.max_new_tokens or rng.random() < 0.05:
                finish(req)
                convs.append(req.prompt + req.output)
            else:
                pc.register_ready(req)

    for step in range(steps):
        # new arrivals: a fresh prompt on a shared base, the next turn of a finished one, or a resend
        for _ in range(rng.choice([0, 0, 1, 2])):
            kind = rng.random()
            if kind < 0.4 and convs:
                prompt = rng.choice(convs) + [rng.randrange(256) for _ in range(rng.randint(1, 6))]
            elif kind < 0.55 and convs:
                prompt = list(rng.choice(convs))
            else:
                prompt = rng.choice(bases)[: rng.randint(0, 40)] + [rng.randrange(256) for _ in range(rng.randint(1, 8))]
            prompt = prompt[-60:]
            req = Request(prompt=prompt, params=SamplingParams(max_new_tokens=rng.randint(1, 10), temperature=0),
                          salt=rng.choice(tenants))
            on_device[req.rid] = []
            sched.add(req)
            live.append(req)
        plan = sched.schedule()
        n_preempted_pending += sum(r.pending > 0 for r in plan.preempted)
        # the device: first the queued copies, then each row reads its slot/pages and writes
        mgr.flush_copies()
        launched = None
        if plan.rows:
            # the step: every row reads its state (a hit: from its snapshot slot) before any
            # state is written (its own slot, and the snapshots planned inside its chunk)
            snaps = pc.plan_snapshots(plan.rows, per_group=4 // dp)
            writes = {}
            for row in plan.rows:
                req, start, n = row.req, row.start, row.num_tokens
                if start + n > req.num_known:  # the runner's rule: only a decode row's input may be pending
                    assert (n == 1 and start == req.num_known and inflight is not None
                            and req.sample_row[0] == inflight[0]), f"step {step}: {req.rid} input not available"
                toks = req.prompt + req.output + on_device[req.rid]
                assert len(toks) == req.num_tokens
                slot = mgr.slot_of(req.rid)
                read = slot if req.read_slot is None else req.read_slot
                req.read_slot = None
                if start > 0:
                    assert mgr.slot_state.get(read) == tuple(toks[:start]), f"step {step}: {req.rid} state is not of its prefix"
                pages = mgr.pages_of(req.rid)
                for pos in range(start):
                    got = mgr.page_rows[pages[pos // ps]][pos % ps]
                    assert got == toks[pos], f"step {step}: {req.rid} row {pos} holds {got}, not {toks[pos]}"
                claimed = {(e[1], e[2] * unit % ps // unit) for e in pc.index._entries.values()}  # (page, unit in page)
                others = {p for r in live if r is not req and r.rid in mgr for p in mgr.pages_of(r.rid)}
                for pos in range(start, start + n):
                    page = pages[pos // ps]
                    assert page not in others, f"{req.rid} writes page {page}, which another request maps"
                    assert (page, pos % ps // unit) not in claimed, f"step {step}: {req.rid} writes row {pos} (start {start}, n {n}, pages {pages}, prompt {len(req.prompt)}, cached {req.cached_tokens}) the prefix cache holds"
                    mgr.page_rows.setdefault(pages[pos // ps], [None] * ps)[pos % ps] = toks[pos]
                writes[slot] = tuple(toks[: start + n])
                n_checked += 1
                n_hit_rows += start > 0 and req.cached_tokens and start == req.cached_tokens
                n_host_rows += start > 0 and start == mgr.reloaded.get(req.rid)
            for i, n_tok, snap_slot in snaps:
                row = plan.rows[i]
                assert 0 < n_tok <= row.num_tokens and snap_slot not in writes
                toks = row.req.prompt + row.req.output + on_device[row.req.rid]
                writes[snap_slot] = tuple(toks[: row.start + n_tok])
            mgr.slot_state.update(writes)
            pc.after_launch(plan.rows)
            for i, row in enumerate(plan.rows):  # what the engine does after the launch
                req = row.req
                req.num_computed += row.num_tokens
                if row.samples:
                    on_device[req.rid].append(rng.randrange(256))  # sampled on the device
                    req.pending += 1
                    req.sample_row = (step, i)
            launched = (step, plan.rows)
        done, inflight = (inflight, launched) if async_ else (launched, None)
        if done is not None:
            process(done)
        if pc.host is not None:
            mgr.drain_host()
            # every process's copies are exactly the index's entries: none leaked, none missing
            assert set(mgr.shadow_host) == {e.eid for e in pc.host._entries.values()}
        if live and rng.random() < 0.03:  # abort someone (Engine.abort)
            req = rng.choice(live)
            if not req.finished:
                finish(req)
        live = [r for r in live if not r.finished]
        pc.check_invariants()
        if max_bytes is not None:
            assert pc.index.bytes_held <= max_bytes
    for req in live:
        sched.remove(req)
    pc.index.evict_all()
    pc.check_invariants()
    assert mgr.num_free_pages == cplan.num_pages and mgr.slots.num_free_snapshots == cplan.snapshot_slots
    st = pc.stats()
    assert st["prefix_hits"] > 10 and st["snapshots_registered"] > 100, st
    assert st["prefix_cow_pages"] > 0 and n_checked > 1000, (st, n_checked)
    if budget_pages is not None:
        assert st["snapshots_evicted"] > 0
    return {**st, "late": n_late, "host_rows": n_host_rows, "preempted_pending": n_preempted_pending}
