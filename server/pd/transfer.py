"""The data plane: JAX's transfer server (``jax.experimental.transfer``), one per server process.

The prefill *stages* a handoff's arrays under a 64-bit id (``await_pull``, with a deadline after
which the server drops them: a decode that never pulls costs nothing for long); the decode
*pulls* them by that id onto its own device. A pull returns at once with arrays that become
ready when the bytes have arrived, and never if the prefill died: :func:`wait_ready` polls them
against a deadline so that a lost prefill is an error, never a hang. The transfer copies raw
shards and never reshards (a pull with another layout returns wrong values silently), so both
sides check :mod:`.layout` first and each array is a single-device piece pulled whole onto one
device (``engine/cache/deal.py`` cuts and reassembles them for the two layouts).
"""
from __future__ import annotations

import datetime
import socket
import threading
import time

import jax


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def transfer_host(host: str, transfer_host: str | None = None, toward: str | None = None) -> str:
    """The address a process's transfer server binds and announces (``--transfer-host``): given,
    that; else ``host`` (``--host``) unless it is a wildcard, which the other side cannot dial
    (the transfer server announces the address it is bound to); then this host's own address,
    on the route toward ``toward`` (a multi-host side's coordinator) or its hostname's."""
    if transfer_host:
        if transfer_host in WILDCARDS:
            raise ValueError(f"--transfer-host {transfer_host!r}: give an address the other side can dial, not a "
                             "wildcard")
        return transfer_host
    if host not in WILDCARDS:
        return host
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((toward, 9))  # UDP: picks the route, sends nothing
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


class TransferEndpoint:
    def __init__(self, host: str = "127.0.0.1", device=None):
        from jax.experimental import transfer

        self.device = device if device is not None else jax.devices()[0]
        self.server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"])
        self.address = self.server.address()
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    def stage(self, uuid: int, arrays, timeout_s: float) -> None:
        """Offer ``arrays`` for one pull under ``uuid``; dropped after ``timeout_s`` unpulled."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self.server.await_pull(uuid, list(arrays), timeout=deadline)

    def pull(self, address: str, uuid: int, specs, devices=None) -> list:
        """Start pulling ``uuid`` from the endpoint at ``address``: arrays of ``specs``
        (``(shape, dtype)`` pairs), each on its device of ``devices`` (default: this
        endpoint's), not ready yet."""
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self.server.connect(address)
        devices = devices if devices is not None else [self.device] * len(specs)
        return conn.pull(uuid, [jax.ShapeDtypeStruct(tuple(s), d, sharding=jax.sharding.SingleDeviceSharding(dev))
                                for (s, d), dev in zip(specs, devices, strict=True)])


def wait_ready(arrays, timeout_s: float) -> bool:
    """True once every array is ready; False if ``timeout_s`` passed first."""
    from ..engine.cache.handoff_plane import all_ready

    return all_ready(arrays, time.monotonic() + timeout_s)
