"""Where the engine's device calls go: by name, with host values only.

Every device program the engine launches while serving (the step and its sampling, a token
table row, the prefix cache's page and slot copies, a host-tier reload) is registered here
under a name by the object that owns the device state (``Runner``, ``CacheManager``) and
called as ``dispatch(name, *args)`` with plain host values: ints, strings, numpy arrays.
Device state never crosses the call; each process holds its own shards of it.

In one process (:class:`LocalDispatch`) a call runs the operation at once. Under multi-host
the leader's dispatch (``server.cluster.leader``) first sends the name and arguments to
every follower, which runs the same operation on the same objects, so all processes launch
the same programs in the same order and XLA's collectives line up. What runs at
construction (cache allocation, warm-up) is not dispatched: every process builds the same
engine with the same arguments and so runs it in the same order by itself.
"""
from __future__ import annotations

from typing import Callable


class LocalDispatch:
    """Runs each registered operation at once, in this process."""

    #: processes that run each operation (the leader and its followers)
    num_processes = 1

    def __init__(self):
        self.ops: dict[str, Callable] = {}

    def register(self, name: str, fn: Callable) -> None:
        if name in self.ops:
            raise ValueError(f"device operation {name!r} is registered twice")
        self.ops[name] = fn

    def __call__(self, name: str, *args):
        return self.ops[name](*args)
