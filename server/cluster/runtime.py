"""Joining the cluster: ``jax.distributed`` for the devices, one TCP connection per follower
for the plans.

Every process calls :func:`init_distributed` before anything else asks JAX for devices;
then ``jax.devices()`` lists every device of every process and a recipe's mesh spans them.
On CPU the cross-process collectives are gloo's.

The control channel is found through the distributed runtime's key-value store: the leader
(process 0, which also hosts JAX's coordination service) listens on a free port of
``control_host`` (default: the coordinator's host, which every process can reach by
definition) and publishes ``host:port``; each follower reads it, connects and says "hello"
with its process id. The store's barrier (:func:`wait_for_processes`) lines the processes up
before their first collectives.
"""
from __future__ import annotations

import dataclasses
import socket
import time

from . import wire

_KEY = "k3serve/control"


@dataclasses.dataclass(frozen=True)
class Cluster:
    process_id: int
    num_processes: int
    coordinator: str  # host:port of JAX's coordination service

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None, *,
                     auto: bool = False, timeout_s: int = 300) -> Cluster:
    """``jax.distributed.initialize`` (``auto``: let JAX find the slice, as on TPU VMs)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:
        jax.distributed.initialize(initialization_timeout=timeout_s)
    else:
        if not coordinator or num_processes is None or process_id is None:
            raise ValueError("multi-process serving needs --coordinator, --num-processes and --process-id "
                             "(or --distributed auto)")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id {process_id} is not in [0, {num_processes})")
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=timeout_s)
    from jax._src import distributed

    return Cluster(jax.process_index(), jax.process_count(), distributed.global_state.coordinator_address or coordinator)


def _kv():
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
    _kv().wait_at_barrier(f"k3serve/{name}/{_barriers}", int(timeout_s * 1000))


def accept_followers(cluster: Cluster, control_host: str | None = None, timeout_s: float = 300.0
                     ) -> dict[int, socket.socket]:
    """Leader: listen, publish the address, and wait for every follower's "hello"."""
    host = control_host or cluster.coordinator.rsplit(":", 1)[0]
    srv = socket.create_server((host, 0))
    srv.settimeout(1.0)
    port = srv.getsockname()[1]
    _kv().key_value_set(_KEY, f"{host}:{port}")
    followers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(followers) < cluster.num_processes - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, cluster.num_processes)) - set(followers))
                raise TimeoutError(f"followers {missing} did not connect to the control channel within {timeout_s:g} s")
            try:
                conn, _ = srv.accept()
            except (socket.timeout, TimeoutError):
                continue
            conn.settimeout(30.0)
            op, args = wire.recv(conn)
            if op != "hello" or not args or not 0 < int(args[0]) < cluster.num_processes or args[0] in followers:
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            followers[int(args[0])] = conn
    finally:
        srv.close()
    return followers


def connect_to_leader(cluster: Cluster, timeout_s: float = 300.0) -> socket.socket:
    """Follower: find the leader's control address and say hello."""
    addr = _kv().blocking_key_value_get(_KEY, int(timeout_s * 1000))
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    wire.send(sock, "hello", [cluster.process_id])
    return sock
