"""Prefix identity (issue #6, first slice): chained per-unit keys, salted per tenant."""
from __future__ import annotations

import random

import pytest

from k3serve.server.cache.prefix import PrefixChain, chain_hashes, longest_match, root_hash, tenant_salt


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
    assert tenant_salt(cache_salt="x", api_key="k") == tenant_salt(cache_salt="x")  # the salt field wins
    assert tenant_salt() == b"" and b"sk-1" not in tenant_salt(api_key="sk-1")  # the key is not kept
    assert chain_hashes(prompt, 16, tenant_salt(cache_salt="team-a")) == s1  # deterministic
    assert root_hash(b"a") != root_hash(b"")


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
    """Thousands of mixed operations: requests with shared prefixes allocate pages, register
    their units, hit, release; the index evicts under its page budget. After every op the
    index invariants hold, the page pool's refcounts equal requests' + the index's holds, a
    hit's pages really hold that prefix (checked against a shadow of what each page holds),
    and everything is free at the end."""
    from k3serve.server.cache.pages import PagePool
    from k3serve.server.cache.prefix import PrefixIndex

    rng = random.Random(seed)
    unit, ps = 4, 8
    pool = PagePool(64)
    idx = PrefixIndex(pool, unit=unit, page_size=ps, max_pages=rng.choice([6, 12, 20]))
    bases = [[rng.randrange(30) for _ in range(40)] for _ in range(4)]  # shared system prompts
    content: dict[int, list] = {}  # shadow: page -> the token ids written at each offset
    live: dict[int, tuple[list, list]] = {}  # rid -> (tokens, pages)
    hits = 0
    for step in range(3000):
        op = rng.choices(["new", "release"], [3, 2])[0]
        if op == "new" or not live:
            toks = rng.choice(bases)[: rng.randint(0, 40)] + [rng.randrange(30) for _ in range(rng.randint(1, 12))]
            hs = chain_hashes(toks, unit)
            n, shared = idx.match(hs)
            # the hit's pages hold exactly those tokens
            for u in range(n):
                page = shared[u * unit // ps]
                off = u * unit % ps
                assert content[page][off:off + unit] == toks[u * unit:(u + 1) * unit]
            hits += n > 0
            full = n * unit // ps  # whole shared pages are mapped; a partial tail page is copied
            pool.incref(shared[:full])
            need = -(-len(toks) // ps) - full
            new = pool.alloc(need)
            if new is None:
                pool.decref(shared[:full])
                idx.evict_all() if rng.random() < 0.3 else None
                continue
            pages = shared[:full] + new
            for j, p in enumerate(new):  # write (copy the shared tail, then the request's own tokens)
                k = full + j
                content[p] = list(toks[k * ps:(k + 1) * ps])
            rid = step
            live[rid] = (toks, pages)
            idx.insert(hs, pages)
        else:
            rid = rng.choice(list(live))
            toks, pages = live.pop(rid)
            pool.decref(pages)
        idx.check_invariants()
        pool.check_invariants()
        held = {}
        for _, pages in live.values():
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for p, r in idx.page_refs().items():
            held[p] = held.get(p, 0) + r
        assert all(pool.refcount(p) == held.get(p, 0) for p in range(pool.num_pages))
    assert hits > 100 and idx.evicted > 0
    for rid in list(live):
        pool.decref(live.pop(rid)[1])
    idx.evict_all()
    idx.check_invariants()
    assert len(idx) == 0 and pool.num_free == pool.num_pages
