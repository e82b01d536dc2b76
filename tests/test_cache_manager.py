"""Cache bookkeeping: page and slot pools, capacity planning, and a fuzz of the request
lifecycle (admit / extend / finish / abort / preempt) checked against the invariants after
every operation."""
from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.model import k3_full, k3_small
from k3serve.server.engine.cache import SCRATCH, CacheManager, CapacityPlan, PagePool, SlotPool, plan_capacity

GiB = 1 << 30


# ---------------------------------------------------------------------- PagePool
def test_page_pool_alloc_is_all_or_nothing():
    pool = PagePool(5)
    a = pool.alloc(3)
    assert a is not None and len(set(a)) == 3 and pool.num_free == 2 and pool.num_used == 3
    assert pool.alloc(3) is None and pool.num_free == 2  # nothing taken on failure
    assert pool.alloc(0) == []
    b = pool.alloc(2)
    assert set(a) | set(b) == set(range(5)) and pool.num_free == 0
    assert pool.alloc(1) is None
    with pytest.raises(ValueError):
        pool.alloc(-1)
    pool.check_invariants()


def test_page_pool_refcounts():
    pool = PagePool(4)
    a = pool.alloc(2)
    assert all(pool.refcount(p) == 1 for p in a)
    pool.incref(a)  # shared by a second holder
    assert all(pool.refcount(p) == 2 for p in a)
    pool.decref(a)
    assert pool.num_free == 2 and all(pool.refcount(p) == 1 for p in a)
    pool.decref([a[0]])
    assert pool.refcount(a[0]) == 0 and pool.num_free == 3
    pool.decref([a[1]])
    assert pool.num_free == 4 and pool.num_used == 0
    pool.check_invariants()


def test_page_pool_errors_leave_the_pool_unchanged():
    pool = PagePool(3)
    a = pool.alloc(1)
    free = [p for p in range(3) if p not in a]
    with pytest.raises(ValueError):
        pool.decref([free[0]])  # decref of a free page
    with pytest.raises(ValueError):
        pool.decref([a[0], a[0]])  # refcount 1, two decrefs: rejected before any change
    assert pool.refcount(a[0]) == 1
    with pytest.raises(ValueError):
        pool.incref([free[0]])  # sharing a page nobody holds
    with pytest.raises(IndexError):
        pool.refcount(3)
    pool.decref(a)
    with pytest.raises(ValueError):
        pool.decref(a)  # double free
    assert pool.num_free == 3
    pool.check_invariants()


# ---------------------------------------------------------------------- SlotPool
def test_slot_pool_never_hands_out_scratch():
    pool = SlotPool(4)
    assert SlotPool.SCRATCH == SCRATCH == 0
    assert pool.capacity == 3 and pool.num_free == 3
    got = [pool.alloc() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and pool.alloc() is None and pool.num_free == 0
    for s in got:
        pool.free(s)
    for _ in range(50):  # churn: still never slot 0
        s = pool.alloc()
        assert s != SCRATCH
        pool.free(s)
    pool.check_invariants()


def test_slot_pool_errors():
    pool = SlotPool(3)
    s = pool.alloc()
    pool.free(s)
    with pytest.raises(ValueError):
        pool.free(s)  # double free
    with pytest.raises(ValueError):
        pool.free(SCRATCH)
    with pytest.raises(IndexError):
        pool.free(3)
    with pytest.raises(ValueError):
        SlotPool(1)  # no room beside the scratch slot
    assert pool.num_free == 2
    pool.check_invariants()


# ---------------------------------------------------------------------- plan_capacity
def test_plan_k3_full_64gib():
    cfg, budget = k3_full(), 64 * GiB
    plan = plan_capacity(cfg, page_size=256, dtype=jnp.bfloat16, kv_memory_bytes=budget, max_num_seqs=8)
    assert plan.bytes_per_page == 24 * 256 * 640 * 2  # 576-wide rows stored 640 wide (mla_pool_width)
    assert plan.bytes_per_slot == 69 * (96 * 128 * 128 * 4 + 3 * 3 * 12288 * 4)
    assert plan.num_slots == 9 and plan.max_concurrent_slots == 8
    assert plan.total_bytes == plan.num_slots * plan.bytes_per_slot + plan.num_pages * plan.bytes_per_page
    assert plan.total_bytes <= budget < plan.total_bytes + plan.bytes_per_page  # the rest went to pages
    assert plan.max_tokens_in_kv == plan.num_pages * 256
    assert plan.num_pages == (budget - 9 * plan.bytes_per_slot) // plan.bytes_per_page  # 8206 pages, ~2.1M tokens


def test_plan_too_small_budget_raises():
    cfg = k3_full()
    bps = 69 * (96 * 128 * 128 * 4 + 3 * 3 * 12288 * 4)
    bpp = 24 * 256 * 640 * 2  # 576-wide rows stored 640 wide (mla_pool_width)
    exact = 9 * bps + 8 * bpp  # 8 request slots + scratch, one page per sequence
    plan = plan_capacity(cfg, page_size=256, dtype="bfloat16", kv_memory_bytes=exact, max_num_seqs=8)
    assert plan.num_pages == 8
    with pytest.raises(ValueError, match="cannot hold 8 sequences"):
        plan_capacity(cfg, page_size=256, dtype="bfloat16", kv_memory_bytes=exact - 1, max_num_seqs=8)
    with pytest.raises(ValueError):
        plan_capacity(cfg, page_size=256, dtype="bfloat16", kv_memory_bytes=GiB, max_num_seqs=8)


def test_plan_explicit_pages_and_no_mla_model():
    cfg = k3_small()
    plan = plan_capacity(cfg, page_size=16, dtype=jnp.float32, num_pages=40, max_num_seqs=3)
    assert (plan.num_pages, plan.num_slots, plan.max_tokens_in_kv) == (40, 4, 640)
    with pytest.raises(ValueError, match="over the budget"):
        plan_capacity(cfg, page_size=16, dtype=jnp.float32, num_pages=40, max_num_seqs=3,
                      kv_memory_bytes=plan.total_bytes - 1)
    with pytest.raises(ValueError):
        plan_capacity(cfg, page_size=16, dtype=jnp.float32, max_num_seqs=3)  # neither budget nor pages
    # all-KDA model: pages cost nothing, a nominal pool covers max_position_embeddings per sequence
    kda_only = k3_small(layer_types=("kda",) * 8)
    p = plan_capacity(kda_only, page_size=16, dtype=jnp.float32, kv_memory_bytes=10 * plan.bytes_per_slot,
                      max_num_seqs=3)
    assert p.bytes_per_page == 0 and p.num_pages == 3 * (4096 // 16)
    assert p.total_bytes == 4 * p.bytes_per_slot


# ---------------------------------------------------------------------- CacheManager
def _manager(num_pages=40, max_num_seqs=4, page_size=8):
    cfg = k3_small()
    plan = plan_capacity(cfg, page_size=page_size, dtype=jnp.float32, num_pages=num_pages, max_num_seqs=max_num_seqs)
    return CacheManager(cfg, plan, jnp.float32)


def test_manager_basics():
    m = _manager(num_pages=6, max_num_seqs=2, page_size=8)
    assert m.device_cache.num_pages == 6 and m.device_cache.num_slots == 3 and m.device_cache.page_size == 8
    assert m.capacity() == {"max_tokens_in_kv": 48, "max_concurrent_slots": 2, "page_size": 8,
                            "num_pages": 6, "num_slots": 3, "total_bytes": m.capacity_plan.total_bytes,
                            "max_tokens_per_request": 48, "dp": 1, "dcp": 1}
    assert m.admit("a") and m.admit("b") and not m.admit("c")
    with pytest.raises(ValueError):
        m.admit("a")
    assert {m.slot_of("a"), m.slot_of("b")} == {1, 2}
    assert m.ensure_tokens("a", 17) and len(m.pages_of("a")) == 3
    assert m.ensure_tokens("a", 10) and len(m.pages_of("a")) == 3  # never shrinks
    assert m.pages_needed("b", 33) == 5 and not m.ensure_tokens("b", 33)  # 5 > 3 free: nothing taken
    assert m.pages_of("b") == [] and m.num_free_pages == 3
    assert m.ensure_tokens("b", 24) and m.num_free_pages == 0
    row = m.page_table_row("a", 5)
    assert row.dtype == np.int32 and list(row) == m.pages_of("a") + [0, 0]
    with pytest.raises(ValueError):
        m.page_table_row("a", 2)
    pt = m.page_table(["b", None], 4)
    assert pt.shape == (2, 4) and list(pt[1]) == [0, 0, 0, 0]
    assert list(m.slot_ids([None, "a"])) == [SCRATCH, m.slot_of("a")]
    m.check_invariants()
    m.release("a")
    with pytest.raises(KeyError):
        m.release("a")
    with pytest.raises(KeyError):
        m.ensure_tokens("zzz", 1)
    assert m.live_requests() == ["b"] and m.num_free_slots == 1 and m.num_free_pages == 3
    m.check_invariants()


def test_manager_rejects_plan_for_other_dtype():
    cfg = k3_small()
    plan = plan_capacity(cfg, page_size=8, dtype=jnp.bfloat16, num_pages=4, max_num_seqs=1)
    with pytest.raises(ValueError, match="does not match"):
        CacheManager(cfg, plan, jnp.float32, allocate=False)


def test_check_invariants_catches_corruption():
    m = _manager(num_pages=8, max_num_seqs=2)
    m.admit("a")
    m.ensure_tokens("a", 20)
    m.check_invariants()
    m.pages.incref([m.pages_of("a")[0]])  # a holder the manager does not know about
    with pytest.raises(AssertionError, match="refcount"):
        m.check_invariants()
    m.check_invariants(extra_page_refs={m.pages_of("a")[0]: 1})  # ...unless declared (prefix cache)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_lifecycle_fuzz(seed):
    """Random admit / extend / finish / abort / preempt with invariants after every op; all
    pages and slots come back at the end. A shadow model predicts every success/failure."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 4, 8, 16])
    num_pages, max_seqs = rng.randint(30, 50), rng.randint(2, 6)
    cfg = k3_small()
    plan = plan_capacity(cfg, page_size=page_size, dtype=jnp.float32, num_pages=num_pages, max_num_seqs=max_seqs)
    m = CacheManager(cfg, plan, jnp.float32, allocate=(seed == 0))  # one real (small) device cache
    tokens: dict[int, int] = {}  # shadow: rid -> tokens covered
    next_rid, stats = 0, {"admit_fail": 0, "extend_fail": 0, "release": 0}
    for _ in range(1000):
        op = rng.choices(["admit", "extend", "finish", "abort", "preempt"], [3, 8, 1, 1, 1])[0]
        live = list(tokens)
        if op == "admit":
            ok = m.admit(next_rid)
            assert ok == (len(live) < max_seqs)
            if ok:
                tokens[next_rid] = 0
            else:
                stats["admit_fail"] += 1
            next_rid += 1
        elif not live:
            continue
        elif op == "extend":
            rid = rng.choice(live)
            want = tokens[rid] + rng.randint(0, 6 * page_size)
            need = -(-want // page_size) - len(m.pages_of(rid))
            before = m.pages_of(rid)
            free = m.num_free_pages
            ok = m.ensure_tokens(rid, want)
            assert ok == (need <= free)
            if ok:
                tokens[rid] = want
                assert len(m.pages_of(rid)) * page_size >= want
                assert m.pages_of(rid)[: len(before)] == before  # growth only appends
            else:
                stats["extend_fail"] += 1
                assert m.pages_of(rid) == before and m.num_free_pages == free
        else:  # finish, abort and preemption all release
            rid = rng.choice(live)
            m.release(rid)
            del tokens[rid]
            stats["release"] += 1
        m.check_invariants()
        assert sorted(m.live_requests()) == sorted(tokens)
        slots = [m.slot_of(r) for r in tokens]
        assert SCRATCH not in slots and len(set(slots)) == len(slots)
        held = [p for r in tokens for p in m.pages_of(r)]
        assert len(held) == len(set(held)) == num_pages - m.num_free_pages
    assert stats["release"] > 50 and stats["extend_fail"] > 0 and stats["admit_fail"] > 0  # the pools were really exhausted
    for rid in list(tokens):
        m.release(rid)
        m.check_invariants()
    assert m.num_free_pages == num_pages and m.num_free_slots == max_seqs and m.live_requests() == []


@pytest.mark.parametrize("dp,dcp", [(1, 4), (2, 1), (2, 2)])
def test_lifecycle_fuzz_dp_dcp(dp, dcp):
    """Attention DP groups and DCP blocks: a request's slot is in its group, page k of it in
    block ``group * dcp + (k + rank0) mod dcp``; admission balances groups (and the starting
    DCP rank balances blocks); a block running dry fails
    an extension exactly when the shadow says so; everything comes back at the end."""
    rng = random.Random(dp * 10 + dcp)
    page_size, max_seqs = 4, 6
    cfg = k3_small()
    plan = plan_capacity(cfg, page_size=page_size, dtype=jnp.float32, num_pages=41, max_num_seqs=max_seqs,
                         dp=dp, dcp=dcp)
    blocks = dp * dcp
    assert plan.num_pages == 41 - 41 % blocks and plan.num_slots == dp * (max_seqs // dp + 1)
    m = CacheManager(cfg, plan, jnp.float32, allocate=False)
    per_block = plan.num_pages // blocks
    tokens: dict[int, int] = {}
    next_rid, fails = 0, 0
    for _ in range(800):
        op = rng.choices(["admit", "extend", "release"], [3, 8, 2])[0]
        live = list(tokens)
        if op == "admit":
            counts = [sum(m.group_of(r) == g for r in live) for g in range(dp)]
            ok = m.admit(next_rid)
            assert ok == any(c < max_seqs // dp for c in counts)
            if ok:
                g = m.group_of(next_rid)
                assert counts[g] == min(counts)  # the least-loaded group
                tokens[next_rid] = 0
            next_rid += 1
        elif not live:
            continue
        elif op == "extend":
            rid = rng.choice(live)
            g, have = m.group_of(rid), len(m.pages_of(rid))
            want = tokens[rid] + rng.randint(0, 5 * page_size)
            new = range(have, max(have, -(-want // page_size)))
            need = [m.block_for(m._req(rid), k) for k in new]
            free = [m.pages.num_free_in(b) for b in range(blocks)]
            ok = m.ensure_tokens(rid, want)
            assert ok == all(need.count(b) <= free[b] for b in set(need))
            if ok:
                tokens[rid] = want
            else:
                fails += 1
        else:
            rid = rng.choice(live)
            m.release(rid)
            del tokens[rid]
        m.check_invariants()  # includes: slot in the request's group, page k in block g*dcp + k%dcp
    assert fails > 0
    for rid in list(tokens):
        m.release(rid)
    m.check_invariants()
    assert m.num_free_pages == plan.num_pages and all(m.pages.num_free_in(b) == per_block for b in range(blocks))
    assert m.num_free_slots == max_seqs


def test_scheduler_budgets_decode_rows_before_prefill():
    """An older request still prefilling does not take the token budget from a younger one
    that decodes: decode rows are planned first, the prefill gets what is left."""
    from k3serve.server.engine.request import Request
    from k3serve.server.engine.sampling_params import SamplingParams
    from k3serve.server.engine.scheduler import Scheduler

    cfg = k3_small()
    plan = plan_capacity(cfg, page_size=16, dtype=jnp.float32, num_pages=64, max_num_seqs=4)
    sched = Scheduler(CacheManager(cfg, plan, jnp.float32, allocate=False), max_num_seqs=4,
                      max_num_batched_tokens=32, chunk_size=32)
    young = Request(list(range(1, 9)), SamplingParams(max_new_tokens=8), rid="young")
    sched.add(young)
    first = sched.schedule()  # the young request prefills alone ...
    assert [(r.req.rid, r.num_tokens) for r in first.rows] == [("young", 8)]
    young.num_computed += 8
    young.output.append(5)  # ... samples its first token and now decodes
    old = Request(list(range(1, 201)), SamplingParams(max_new_tokens=8), rid="old", priority=-1)
    sched.add(old)  # older by priority, with a prompt longer than the whole budget
    second = sched.schedule()  # running rows first, then the admission takes what is left
    assert [(r.req.rid, r.num_tokens) for r in second.rows] == [("young", 1), ("old", 31)]
    for _ in range(3):  # while the old one prefills, the young one keeps decoding every step
        young.num_computed += 1
        young.output.append(6)
        old.num_computed += sched_rows(second)["old"]
        second = sched.schedule()
        assert [(r.req.rid, r.num_tokens) for r in second.rows] == [("young", 1), ("old", 31)]


def sched_rows(plan):
    return {r.req.rid: r.num_tokens for r in plan.rows}
