"""Prefix caching without a device: the scheduler + cache manager + prefix cache driven by
thousands of random operations, with a shadow of what every slot, snapshot and page would
hold on the device (the token prefix a KDA state is of; the token written at each page row).

Each step the shadow applies the queued copies exactly as ``flush_copies`` would (all sources
read before any destination is written) and the rows' writes; every scheduled row is then
checked: its slot holds the state of exactly ``tokens[:start]`` and its pages hold exactly
``tokens[:start]`` — so a wrong hit, a missing copy-on-write, a snapshot copied before it
was registered, or a page shared with a writer would all fail. After every step the pool
invariants hold (refcounts = requests' + the index's holds, snapshot slots accounted for,
the byte budget kept), and everything is free at the end."""
from __future__ import annotations

import random

import pytest

from k3serve.server.engine.cache import CacheManager, plan_capacity
from k3serve.server.engine.cache.prefix_keys import tenant_salt
from k3serve.server.engine.cache.prefix_cache import PrefixCache
from k3serve.server.engine.request import Request, Status
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.server.engine.scheduler import Scheduler


class ShadowManager(CacheManager):
    """A bookkeeping-only manager whose copies move shadow contents instead of device rows."""

    def __init__(self, *a, **k):
        super().__init__(*a, allocate=False, **k)
        self.slot_state: dict[int, tuple] = {}  # slot -> token prefix its state is of
        self.page_rows: dict[int, list] = {}  # page -> token id per row (None = never written)

    def flush_copies(self) -> int:
        pc, sc = list(self._page_copies), list(self._slot_copies)
        pages = {d: list(self.page_rows.get(s, [None] * self.page_size)) for s, d in pc}
        slots = {d: self.slot_state.get(s) for s, d in sc}
        self.page_rows.update(pages)
        self.slot_state.update(slots)
        return super().flush_copies()


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
    rng = random.Random(seed)
    cfg = _cfg()
    ps, unit = 8, 4
    cplan = plan_capacity(cfg, page_size=ps, dtype="float32", max_num_seqs=4, num_pages=40, snapshot_slots=16,
                          dp=dp, dcp=dcp)
    mgr = ShadowManager(cfg, cplan, "float32")
    max_bytes = None if budget_pages is None else budget_pages * cplan.bytes_per_page + 3 * cplan.bytes_per_slot
    pc = PrefixCache(mgr, unit=unit, interval=interval, max_bytes=max_bytes)
    sched = Scheduler(mgr, max_num_seqs=4, max_num_batched_tokens=24, chunk_size=12, max_model_len=80, prefix_cache=pc)
    bases = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    convs: list[list[int]] = []  # finished conversations, extended by later turns
    tenants = [b"", tenant_salt("a"), tenant_salt("b")]
    live: list[Request] = []
    n_checked = n_hit_rows = 0
    for step in range(1500):
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
            sched.add(req)
            live.append(req)
        plan = sched.schedule()
        # the device: first the queued copies, then each row reads its slot/pages and writes
        mgr.flush_copies()
        for row in plan.rows:
            req, start, n = row.req, row.start, row.num_tokens
            toks = req.prompt + req.output + [None] * req.pending
            slot = mgr.slot_of(req.rid)
            if start > 0:
                assert mgr.slot_state.get(slot) == tuple(toks[:start]), f"step {step}: {req.rid} state is not of its prefix"
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
            mgr.slot_state[slot] = tuple(toks[: start + n])
            req.num_computed += n  # what the engine does at launch
            n_checked += 1
            n_hit_rows += start > 0 and req.cached_tokens and start == req.cached_tokens
        pc.after_launch(plan.rows)
        # the host: sampled tokens arrive, stops, aborts
        for row in plan.rows:
            if row.samples:
                row.req.output.append(rng.randrange(256))
        for row in plan.rows:
            req = row.req
            if req.finished:
                continue
            if row.samples and (len(req.output) >= req.params.max_new_tokens or rng.random() < 0.05):
                sched.remove(req)
                req.status = Status.FINISHED
                convs.append(req.prompt + req.output)
            else:
                pc.register_ready(req)
        if live and rng.random() < 0.03:  # abort someone
            req = rng.choice(live)
            if not req.finished:
                sched.remove(req)
                req.status = Status.FINISHED
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
