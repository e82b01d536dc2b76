"""The prefix index: which prefix-match units the cache holds, in which physical page, and
which of them carry a KDA state snapshot (LRU over snapshots, a byte budget).

The keys themselves (chained per-unit hashes, salted per tenant) come from ``prefix_keys``.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .prefix_keys import longest_match

class PrefixIndex:
    """Which prefixes the cache can resume from, and where their MLA rows and KDA state are
    (host-side bookkeeping, issue #6).

    A **unit entry** says: the latent rows of the unit with this key live in ``page`` (at
    offset ``depth * unit % page_size``). A unit entry may carry a **snapshot**: a KDA slot
    holding the recurrent state (and conv window) after exactly the tokens up to and
    including that unit. A hit needs both — the pages of every unit up to the boundary and a
    snapshot at the boundary — so ``lookup`` returns the deepest snapshot along the matched
    chain, and units past the last snapshot of every chain are useless and are never kept.

    The index holds **one** reference on each page any of its units names (on the shared
    :class:`~k3serve.server.engine.cache.pages.PagePool`), so a page outlives the requests that
    wrote it while the cache keeps it; ``page_refs()`` is what
    ``CacheManager.check_invariants`` needs as ``extra_page_refs``. Snapshot slots are owned by
    the index once registered and handed back through ``free_snapshot`` on eviction.

    Eviction is LRU over snapshots (``lookup`` refreshes the one it returns). Dropping a
    snapshot trims the units that no snapshot needs any more (leaf units without a snapshot,
    repeatedly), which is what frees pages. Budget: ``pages * bytes_per_page + snapshots *
    bytes_per_snapshot <= max_bytes``.

    Invariants (``check_invariants``): every entry's parent is the root or an entry; every
    leaf carries a snapshot; the entries naming a page are > 0 exactly for the pages the index
    holds a reference on; the bytes held are within the budget.
    """

    def __init__(self, pool, *, unit: int, page_size: int, max_bytes: int | None = None, bytes_per_page: int = 1,
                 bytes_per_snapshot: int = 0, free_snapshot=None, on_event=None, on_evict=None):
        if page_size % unit:
            raise ValueError(f"page_size {page_size} must be a multiple of the prefix unit {unit}")
        self.pool, self.unit, self.page_size = pool, unit, page_size
        self.max_bytes = max_bytes
        self.bytes_per_page, self.bytes_per_snapshot = bytes_per_page, bytes_per_snapshot
        self._free_snapshot = free_snapshot or (lambda slot: None)
        self._on_event = on_event  # (kind, [keys]) for "stored" / "removed" (SubscribeKvEvents)
        self._on_evict = on_evict  # (key, snapshot slot, units, pages) before an evicted snapshot is freed
        self._entries: dict[bytes, list] = {}  # key -> [parent, page, depth, snapshot slot | None]
        self.pinned: set[int] = set()  # snapshot slots a step about to launch reads: not evicted
        self._children: dict[bytes, int] = {}  # key -> number of child entries
        self._page_units: dict[int, int] = {}  # page -> entries naming it
        self._snaps: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self.evicted = 0  # units removed
        self.snapshots_registered = 0
        self.snapshots_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    @property
    def num_pages(self) -> int:
        return len(self._page_units)

    @property
    def num_snapshots(self) -> int:
        return len(self._snaps)

    @property
    def bytes_held(self) -> int:
        return self.num_pages * self.bytes_per_page + self.num_snapshots * self.bytes_per_snapshot

    def num_evictable_pages(self) -> int:
        """Pages only the index holds (no request maps them): what eviction can free."""
        ref = self.pool.refcount
        return sum(1 for p in self._page_units if ref(p) == 1)

    def page_refs(self) -> dict[int, int]:
        return {p: 1 for p in self._page_units}

    def snapshot_slots(self) -> list[int]:
        return list(self._snaps.values())

    def has_snapshot(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return e is not None and e[3] is not None

    def match_len(self, hashes: Sequence[bytes]) -> int:
        """Leading units of ``hashes`` whose rows the index holds (snapshot or not)."""
        return longest_match(hashes, self._entries.__contains__)

    def lookup(self, hashes: Sequence[bytes], max_units: int | None = None) -> tuple[int, list[int], int | None]:
        """(units, pages, snapshot slot) of the deepest snapshot along ``hashes`` within
        ``max_units``; ``(0, [], None)`` if none. ``pages`` cover the units (the last one may
        be partly filled by them). The snapshot returned becomes the most recently used."""
        n = self.match_len(hashes)
        if max_units is not None:
            n = min(n, max_units)
        best = next((i for i in range(n - 1, -1, -1) if self._entries[hashes[i]][3] is not None), None)
        if best is None:
            return 0, [], None
        key = hashes[best]
        self._snaps.move_to_end(key)
        return best + 1, self._pages(hashes, best + 1), self._entries[key][3]

    def match(self, hashes: Sequence[bytes]) -> tuple[int, list[int]]:
        """(units matched, the pages holding them in order), snapshots or not."""
        n = self.match_len(hashes)
        return n, self._pages(hashes, n)

    def _pages(self, hashes: Sequence[bytes], n: int) -> list[int]:
        """The pages holding the first ``n`` units of a chain: of each page's units, the page of
        the deepest one. A page holds every row of its chain up to its unit (the request that
        wrote it computed them or copied them in: a hit's partly filled page is copied), so the
        deepest unit's page serves the shallower ones too, while a shallower unit's page may
        belong to another branch that diverges inside the page."""
        per_page = self.page_size // self.unit
        return [self._entries[hashes[min(i + per_page, n) - 1]][1] for i in range(0, n, per_page)]

    def register(self, hashes: Sequence[bytes], pages: Sequence[int], snapshot: int | None = None) -> int:
        """Register the units of a computed prefix (``pages`` = the request's pages in order,
        covering at least ``len(hashes) * unit`` tokens) and, if given, ``snapshot`` as the
        state after the last unit. Units already present keep their page (the first writer's).

        Returns the number of units now registered along ``hashes`` with their snapshot in
        place, i.e. ``len(hashes)`` on success. Fails (returns less, takes nothing new and
        leaves ``snapshot`` with the caller) when the last unit already has a snapshot, or when
        the byte budget cannot make room. Without a snapshot nothing is
        kept (units past the last snapshot are useless)."""
        if snapshot is None or not hashes:
            return 0
        if self.has_snapshot(hashes[-1]):
            return 0
        per_page = self.page_size // self.unit
        protect = set(hashes)
        while True:
            # making room may trim units of this chain that only another branch's snapshot
            # needed, so the units and pages to add are worked out again after each eviction
            # units of a page already present on another physical page (another branch wrote them,
            # or this request copied that page in on a hit) are fine: a page group's page is its
            # deepest unit's (``_pages``), and this request's page holds all of its rows
            have = self.match_len(hashes)
            new_pages = {pages[i // per_page] for i in range(have, len(hashes))} - self._page_units.keys()
            need = len(new_pages) * self.bytes_per_page + self.bytes_per_snapshot
            if self.max_bytes is None or self.bytes_held + need <= self.max_bytes:
                break
            if not self.evict_one(protect=protect):
                return 0
        parent = hashes[have - 1] if have else None
        added = []
        for i in range(have, len(hashes)):
            h, page = hashes[i], pages[i // per_page]
            self._entries[h] = [parent, page, i, None]
            self._children[h] = 0
            if parent is not None:
                self._children[parent] += 1
            if page not in self._page_units:
                self.pool.incref([page])
                self._page_units[page] = 0
            self._page_units[page] += 1
            parent = h
            added.append(h)
        self._entries[hashes[-1]][3] = snapshot
        self._snaps[hashes[-1]] = snapshot
        self.snapshots_registered += 1
        if added and self._on_event:
            self._on_event("stored", added)
        return len(hashes)

    def evict_one(self, protect: set | None = None, where=None) -> bool:
        """Drop the least recently used snapshot (not one of ``protect``'s keys nor a
        ``pinned`` slot; only slots for which ``where(slot)`` holds, if given) and the units only
        it needed. False if none."""
        for key, slot in self._snaps.items():
            if (protect and key in protect) or slot in self.pinned:
                continue
            if where is not None and not where(slot):
                continue
            self._drop_snapshot(key, evict=True)
            return True
        return False

    def chain_pages(self, key: bytes) -> list[int]:
        """The pages holding the prefix that ends with unit ``key``, in order (of each page's
        units, the deepest one's page: ``_pages``)."""
        per_page = self.page_size // self.unit
        pages: list[int] = []
        k, group = key, None
        while k is not None:
            parent, page, depth, _ = self._entries[k]
            if depth // per_page != group:  # walking up: the first unit seen of a page is its deepest
                group = depth // per_page
                pages.append(page)
            k = parent
        return pages[::-1]

    def _drop_snapshot(self, key: bytes, evict: bool = False) -> None:
        if evict and self._on_evict is not None:
            self._on_evict(key, self._snaps[key], self._entries[key][2] + 1, self.chain_pages(key))
        slot = self._snaps.pop(key)
        self._entries[key][3] = None
        self.snapshots_evicted += 1
        self._free_snapshot(slot)
        removed = []
        while key is not None and self._children[key] == 0 and self._entries[key][3] is None:
            parent = self._remove_unit(key)
            removed.append(key)
            key = parent
        if removed and self._on_event:
            self._on_event("removed", removed)

    def _remove_unit(self, key: bytes):
        parent, page, _, _ = self._entries.pop(key)
        del self._children[key]
        self.evicted += 1
        self._page_units[page] -= 1
        if self._page_units[page] == 0:
            del self._page_units[page]
            self.pool.decref([page])
        if parent is not None:
            self._children[parent] -= 1
        return parent

    def evict_all(self) -> None:
        while self._snaps:
            self._drop_snapshot(next(iter(self._snaps)))

    def check_invariants(self) -> None:
        counts: dict[int, int] = {}
        kids: dict[bytes, int] = {k: 0 for k in self._entries}
        for key, (parent, page, depth, snap) in self._entries.items():
            assert parent is None or parent in self._entries, "an entry outlived its parent"
            assert (parent is None) == (depth == 0), "depth and parent disagree"
            if parent is not None:
                assert self._entries[parent][2] == depth - 1, "depth is not the parent's + 1"
                kids[parent] += 1
            counts[page] = counts.get(page, 0) + 1
            assert (snap is not None) == (key in self._snaps), "snapshot table and entries disagree"
            if snap is not None:
                assert self._snaps[key] == snap, "snapshot slot differs between table and entry"
        assert kids == self._children, "child counts are off"
        for key in self._entries:
            assert kids[key] > 0 or self._entries[key][3] is not None, "a leaf unit has no snapshot"
        assert counts == self._page_units, "page use counts are off"
        assert len(set(self._snaps.values())) == len(self._snaps), "a snapshot slot is registered twice"
        if self.max_bytes is not None:
            assert self.bytes_held <= self.max_bytes, f"{self.bytes_held} bytes held, budget {self.max_bytes}"
        for p in self._page_units:
            assert self.pool.refcount(p) >= 1, f"page {p} held by the index is free in the pool"
