"""The host-DRAM second tier of the prefix cache (issue #6).

When the device index evicts a snapshot, the prefix it stood for is offloaded here: the KDA
state and conv window of the snapshot and the MLA rows of every token of the prefix, as one
self-contained entry keyed by the boundary's chained key. A later request whose chain
reaches a host entry deeper than its device hit reloads it: pages are allocated and written,
the state goes straight into the request's slot, and the boundary is registered on the
device again (so the two tiers agree on the longest prefix).

Offload never waits for the device: the gathers are dispatched in program order (after every
step launched so far, so they read what the evicted slot and pages hold before anything can
reuse them) and stay device arrays until ``CacheManager.drain_host`` finds them ready and
moves them to host memory. Entries are LRU under their own byte budget (``max_bytes``).

Under multi-host the leader's :class:`HostTier` is the one index; the data is per process:
offload, reload and drop are dispatched operations (``CacheManager``), so every process keeps
the shards of each entry that its own devices held, and rebuilds them on a reload.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np


@dataclasses.dataclass
class HostEntry:
    """The leader's index entry of an offloaded prefix; the data is each process's
    :class:`HostCopy` under ``eid`` (``CacheManager.offload_prefix``)."""

    tokens: int  # prefix length (a unit multiple)
    eid: int  # the copy's id in every process's CacheManager
    nbytes: int


class HostCopy:
    """One process's part of an offloaded prefix: ``(state, conv, rows)`` — KDA state
    ``[nK, H, dk, dv]``, conv window ``[nK, W-1, 3P]``, and the prefix's pages as gathered
    ``[nM, P', page_size, W]`` (``P'`` the page count padded to a power of two with repeats
    of the first). Device arrays until :meth:`to_host` keeps, per array, this process's
    distinct shards in host memory (a slice several local devices hold is kept once);
    :meth:`device_arrays` rebuilds the global arrays from them for a reload."""

    def __init__(self, arrays: tuple):
        self.arrays = arrays
        self.host: list | None = None  # per array: (shape, dtype, sharding, {device: shard index}, {index: data})

    @property
    def on_host(self) -> bool:
        return self.host is not None

    def ready(self) -> bool:
        return self.on_host or all(a.is_ready() for a in self.arrays)

    def to_host(self) -> None:
        if self.on_host:
            return
        host = []
        for a in self.arrays:
            where, data = {}, {}
            for sh in a.addressable_shards:
                key = tuple((i.start, i.stop, i.step) for i in sh.index)
                where[sh.device] = key
                if key not in data:
                    data[key] = np.asarray(sh.data)
            host.append((a.shape, a.dtype, a.sharding, where, data))
        self.host, self.arrays = host, None

    def device_arrays(self) -> tuple:
        if not self.on_host:
            return self.arrays
        import jax

        return tuple(jax.make_array_from_single_device_arrays(
            shape, sharding, [jax.device_put(data[key], dev) for dev, key in where.items()], dtype=dtype)
            for shape, dtype, sharding, where, data in self.host)


class HostTier:
    """The leader's index of offloaded prefixes: LRU under ``max_bytes``. ``on_drop(eid)``
    runs for every entry that leaves (eviction, ``clear``), so each process frees its copy."""

    def __init__(self, max_bytes: int, on_drop=None):
        self.max_bytes = int(max_bytes)
        self.on_drop = on_drop
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
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
            self._dropped(entry)
            return False
        if key in self._entries:
            self._entries.move_to_end(key)
            self._dropped(entry)
            return True
        while self.bytes_held + entry.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes_held -= old.nbytes
            self.evicted += 1
            self._dropped(old)
        self._entries[key] = entry
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
        return e

    def _dropped(self, entry: HostEntry) -> None:
        if self.on_drop is not None:
            self.on_drop(entry.eid)

    def clear(self) -> None:
        for e in self._entries.values():
            self._dropped(e)
        self._entries.clear()
        self.bytes_held = 0

    def check_invariants(self) -> None:
        assert self.bytes_held == sum(e.nbytes for e in self._entries.values()), "host bytes are off"
        assert self.bytes_held <= self.max_bytes, "host tier over its budget"
