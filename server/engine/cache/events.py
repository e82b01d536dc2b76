"""KV cache events for routers (``SubscribeKvEvents``): which prefix units the cache stored
and removed, in order, numbered.

The engine thread appends one batch per engine step that changed the cache; gRPC stream
handlers (other threads) read batches after a sequence number and wait for new ones. The log
keeps the last ``capacity`` batches; a subscriber that asks for older ones gets what is kept
(it can tell from the first sequence number it sees).

A unit's public block hash is the first 8 bytes of its chained key as a signed int64 (the
proto's ``block_hash``), so a router sees exactly the cache's prefix identity — tenant salt
included — and parents before children. Stored blocks keep their token ids: smg computes
its own content hash from them to match a request's blocks, so they cannot be dropped or
replaced by our hashes; who may read them is decided at the gRPC door (``api/auth.py``).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque


def block_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "little", signed=True)


@dataclasses.dataclass
class Event:
    kind: str  # "stored" | "removed" | "cleared"
    hashes: list[int]
    parent: int | None = None  # stored: the block the first one extends (None = a root block)
    token_ids: list[list[int]] | None = None  # stored: each block's tokens
    block_size: int = 0


@dataclasses.dataclass
class Batch:
    seq: int
    timestamp: float
    events: list[Event]


class KvEventLog:
    def __init__(self, capacity: int = 4096):
        self._batches: deque[Batch] = deque(maxlen=capacity)
        self._pending: list[Event] = []
        self._seq = 0
        self._cv = threading.Condition()
        self.num_events = 0

    def add(self, event: Event) -> None:
        """Queue an event for the current step's batch (engine thread)."""
        self._pending.append(event)

    def publish(self) -> int | None:
        """Close the current batch (end of an engine step); returns its sequence number."""
        if not self._pending:
            return None
        with self._cv:
            self._seq += 1
            self._batches.append(Batch(self._seq, time.time(), self._pending))
            self.num_events += len(self._pending)
            self._pending = []
            self._cv.notify_all()
            return self._seq

    @property
    def last_seq(self) -> int:
        return self._seq

    def after(self, seq: int, timeout: float | None = None) -> list[Batch]:
        """Batches numbered above ``seq`` (waits up to ``timeout`` s for one if there are none)."""
        with self._cv:
            if self._seq <= seq and timeout:
                self._cv.wait_for(lambda: self._seq > seq, timeout)
            return [b for b in self._batches if b.seq > seq]
