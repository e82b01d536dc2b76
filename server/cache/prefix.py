"""Prefix identity for prefix caching (issue #6, first slice): chained hashes over
prefix-match units, salted per tenant.

Why chained: the key of unit i must name the *whole* prefix up to and including unit i, not
just unit i's tokens; ``h_i = H(h_{i-1} || tokens of unit i)`` gives that in O(unit) per unit,
so a request's keys grow with its tokens (``PrefixChain.extend``) and never need a rehash.

Why a unit finer than the physical page: a hit may end inside a page (a 256-token page and a
shared prompt of 1,000 tokens); with 16-token units the cache can use 992 of them, the page
holding the tail is copied before the new request writes into it. ``page_size`` must be a
multiple of ``unit`` so a unit never straddles two pages.

Why salted: two tenants (different ``cache_salt`` request fields, or different API keys) must
never share a page or a state, even for the same prompt. The tenant goes into the root of the
chain, so every key differs; nothing downstream has to remember to compare tenants.

Hash: BLAKE2b with a 16-byte digest over the parent digest and the unit's token ids as
little-endian int32 — deterministic across processes (unlike Python's ``hash``) and with
collisions negligible at any cache size.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DIGEST = 16
_DOMAIN = b"k3serve/prefix/v1"


def tenant_salt(cache_salt: str | None = None, api_key: str | None = None) -> bytes:
    """The salt of a request's tenant: its ``cache_salt`` if given, else its API key (hashed, so
    the key itself is never kept), else the shared empty tenant."""
    if cache_salt:
        return b"salt:" + cache_salt.encode("utf-8")
    if api_key:
        return b"key:" + hashlib.sha256(api_key.encode("utf-8")).digest()
    return b""


def root_hash(salt: bytes = b"") -> bytes:
    return hashlib.blake2b(_DOMAIN + len(salt).to_bytes(4, "little") + salt, digest_size=DIGEST).digest()


def chain_hashes(tokens: Sequence[int], unit: int, salt: bytes = b"", parent: bytes | None = None) -> list[bytes]:
    """One key per *complete* unit of ``tokens`` (a trailing partial unit has none), chained
    from ``parent`` (default: the tenant's root)."""
    if unit < 1:
        raise ValueError(f"unit must be >= 1, got {unit}")
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    raw = ids.astype("<i4").tobytes()
    h = root_hash(salt) if parent is None else parent
    out = []
    step = 4 * unit
    for i in range(len(ids) // unit):
        h = hashlib.blake2b(h + raw[i * step : (i + 1) * step], digest_size=DIGEST).digest()
        out.append(h)
    return out


class PrefixChain:
    """A request's prefix keys, grown as its tokens grow (prompt, then generated tokens)."""

    def __init__(self, unit: int, salt: bytes = b""):
        if unit < 1:
            raise ValueError(f"unit must be >= 1, got {unit}")
        self.unit = unit
        self.salt = salt
        self.hashes: list[bytes] = []
        self._pending: list[int] = []  # tokens of the unit being filled

    @property
    def num_tokens(self) -> int:
        """Tokens covered by complete units (= len(hashes) * unit)."""
        return len(self.hashes) * self.unit

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Add tokens; returns the keys of the units they completed."""
        self._pending.extend(int(t) for t in tokens)
        n = len(self._pending) // self.unit * self.unit
        if n == 0:
            return []
        parent = self.hashes[-1] if self.hashes else None
        new = chain_hashes(self._pending[:n], self.unit, self.salt, parent)
        self._pending = self._pending[n:]
        self.hashes.extend(new)
        return new


def longest_match(hashes: Sequence[bytes], present) -> int:
    """Number of leading keys of ``hashes`` for which ``present(key)`` holds.

    Chained keys make presence monotone along a request's chain as long as the cache keeps
    a unit only while it keeps the units before it (its parents); the scan still stops at the
    first miss, so a cache that evicted a parent can never return a child."""
    n = 0
    for h in hashes:
        if not present(h):
            break
        n += 1
    return n


class PrefixIndex:
    """Which prefix units the cache holds, and where (host-side bookkeeping, issue #6).

    A unit entry says: the latent rows of the unit with this key live in ``page`` (at offset
    ``depth * unit % page_size``). The index holds **one** reference on each page that any of
    its units names (taken from the shared :class:`~k3serve.server.cache.pages.PagePool`), so a
    page outlives the requests that wrote it while the cache keeps it, and returns to the pool
    when both let go. ``page_refs()`` is what ``CacheManager.check_invariants`` needs as
    ``extra_page_refs``.

    Invariants (``check_invariants``): every entry's parent is the root or an entry (a child is
    only reachable through its parents, so eviction takes leaves only); the number of entries
    naming a page is > 0 exactly for the pages the index holds a reference on; the pages held
    never exceed ``max_pages``. Eviction is LRU over leaf entries (``match`` refreshes a hit);
    entries whose page is still mapped by a request cost nothing to keep but are evicted the
    same way.
    """

    def __init__(self, pool, *, unit: int, page_size: int, max_pages: int):
        if page_size % unit:
            raise ValueError(f"page_size {page_size} must be a multiple of the prefix unit {unit}")
        self.pool, self.unit, self.page_size, self.max_pages = pool, unit, page_size, max_pages
        self._entries: dict[bytes, tuple[bytes | None, int, int]] = {}  # key -> (parent, page, depth)
        self._children: dict[bytes, int] = {}  # key -> number of child entries
        self._page_units: dict[int, int] = {}  # page -> entries naming it
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # leaf keys, least recently used first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def num_pages(self) -> int:
        return len(self._page_units)

    def page_refs(self) -> dict[int, int]:
        return {p: 1 for p in self._page_units}

    def match(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """(units matched, the pages holding them in order); touches the matched chain."""
        n = longest_match(hashes, self._entries.__contains__)
        pages: list[int] = []
        per_page = self.page_size // self.unit
        for i in range(n):
            if i % per_page == 0:
                pages.append(self._entries[hashes[i]][1])
        for i in range(n):  # only leaves are in the LRU
            if hashes[i] in self._lru:
                self._lru.move_to_end(hashes[i])
        return n, pages

    def insert(self, hashes: Sequence[bytes], pages: Sequence[int]) -> int:
        """Register the units of a computed prefix (``pages`` = the request's pages in order,
        covering at least ``len(hashes) * unit`` tokens). Units already present are kept
        (their page is the first writer's). Evicts LRU leaves to stay within ``max_pages``;
        returns the number of new entries (stops early if the budget cannot make room)."""
        per_page = self.page_size // self.unit
        added = 0
        parent = None
        for i, h in enumerate(hashes):
            if h in self._entries:
                parent = h
                continue
            page = pages[i // per_page]
            if i % per_page and self._entries[parent][1] != page:
                # the units of one page must all name the same physical page: this request's
                # rows of the page are in another copy (it wrote after a copy-on-write)
                break
            if page not in self._page_units and not self._make_room(keep=parent):
                break
            self._entries[h] = (parent, page, i)
            self._children[h] = 0
            if parent is not None:
                self._children[parent] += 1
                self._lru.pop(parent, None)  # no longer a leaf
            self._lru[h] = None
            if page not in self._page_units:
                self.pool.incref([page])
                self._page_units[page] = 0
            self._page_units[page] += 1
            parent = h
            added += 1
        return added

    def _make_room(self, keep: bytes | None) -> bool:
        while len(self._page_units) >= self.max_pages:
            victim = next((k for k in self._lru if k != keep), None)
            if victim is None:
                return False
            self._remove(victim)
        return True

    def _remove(self, key: bytes) -> None:
        parent, page, _ = self._entries.pop(key)
        del self._children[key]
        self._lru.pop(key, None)
        self.evicted += 1
        self._page_units[page] -= 1
        if self._page_units[page] == 0:
            del self._page_units[page]
            self.pool.decref([page])
        if parent is not None:
            self._children[parent] -= 1
            if self._children[parent] == 0:
                self._lru[parent] = None  # a leaf again, as old as its evicted child: next out
                self._lru.move_to_end(parent, last=False)

    def evict_all(self) -> None:
        while self._lru:
            self._remove(next(iter(self._lru)))

    def check_invariants(self) -> None:
        counts: dict[int, int] = {}
        for key, (parent, page, depth) in self._entries.items():
            assert parent is None or parent in self._entries, "an entry outlived its parent"
            assert (parent is None) == (depth == 0), "depth and parent disagree"
            counts[page] = counts.get(page, 0) + 1
            kids = sum(1 for p, _, _ in self._entries.values() if p == key)
            assert self._children[key] == kids, "child count is off"
            assert (kids == 0) == (key in self._lru), "LRU holds exactly the leaves"
        assert counts == self._page_units, "page use counts are off"
        assert len(self._page_units) <= self.max_pages, "over the page budget"
        for p in self._page_units:
            assert self.pool.refcount(p) >= 1, f"page {p} held by the index is free in the pool"
