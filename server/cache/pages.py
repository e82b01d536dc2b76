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

Every call is O(n) in the pages it touches: a LIFO free list plus a refcount array.
"""
from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """``num_pages`` page ids ``0..num_pages-1``, each with a reference count (0 = free)."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = int(num_pages)
        self._ref = [0] * self.num_pages
        # a stack popped from the end; reversed so a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(self.num_pages - 1, -1, -1))

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    # ------------------------------------------------------------------ updates
    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages with refcount 1, or None (allocating nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
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
                self._free.append(p)

    # ------------------------------------------------------------------ checks
    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} out of range 0..{self.num_pages - 1}")

    def check_invariants(self) -> None:
        """Free list and refcounts agree: each free page listed once with count 0, used pages > 0."""
        free = set(self._free)
        assert len(free) == len(self._free), "page free list holds duplicates"
        for p in range(self.num_pages):
            r = self._ref[p]
            assert r >= 0, f"page {p} has negative refcount {r}"
            assert (r == 0) == (p in free), f"page {p}: refcount {r} but {'in' if p in free else 'not in'} free list"
