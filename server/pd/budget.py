"""A byte bound on the P/D handoff arrays a server holds at once (``--pd-handoff-memory-gb``).

A handoff's arrays live outside the KV pools: on the prefill, the export read out of the
cache, the pieces cut from it and staged for the decode to pull (up to the staging deadline);
on the decode, the pulled pieces and the load's inputs put together from them, until the
engine has written them into the reservation. A K3 request's KDA state alone is about
414 MiB, so without a bound a burst of handoffs runs the device out of memory. Each handoff
takes its bytes here before the memory exists and gives them back when it is gone; one that
does not fit waits (in order of arrival) until others give theirs back, and one larger than
the whole bound is refused at once. The engine's capacity plan sets the same number of bytes
aside from the KV budget (``cache/planning.py``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from .errors import HandoffError


def nbytes_of(specs) -> int:
    """Bytes of arrays given as ``(shape, dtype)`` pairs."""
    import numpy as np

    return sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in specs)


def bound_warning(engine, limit_bytes: int | None) -> str | None:
    """A warning when ``limit_bytes`` cannot hold the handoff of the longest prompt the engine
    accepts (about twice its export: export and pieces on the prefill, pieces and load inputs
    on the decode), else None."""
    from .layout import export_specs

    if limit_bytes is None:
        return None
    longest = engine.max_model_len - 1
    if 2 * nbytes_of(export_specs(engine, longest)) <= limit_bytes:
        return None
    fits = 0
    lo, hi = 1, longest
    while lo <= hi:  # the longest prompt whose handoff fits
        mid = (lo + hi) // 2
        if 2 * nbytes_of(export_specs(engine, mid)) <= limit_bytes:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    return (f"--pd-handoff-memory-gb {limit_bytes / 2**30:g} holds the handoff of prompts up to about {fits} tokens "
            f"(max-model-len {engine.max_model_len}): longer P/D requests will be refused RESOURCE_EXHAUSTED")


class HandoffBudget:
    def __init__(self, limit_bytes: int | None):
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"the P/D handoff memory bound must be > 0 bytes, got {limit_bytes}")
        self.limit = limit_bytes  # None: unbounded (counted only)
        self._cond = threading.Condition()
        self._queue: list[object] = []  # tickets of the waiting acquires, oldest first
        self.in_use = 0
        self.peak = 0
        self.refused = 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def acquire(self, nbytes: int, *, deadline: float, alive: Callable[[], bool] = lambda: True,
                what: str = "this handoff") -> None:
        """Take ``nbytes``, waiting (first come, first served) until they fit; HandoffError
        RESOURCE_EXHAUSTED if they never can or ``deadline`` (monotonic) passes first,
        CANCELLED if ``alive()`` turns false while waiting."""
        nbytes = int(nbytes)
        if self.limit is not None and nbytes > self.limit:
            with self._cond:
                self.refused += 1
            raise HandoffError("RESOURCE_EXHAUSTED",
                               f"{what} needs {nbytes / 2**30:.3f} GiB of handoff memory, more than the whole "
                               f"--pd-handoff-memory-gb bound ({self.limit / 2**30:.3f} GiB)")
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._fits(nbytes)):
                    if not alive():
                        raise HandoffError("CANCELLED", f"{what} was cancelled while it waited for handoff memory")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        bound = f"{self.limit / 2**30:.3f}" if self.limit is not None else "unbounded"
                        raise HandoffError("RESOURCE_EXHAUSTED",
                                           f"{what} waited too long for {nbytes / 2**30:.3f} GiB of handoff memory "
                                           f"({self.in_use / 2**30:.3f} GiB in use, bound {bound})")
                    self._cond.wait(min(left, 0.1))
                self.in_use += nbytes
                self.peak = max(self.peak, self.in_use)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _fits(self, nbytes: int) -> bool:
        return self.limit is None or self.in_use + nbytes <= self.limit

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_use -= int(nbytes)
            assert self.in_use >= 0, "handoff memory released twice"
            self._cond.notify_all()
