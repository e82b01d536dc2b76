"""Reference-counted pool of MLA KV pages (host-side bookkeeping only).

Why reference counts and not plain ownership: MLA pages hold latent rows that never change
once written, so a prefix shared by several requests (and later the prefix cache) can map
the same physical page into several page tables. A page is free again only when the last
holder lets go. KDA state is *not* shareable this way (it is updated in place), which is
why slots live in a separate, plain pool (``slots.py``).

Layout this pool indexes: ``Cache.mla_kv [nM, num_pages, page_size, kv_lora_rank + rope]``
(see ``k3serve.model.cache``); page id ``p`` is the same row ``p`` in every MLA layer.
Page 0 is an ordinary page: unused page-table entries may name it because MLA reads past a
row's kv length are masked and writes of padding positions are dropped.

Blocks (decode context parallelism / attention DP): with ``num_blocks > 1`` the ids are
cut into ``num_blocks`` equal ranges, one per device block of the sharded pool (block
``g * dcp + r`` = DP group g, DCP rank r), each with its own free list; ``alloc_in(blocks)``
takes one page from each named block, so the manager can deal a sequence's pages
round-robin over its group's DCP ranks.

Every call is O(n) in the pages it touches: a LIFO free list per block plus a refcount array.
"""
from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """``num_pages`` page ids ``0..num_pages-1``, each with a reference count (0 = free)."""

    def __init__(self, num_pages: int, num_blocks: int = 1):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_blocks < 1 or num_pages % num_blocks:
            raise ValueError(f"{num_pages} pages do not split into {num_blocks} equal blocks")
        self.num_pages = int(num_pages)
        self.num_blocks = int(num_blocks)
        self.block_size = self.num_pages // self.num_blocks
        self._ref = [0] * self.num_pages
        # stacks popped from the end; reversed so a fresh pool hands out 0, 1, 2, ... per block
        bs = self.block_size
        self._frees = [list(range((b + 1) * bs - 1, b * bs - 1, -1)) for b in range(self.num_blocks)]

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return sum(len(f) for f in self._frees)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def block_of(self, page: int) -> int:
        return page // self.block_size if self.block_size else 0

    def num_free_in(self, block: int) -> int:
        return len(self._frees[block])

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    # ------------------------------------------------------------------ updates
    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages with refcount 1, or None (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if self.num_blocks != 1:
            raise ValueError("a blocked pool allocates with alloc_in(blocks)")
        return self.alloc_in([0] * n)

    def alloc_in(self, blocks: list[int]) -> list[int] | None:
        """One fresh page from each of ``blocks`` (in order), or None (allocating nothing)."""
        need: dict[int, int] = {}
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block {b} out of range 0..{self.num_blocks - 1}")
            need[b] = need.get(b, 0) + 1
        if any(len(self._frees[b]) < k for b, k in need.items()):
            return None
        out = [self._frees[b].pop() for b in blocks]
        for p in out:
            self._ref[p] = 1
        return out

    def incref(self, pages: Iterable[int]) -> None:
        """Add a holder to pages that are already in use (sharing). All checked before any change."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if self._ref[p] == 0:
                raise ValueError(f"incref of free page {p}")
        for p in pages:
            self._ref[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop a holder from each page; a page whose count reaches 0 returns to the free list.

        A page may appear several times (one decref each). Validated before any change, so a
        bad call leaves the pool as it was.
        """
        pages = list(pages)
        need: dict[int, int] = {}
        for p in pages:
            self._check_id(p)
            need[p] = need.get(p, 0) + 1
        for p, k in need.items():
            if self._ref[p] < k:
                raise ValueError(f"decref of free page {p} (refcount {self._ref[p]}, {k} decrefs)")
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._frees[self.block_of(p)].append(p)

    # ------------------------------------------------------------------ checks
    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range 0..{self.num_pages - 1}")

    def check_invariants(self) -> None:
        """Free list and refcounts agree: each free page listed once with count 0, used pages > 0."""
        every = [p for f in self._frees for p in f]
        free = set(every)
        assert len(free) == len(every), "page free list holds duplicates"
        for b, f in enumerate(self._frees):
            assert all(self.block_of(p) == b for p in f), f"a page of another block is on block {b}'s free list"
        for p in range(self.num_pages):
            r = self._ref[p]
            assert r >= 0, f"page {p} has negative refcount {r}"
            assert (r == 0) == (p in free), f"page {p}: refcount {r} but {'in' if p in free else 'not in'} free list"
