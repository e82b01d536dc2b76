"""The host-DRAM second tier of the prefix cache (issue #6).

When the device index evicts a snapshot, the prefix it stood for is offloaded here: the KDA
state and conv window of the snapshot and the MLA rows of every token of the prefix, as one
self-contained entry keyed by the boundary's chained key. A later request whose chain
reaches a host entry deeper than its device hit reloads it: pages are allocated and written,
the state goes straight into the request's slot, and the boundary is registered on the
device again (so the two tiers agree on the longest prefix).

Offload never waits for the device: the gathers are dispatched in program order (after every
step launched so far, so they read what the evicted slot and pages hold before anything can
reuse them) and stay device arrays until ``drain`` finds them ready and moves them to host
memory. Entries are LRU under their own byte budget (``max_bytes``).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np


@dataclasses.dataclass
class HostEntry:
    tokens: int  # prefix length (a unit multiple)
    state: object  # [nK, H, dk, dv] (np.ndarray once drained, a device array before)
    conv: object  # [nK, W-1, 3P]
    rows: object  # [nM, tokens, width] MLA latent rows of the whole prefix (before draining: the
    #               gathered pages [nM, P', page_size, width], P' padded to a power of two)
    nbytes: int

    def ready(self) -> bool:
        return all(isinstance(a, np.ndarray) or a.is_ready() for a in (self.state, self.conv, self.rows))

    def to_host(self) -> None:
        if isinstance(self.rows, np.ndarray):
            return
        self.state, self.conv = np.asarray(self.state), np.asarray(self.conv)
        r = np.asarray(self.rows)
        self.rows = np.ascontiguousarray(r.reshape(r.shape[0], -1, r.shape[-1])[:, : self.tokens])


class HostTier:
    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self._pending: list[HostEntry] = []  # entries whose copies are still device arrays
        self.bytes_held = 0
        self.offloaded = 0  # entries written
        self.reloaded = 0  # hits served from here
        self.evicted = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def put(self, key: bytes, entry: HostEntry) -> bool:
        if entry.nbytes > self.max_bytes:
            return False
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        while self.bytes_held + entry.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_held -= old.nbytes
            self.evicted += 1
        self._entries[key] = entry
        self._pending.append(entry)
        self.bytes_held += entry.nbytes
        self.offloaded += 1
        return True

    def deepest(self, hashes, lo: int, hi: int) -> int:
        """The largest ``n`` in ``(lo, hi]`` with ``hashes[n-1]`` here, else 0."""
        for n in range(hi, lo, -1):
            if hashes[n - 1] in self._entries:
                return n
        return 0

    def take(self, key: bytes) -> HostEntry:
        e = self._entries[key]
        self._entries.move_to_end(key)
        e.to_host()
        return e

    def drain(self) -> None:
        """Move finished offload copies to host memory (device memory is given back)."""
        keep = []
        for e in self._pending:
            if isinstance(e.rows, np.ndarray):
                continue
            if e.ready():
                e.to_host()
            else:
                keep.append(e)
        self._pending = keep

    def clear(self) -> None:
        self._entries.clear()
        self._pending.clear()
        self.bytes_held = 0

    def check_invariants(self) -> None:
        assert self.bytes_held == sum(e.nbytes for e in self._entries.values()), "host bytes are off"
        assert self.bytes_held <= self.max_bytes, "host tier over its budget"
