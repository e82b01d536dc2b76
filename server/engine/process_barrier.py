"""The distributed runtime's barrier: every process of a multi-host deployment waits here
before its first cross-process collectives (a no-op in one process).

It lives in the engine, below the cluster's control channel, because the runner itself waits
at it after compiling its warm-up programs; ``server/cluster/runtime.py`` uses the same one.
"""
from __future__ import annotations


def distributed_store():
    """The distributed runtime's key-value store client (barriers; the control channel's address and secret)."""
    from jax._src import distributed

    return distributed.global_state.client


_barriers = 0


def wait_for_processes(name: str, timeout_s: float = 1800.0) -> None:
    """Block until every process of the deployment has called this (in the same order; the
    distributed runtime's barrier, not a device collective). A no-op in one process.

    Why: the first run of a program with cross-process collectives sets up gloo's
    communicator, which waits only 30 s for the other processes (a fixed deadline). A process
    that compiles slower (a busy host, a cold compile cache) misses it and the deployment
    fails to start; waiting here after compiling, with a deadline of ``timeout_s``, makes the
    first collective find every process ready."""
    import jax

    global _barriers
    if jax.process_count() == 1:
        return
    _barriers += 1
    distributed_store().wait_at_barrier(f"k3serve/{name}/{_barriers}", int(timeout_s * 1000))
