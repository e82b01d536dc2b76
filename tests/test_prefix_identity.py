"""Prefix identity (issue #6, first slice): chained per-unit keys, salted per tenant."""
from __future__ import annotations

import random

import pytest

from k3serve.server.engine.cache.prefix_keys import PrefixChain, chain_hashes, longest_match, root_hash, tenant_salt


def test_keys_name_the_whole_prefix():
    rng = random.Random(0)
    a = [rng.randrange(1000) for _ in range(70)]
    ha = chain_hashes(a, 16)
    assert len(ha) == 4  # 64 tokens in complete units; the 6-token tail has no key
    assert chain_hashes(a[:48], 16) == ha[:3]  # a prefix of the tokens -> a prefix of the keys
    b = list(a)
    b[3] += 1  # differs in unit 0 only: every later key differs too (chained)
    hb = chain_hashes(b, 16)
    assert all(x != y for x, y in zip(ha, hb))
    c = list(a)
    c[40] += 1  # differs in unit 2: units 0-1 shared, 2-3 not
    hc = chain_hashes(c, 16)
    assert hc[:2] == ha[:2] and hc[2] != ha[2] and hc[3] != ha[3]
    # same unit contents at a different depth give a different key
    assert chain_hashes(a[16:32], 16)[0] != ha[1]
    # order inside a unit matters
    d = list(a)
    d[0], d[1] = d[1], d[0]
    assert chain_hashes(d, 16)[0] != ha[0] or a[0] == a[1]


def test_tenants_never_share_a_key():
    prompt = list(range(64))
    plain = chain_hashes(prompt, 16)
    s1 = chain_hashes(prompt, 16, tenant_salt(cache_salt="team-a"))
    s2 = chain_hashes(prompt, 16, tenant_salt(cache_salt="team-b"))
    k1 = chain_hashes(prompt, 16, tenant_salt(api_key="sk-1"))
    k2 = chain_hashes(prompt, 16, tenant_salt(api_key="sk-2"))
    keys = [plain, s1, s2, k1, k2]
    flat = [h for ks in keys for h in ks]
    assert len(set(flat)) == len(flat)  # no key shared between any two tenants
    assert tenant_salt() == b"" and b"sk-1" not in tenant_salt(api_key="sk-1")  # the key is not kept
    assert chain_hashes(prompt, 16, tenant_salt(cache_salt="team-a")) == s1  # deterministic
    assert root_hash(b"a") != root_hash(b"")


def test_a_cache_salt_narrows_the_key_tenant_and_never_replaces_it():
    """salt = H(key) ‖ cache_salt: naming another client's salt under another key shares
    nothing; one key's salts are apart from each other and from the key alone."""
    prompt = list(range(32))
    tenants = [dict(api_key="sk-1", cache_salt="x"), dict(api_key="sk-2", cache_salt="x"), dict(cache_salt="x"),
               dict(api_key="sk-1"), dict(api_key="sk-1", cache_salt="y"), dict(api_key="sk-2")]
    salts = [tenant_salt(**t) for t in tenants]
    assert len(set(salts)) == len(salts)
    flat = [h for s in salts for h in chain_hashes(prompt, 16, s)]
    assert len(set(flat)) == len(flat)
    assert b"sk-1" not in salts[0] and salts[0].endswith(b"salt:x")  # the key is not kept
    assert tenant_salt(api_key="sk-1", cache_salt="x") == salts[0]  # deterministic


def test_incremental_chain_equals_one_shot():
    rng = random.Random(1)
    tokens = [rng.randrange(50000) for _ in range(1000)]
    ch = PrefixChain(16, tenant_salt(cache_salt="t"))
    i, completed = 0, []
    while i < len(tokens):
        n = rng.randint(0, 40)  # prompt chunks, then single decode tokens, in any sizes
        completed += ch.extend(tokens[i : i + n])
        i += n
    assert ch.hashes == completed == chain_hashes(tokens, 16, tenant_salt(cache_salt="t"))
    assert ch.num_tokens == 1000 // 16 * 16


def test_longest_match_stops_at_the_first_miss():
    hs = chain_hashes(list(range(80)), 16)
    have = {hs[0], hs[1], hs[3]}  # unit 2 evicted: unit 3 must not be used
    assert longest_match(hs, have.__contains__) == 2
    assert longest_match(hs, lambda h: False) == 0 and longest_match(hs, lambda h: True) == 5


def test_bad_input():
    with pytest.raises(ValueError):
        chain_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        chain_hashes([-1] * 16, 16)
    with pytest.raises(ValueError):
        PrefixChain(0)


def test_long_prompt_keys_are_distinct():
    tokens = list(range(131072))  # a 128K-token prompt: 8,192 units of 16
    hs = chain_hashes(tokens, 16)
    assert len(hs) == 8192 and len(set(hs)) == 8192


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_index_randomized_invariants(seed):
    """Thousands of mixed operations: requests with shared prefixes look up a hit (pages +
    snapshot), map the whole pages, copy a partial tail page, write their own rows, register
    snapshots at random boundaries, release; the index evicts under its byte budget. After
    every op: the index invariants, pool refcounts = requests' + the index's holds, budgets
    respected, and a hit's pages and snapshot hold exactly that prefix (checked against a
    shadow of what each page and snapshot slot holds). All free at the end."""
    from k3serve.server.engine.cache.pages import PagePool
    from k3serve.server.engine.cache.prefix_index import PrefixIndex
    from k3serve.server.engine.cache.slots import SlotPool

    rng = random.Random(seed)
    unit, ps = 4, 8
    pool = PagePool(64)
    slots = SlotPool(2 + 10, snapshots=10)
    bpp, bps = 100, 250
    budget = rng.choice([1000, 2000, 4000])
    idx = PrefixIndex(pool, unit=unit, page_size=ps, max_bytes=budget, bytes_per_page=bpp, bytes_per_snapshot=bps,
                      free_snapshot=slots.free_snapshot)
    bases = [[rng.randrange(30) for _ in range(40)] for _ in range(4)]  # shared system prompts
    content: dict[int, list] = {}  # shadow: page -> the token ids written at each offset
    snap_of: dict[int, list] = {}  # shadow: snapshot slot -> the prefix its state is of
    live: dict[int, tuple[list, list]] = {}  # rid -> (tokens, pages)
    hits = 0
    for step in range(3000):
        op = rng.choices(["new", "release"], [3, 2])[0]
        if op == "new" or not live:
            toks = rng.choice(bases)[: rng.randint(0, 40)] + [rng.randrange(30) for _ in range(rng.randint(1, 12))]
            hs = chain_hashes(toks, unit)
            n, shared, snap = idx.lookup(hs, max_units=(len(toks) - 1) // unit)
            if n:
                assert snap_of[snap] == toks[: n * unit]  # the state is of exactly this prefix
                for u in range(n):  # the hit's pages hold exactly those tokens
                    page = shared[u * unit // ps]
                    off = u * unit % ps
                    assert content[page][off:off + unit] == toks[u * unit:(u + 1) * unit]
            hits += n > 0
            full = n * unit // ps  # whole shared pages are mapped; a partial tail page is copied
            pool.incref(shared[:full])
            need = -(-len(toks) // ps) - full
            new = pool.alloc(need)
            while new is None and idx.evict_one():
                new = pool.alloc(need)
            if new is None:
                pool.decref(shared[:full])
                continue
            pages = shared[:full] + new
            for j, p in enumerate(new):  # write (copy the shared tail, then the request's own tokens)
                k = full + j
                content[p] = list(toks[k * ps:(k + 1) * ps])
            live[step] = (toks, pages)
            # register a snapshot at the prompt end and maybe at a random earlier boundary
            for b in {len(toks) // unit, rng.randint(1, max(1, len(toks) // unit))}:
                if b == 0 or b > len(hs) or idx.has_snapshot(hs[b - 1]):
                    continue
                slot = slots.alloc_snapshot()
                while slot is None and idx.evict_one(protect=set(hs[:b])):
                    slot = slots.alloc_snapshot()
                if slot is None:
                    continue
                if idx.register(hs[:b], pages, slot) == b:
                    snap_of[slot] = toks[: b * unit]
                else:
                    slots.free_snapshot(slot)
        else:
            rid = rng.choice(list(live))
            toks, pages = live.pop(rid)
            pool.decref(pages)
        idx.check_invariants()
        pool.check_invariants()
        slots.check_invariants()
        assert slots.num_snapshots_used == idx.num_snapshots
        held = {}
        for _, pages in live.values():
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for p, r in idx.page_refs().items():
            held[p] = held.get(p, 0) + r
        assert all(pool.refcount(p) == held.get(p, 0) for p in range(pool.num_pages))
    assert hits > 100 and idx.snapshots_evicted > 0
    for rid in list(live):
        pool.decref(live.pop(rid)[1])
    idx.evict_all()
    idx.check_invariants()
    assert len(idx) == 0 and pool.num_free == pool.num_pages and slots.num_free_snapshots == 10
