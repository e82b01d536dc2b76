"""The data plane's readiness check (``server/pd/transfer.py``): a pull from a peer that died
after staging is *ready* at once, holding an error (found by test_pd_multihost's prefill
follower kill: handed on, the errored piece failed the decode's load program on one device
while the other waited in its collective until XLA aborted the process). ``wait_ready``
must say False for it, at once, and True for a pull that arrived."""
from __future__ import annotations

import subprocess
import sys
import time

PEER = r"""
import datetime, sys, time
import jax, numpy as np
from jax.experimental import transfer
d = jax.devices()[0]
srv = transfer.start_transfer_server(d.client, "127.0.0.1:0", ["127.0.0.1:0"])
x = jax.device_put(np.arange(4, dtype=np.float32), d)
for uuid in (1, 2):
    srv.await_pull(uuid, [x], timeout=datetime.datetime.now() + datetime.timedelta(seconds=120))
print(srv.address(), flush=True)
time.sleep(300)
"""


def test_a_pull_from_a_dead_peer_is_not_ready():
    import jax
    import numpy as np

    from k3serve.server.pd.transfer import TransferEndpoint, wait_ready

    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    try:
        addr = peer.stdout.readline().strip()
        assert addr, "the peer never started"
        ep = TransferEndpoint()
        spec = [((4,), np.float32)]
        got = ep.pull(addr, 1, spec)
        assert wait_ready(got, 30) and np.array_equal(np.asarray(got[0]), np.arange(4, dtype=np.float32))
        peer.kill()
        peer.wait(10)
        t = time.monotonic()
        lost = ep.pull(addr, 2, spec)
        assert wait_ready(lost, 30) is False
        assert time.monotonic() - t < 10  # an error, not the deadline
        assert jax.device_put(np.ones(2), jax.devices()[0]).sum() == 2  # the device serves on
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)


def test_the_transfer_host_is_never_a_wildcard():
    """``--host 0.0.0.0`` binds gRPC everywhere, but a transfer server bound there announces
    0.0.0.0, which the other side cannot dial: it binds this host's own address instead, and a
    pull from that announced address works."""
    import numpy as np
    import pytest

    from k3serve.server.pd.transfer import TransferEndpoint, transfer_host, wait_ready

    assert transfer_host("127.0.0.1") == "127.0.0.1"
    assert transfer_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert transfer_host("0.0.0.0", toward="127.0.0.1") == "127.0.0.1"  # the route to a local coordinator
    own = transfer_host("0.0.0.0")
    assert own not in ("0.0.0.0", "::", "")
    with pytest.raises(ValueError, match="not a wildcard"):
        transfer_host("127.0.0.1", "0.0.0.0")
    import jax

    a, b = TransferEndpoint(own), TransferEndpoint("127.0.0.1")
    assert a.address.rsplit(":", 1)[0] == own
    a.stage(5, [jax.device_put(np.arange(3, dtype=np.float32))], 30)
    got = b.pull(a.address, 5, [((3,), np.float32)])
    assert wait_ready(got, 30) and np.array_equal(np.asarray(got[0]), np.arange(3, dtype=np.float32))
