"""Joining the cluster: ``jax.distributed`` for the devices, one TCP connection per follower
for the plans.

Every process calls :func:`init_distributed` before anything else asks JAX for devices;
then ``jax.devices()`` lists every device of every process and a recipe's mesh spans them.
On CPU the cross-process collectives are gloo's.

The control channel is found through the distributed runtime's key-value store: the leader
(process 0, which also hosts JAX's coordination service) listens on a free port of
``control_host`` (default: the coordinator's host, which every process can reach by
definition) and publishes ``host:port``; each follower reads it, connects and proves it holds
the deployment's secret (``hello.py``; the secret: :func:`control_secret`). The store's barrier (``engine.process_barrier.wait_for_processes``) lines the processes up
before their first collectives.
"""
from __future__ import annotations

import dataclasses
import secrets
import socket

from ..engine.process_barrier import distributed_store
from . import hello

_KEY = "k3serve/control"
_SECRET_KEY = "k3serve/control-secret"


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




def control_secret(cluster: Cluster, secret_file: str | None = None, timeout_s: float = 300.0) -> bytes:
    """The secret the control hello is proved with (``hello.py``).

    Configured (``--cluster-secret-file`` or ``$K3SERVE_CLUSTER_SECRET``): every process must
    have the same one. Not configured on any process: the leader draws a random one and
    publishes it in the distributed runtime's key-value store, where the followers read it —
    so the hello is then exactly as protected as JAX's coordination service (whoever can
    talk to the coordinator can read the key). It still keeps port probes and stray processes
    that never joined the coordinator off the channel. A deployment whose coordinator is
    reachable by others should configure a secret. Mixing the two ways is refused here, with
    a message, rather than as a wrong proof later. The leader publishes its mode before the
    control address, so a follower that has the address finds the mode at once."""
    from ..shared_secret import load_secret

    mine = load_secret(secret_file)
    if cluster.is_leader:
        if mine is None:
            mine = secrets.token_bytes(32)
            distributed_store().key_value_set(_SECRET_KEY, "generated:" + mine.hex())
        else:
            distributed_store().key_value_set(_SECRET_KEY, "configured")
        return mine
    mode = distributed_store().blocking_key_value_get(_SECRET_KEY, int(timeout_s * 1000))
    if mode == "configured":
        if mine is None:
            raise ValueError("the leader was given a cluster secret (--cluster-secret-file or "
                             "$K3SERVE_CLUSTER_SECRET) and this process none: give every process the same")
        return mine
    if mine is not None:
        raise ValueError("this process was given a cluster secret and the leader none: give every process the same")
    return bytes.fromhex(mode.removeprefix("generated:"))


def accept_followers(cluster: Cluster, control_host: str | None = None, timeout_s: float = 300.0, *,
                     secret_file: str | None = None) -> dict[int, socket.socket]:
    """Leader: listen, publish the address, and wait until every follower has proved itself
    (``hello.accept_hellos``; bad connections are logged and the leader keeps waiting)."""
    secret = control_secret(cluster, secret_file)
    host = control_host or cluster.coordinator.rsplit(":", 1)[0]
    srv = socket.create_server((host, 0))
    port = srv.getsockname()[1]
    distributed_store().key_value_set(_KEY, f"{host}:{port}")
    try:
        return hello.accept_hellos(srv, secret, cluster.num_processes, timeout_s)
    finally:
        srv.close()


def connect_to_leader(cluster: Cluster, timeout_s: float = 300.0, *, secret_file: str | None = None) -> socket.socket:
    """Follower: find the leader's control address, connect, and run the hello (raises
    ``hello.HelloRefused`` when the leader refuses us or cannot prove itself)."""
    addr = distributed_store().blocking_key_value_get(_KEY, int(timeout_s * 1000))
    secret = control_secret(cluster, secret_file, timeout_s)
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    try:
        hello.greet(sock, secret, cluster.process_id)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
