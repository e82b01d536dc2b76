"""A byte bound on the P/D handoff arrays a server holds at once (``--pd-handoff-memory-gb``).

A handoff's arrays live outside the KV pools: on the prefill, the export read out of the
cache, the pieces cut from it and staged for the decode to pull (up to the staging deadline);
on the decode, the pulled pieces and the load's inputs put together from them, until the
engine has written them into the reservation. A K3 request's KDA state alone is about
414 MiB, so without a bound a burst of handoffs runs the device out of memory. Each handoff
takes its bytes here before the memory exists and gives them back when it is gone; one that
does not fit waits (in order of arrival) until others give theirs back, and one larger than
the whole bound is refused at once. The engine's capacity plan sets the same number of bytes
aside from the KV budget (``cache/planning.py``), once per process of the side.

On a multi-host side the bound is per process: a handoff's bytes are a :class:`Share`, what it
holds on each process's devices (the prefill's export is whole on every device; each prefill
process stages its own pieces; each decode process pulls the pieces its devices need and
holds its shards of the load's inputs), and it fits when every process's share fits beside
what that process already holds. The leader keeps the books for every process.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from .errors import HandoffError


class Share(tuple):
    """Bytes per process of a side, in process order (a one-process side: one entry)."""

    @classmethod
    def of(cls, nbytes, processes: int = 1) -> "Share":
        if isinstance(nbytes, Share):
            return nbytes
        return cls((int(nbytes),) + (0,) * (processes - 1))

    def _pair(self, other):
        other = Share.of(other, len(self))
        if len(other) != len(self):
            raise ValueError(f"shares of {len(self)} and {len(other)} processes")
        return zip(self, other)

    def __add__(self, other):
        return Share(a + b for a, b in self._pair(other))

    def __sub__(self, other):
        return Share(a - b for a, b in self._pair(other))

    def minimum(self, other) -> "Share":
        return Share(min(a, b) for a, b in self._pair(other))

    def __bool__(self) -> bool:
        return any(self)


def nbytes_of(specs) -> int:
    """Bytes of arrays given as ``(shape, dtype)`` pairs."""
    import numpy as np

    return sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in specs)


def export_copies(engine) -> int:
    """About how many times its export one process holds for one handoff: twice (export and
    pieces on the prefill, pieces and load inputs on the decode); on a multi-host prefill the
    export is whole on every device of the process until it is cut, so once per local device,
    plus the pieces."""
    plane = getattr(engine, "handoff_plane", None)
    if plane is None or getattr(engine, "pd_role", None) != "prefill":
        return 2
    per: dict = {}
    for d in plane.mesh.devices.flat:
        per[d.process_index] = per.get(d.process_index, 0) + 1
    return max(per.values()) + 1


def bound_warning(engine, limit_bytes: int | None) -> str | None:
    """A warning when ``limit_bytes`` (per process) cannot hold the handoff of the longest
    prompt the engine accepts (:func:`export_copies` times its export), else None."""
    from .layout import export_specs

    if limit_bytes is None:
        return None
    copies = export_copies(engine)
    longest = engine.max_model_len - 1
    need = copies * nbytes_of(export_specs(engine, longest))
    if need <= limit_bytes:
        return None
    fits = 0
    lo, hi = 1, longest
    while lo <= hi:  # the longest prompt whose handoff fits
        mid = (lo + hi) // 2
        if copies * nbytes_of(export_specs(engine, mid)) <= limit_bytes:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    why = f", the export whole on each of {copies - 1} devices of a process" if copies > 2 else ""
    return (f"--pd-handoff-memory-gb {limit_bytes / 2**30:g} holds the handoff of prompts up to about {fits} tokens "
            f"(max-model-len {engine.max_model_len}{why}): longer P/D requests will be refused RESOURCE_EXHAUSTED; "
            f"--pd-handoff-memory-gb {-(-need * 100 // 2**30) / 100:g} holds the longest")


class HandoffBudget:
    """``limit_bytes`` per process of a side of ``processes`` (None: unbounded, counted only)."""

    def __init__(self, limit_bytes: int | None, processes: int = 1):
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"the P/D handoff memory bound must be > 0 bytes, got {limit_bytes}")
        self.limit = limit_bytes  # None: unbounded (counted only)
        self.processes = processes
        self._cond = threading.Condition()
        self._queue: list[object] = []  # tickets of the waiting acquires, oldest first
        self.in_use_per_process = [0] * processes
        self.peak_per_process = [0] * processes
        self.refused = 0

    @property
    def in_use(self) -> int:
        """The most any process holds now."""
        return max(self.in_use_per_process)

    @property
    def peak(self) -> int:
        return max(self.peak_per_process)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, nbytes: int, *, deadline: float, alive: Callable[[], bool] = lambda: True,
                what: str = "this handoff") -> None:
        """Take ``nbytes``, waiting (first come, first served) until they fit; HandoffError
        RESOURCE_EXHAUSTED if they never can or ``deadline`` (monotonic) passes first,
        CANCELLED if ``alive()`` turns false while waiting."""
        share = Share.of(nbytes, self.processes)
        if len(share) != self.processes:
            raise ValueError(f"a share of {len(share)} processes for a side of {self.processes}")
        if self.limit is not None and max(share) > self.limit:
            with self._cond:
                self.refused += 1
            p = share.index(max(share))
            on = f" on process {p}" if self.processes > 1 else ""
            raise HandoffError("RESOURCE_EXHAUSTED",
                               f"{what} needs {max(share) / 2**30:.3f} GiB of handoff memory{on}, more than the whole "
                               f"--pd-handoff-memory-gb bound ({self.limit / 2**30:.3f} GiB)")
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._fits(share)):
                    if not alive():
                        raise HandoffError("CANCELLED", f"{what} was cancelled while it waited for handoff memory")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        bound = f"{self.limit / 2**30:.3f}" if self.limit is not None else "unbounded"
                        raise HandoffError("RESOURCE_EXHAUSTED",
                                           f"{what} waited too long for {max(share) / 2**30:.3f} GiB of handoff memory "
                                           f"({self.in_use / 2**30:.3f} GiB in use, bound {bound})")
                    self._cond.wait(min(left, 0.1))
                for p, n in enumerate(share):
                    self.in_use_per_process[p] += n
                    self.peak_per_process[p] = max(self.peak_per_process[p], self.in_use_per_process[p])
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _fits(self, share: Share) -> bool:
        return self.limit is None or all(u + n <= self.limit for u, n in zip(self.in_use_per_process, share))

    def release(self, nbytes) -> None:
        share = Share.of(nbytes, self.processes)
        with self._cond:
            for p, n in enumerate(share):
                self.in_use_per_process[p] -= n
                assert self.in_use_per_process[p] >= 0, "handoff memory released twice"
            self._cond.notify_all()
