"""The multi-host control channel without JAX processes: frames round-trip (and refuse what
is not data), the leader replays every call on its followers in order before running it,
and a follower that closes, reports an error or falls silent is reported lost once; the
follower loop runs operations in order, answers "stop" with "bye" and reports a failing
operation. The hello: the leader keeps accepting past port probes, garbage, oversized
frames, silence and wrong proofs until the real followers join; a follower refuses a leader
that cannot prove the secret; with no secret configured the leader's generated one reaches
the followers through the key-value store (an in-process stand-in). Sockets are local."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from k3serve.server.cluster import wire
from k3serve.server.cluster.follower import FollowerChannel, run_follower
from k3serve.server.cluster.leader import LeaderDispatch
from k3serve.server.engine.dispatch import LocalDispatch


def test_frames_round_trip_and_refuse_objects():
    arrays = [np.arange(12, dtype=np.int32).reshape(3, 4), np.zeros(0, np.float32),
              np.array([1.5, -2.0], np.float64), np.array([[True, False]])]
    frame = wire.encode("op", ["step", 16, arrays[0], -1, [arrays[1], [arrays[2], "x"]], None, True, arrays[3],
                               np.int64(7)])
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        op, args = wire.recv(b)
    assert op == "op" and args[0] == "step" and args[1] == 16 and args[3] == -1 and args[5] is None
    np.testing.assert_array_equal(args[2], arrays[0])
    assert args[2].dtype == np.int32 and args[4][0].shape == (0,) and args[4][1][1] == "x"
    np.testing.assert_array_equal(args[4][1][0], arrays[2])
    np.testing.assert_array_equal(args[7], arrays[3])
    assert args[8] == 7 and isinstance(args[8], int)
    with pytest.raises(TypeError, match="cannot carry"):
        wire.encode("op", [object()])
    with pytest.raises(TypeError, match="cannot carry"):
        wire.encode("op", [{"a": 1}])


def test_closed_channel_mid_frame():
    a, b = socket.socketpair()
    a.sendall(wire.encode("op", ["x", np.ones(100)])[:50])
    a.close()
    with pytest.raises(wire.ChannelClosed):
        wire.recv(b)
    b.close()


def _pair(timeout_s=5.0):
    lead, fol = socket.socketpair()
    d = LeaderDispatch({1: lead}, timeout_s=timeout_s)
    lost = []
    d.on_lost.append(lost.append)
    return d, fol, lost


def test_leader_sends_each_call_before_running_it():
    d, fol, lost = _pair()
    seen = []
    d.register("add", lambda x, arr: seen.append((x, arr.sum())) or x + 1)
    assert d.num_processes == 2
    assert d("add", 3, np.arange(4)) == 4
    assert d("add", 5, np.ones(3)) == 6
    for want in ((3, 6), (5, 3)):
        op, args = wire.recv(fol)
        assert op == "op" and args[0] == "add" and args[1] == want[0] and args[2].sum() == want[1]
    assert seen == [(3, 6), (5, 3.0)] and not lost
    fol.close()


def _wait(cond, timeout=5.0):
    t = time.monotonic() + timeout
    while time.monotonic() < t and not cond():
        time.sleep(0.01)
    return cond()


def test_follower_closed_error_or_silent_is_lost_once():
    d, fol, lost = _pair()
    fol.close()  # the process died: the kernel closes its socket
    assert _wait(lambda: lost) and "process 1 of 2 was lost" in lost[0] and "closed" in lost[0]
    d.register("noop", lambda: None)
    d("noop")  # sending to the dead follower fails too: still reported once
    assert len(lost) == 1

    d, fol, lost = _pair()
    wire.send(fol, "error", ["step: boom"])
    assert _wait(lambda: lost) and "it failed: step: boom" in lost[0]
    fol.close()

    d, fol, lost = _pair(timeout_s=0.3)
    wire.send(fol, "hb")  # one beat, then silence
    t = time.monotonic()
    assert _wait(lambda: lost) and "no heartbeat for 0.3 s" in lost[0]
    assert time.monotonic() - t < 2.0
    fol.close()


def test_follower_loop_runs_in_order_stops_and_reports_failures():
    lead, fol = socket.socketpair()
    engine = type("E", (), {})()
    engine.dispatch = LocalDispatch()
    ran = []
    engine.dispatch.register("a", lambda x: ran.append(("a", x)))
    engine.dispatch.register("b", lambda arr: ran.append(("b", arr.tolist())))
    d = LeaderDispatch({1: lead}, timeout_s=5.0)
    d.register("a", lambda x: None)
    d.register("b", lambda arr: None)
    ch = FollowerChannel(fol, heartbeat_s=0.05)
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("code", run_follower(engine, ch)))
    th.start()
    d("a", 1)
    d("b", np.array([2, 3]))
    d("a", 4)
    assert d.stop(5.0)  # "stop" -> "bye"
    th.join(5)
    assert result["code"] == 0 and ran == [("a", 1), ("b", [2, 3]), ("a", 4)] and d.lost is None

    lead, fol = socket.socketpair()
    engine.dispatch.register("bad", lambda: 1 / 0)
    d = LeaderDispatch({1: lead}, timeout_s=5.0)
    d.register("bad", lambda: None)
    lost = []
    d.on_lost.append(lost.append)
    ch = FollowerChannel(fol, heartbeat_s=0.05)
    th = threading.Thread(target=lambda: result.__setitem__("code", run_follower(engine, ch)))
    th.start()
    d("bad")
    th.join(5)
    assert result["code"] == 1
    assert _wait(lambda: lost) and "bad: ZeroDivisionError" in lost[0]


def test_local_dispatch_refuses_a_second_registration():
    d = LocalDispatch()
    d.register("x", lambda: 1)
    with pytest.raises(ValueError, match="registered twice"):
        d.register("x", lambda: 2)
    assert d("x") == 1 and d.num_processes == 1


def test_follower_exits_when_the_leader_is_gone(tmp_path):
    """A follower whose main thread is stuck (as in a collective with a dead leader) still
    exits, with 1, once the leader's channel closes."""
    import subprocess
    import sys
    import textwrap

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    code = textwrap.dedent(f"""
        import socket, threading
        from k3serve.server.cluster.follower import FollowerChannel
        ch = FollowerChannel(socket.create_connection(("127.0.0.1", {port})), heartbeat_s=0.05)
        threading.Event().wait()  # the main thread never returns by itself
    """)
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        srv.settimeout(60)
        conn, _ = srv.accept()
        conn.settimeout(30)
        assert wire.recv(conn)[0] == "hb"  # it beats
        conn.close()
        assert child.wait(30) == 1
    finally:
        srv.close()
        if child.poll() is None:
            child.kill()
            child.wait()


# ---------------------------------------------------------------- the hello (server/cluster/hello.py)

class _FakeKV:
    """The distributed runtime's key-value store, in-process (what runtime._kv() returns)."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def key_value_set(self, k, v):
        with self.cv:
            self.d[k] = v
            self.cv.notify_all()

    def blocking_key_value_get(self, k, timeout_ms):
        with self.cv:
            assert self.cv.wait_for(lambda: k in self.d, timeout_ms / 1000)
            return self.d[k]


@pytest.fixture
def kv(monkeypatch):
    from k3serve.server.cluster import runtime

    store = _FakeKV()
    monkeypatch.setattr(runtime, "distributed_store", lambda: store)
    return store


def _cluster(pid, n=3):
    from k3serve.server.cluster.runtime import Cluster

    return Cluster(pid, n, "127.0.0.1:1")


def _lead_in_thread(n=3):
    from k3serve.server.cluster.runtime import accept_followers

    box = {}

    def run():
        try:
            box["followers"] = accept_followers(_cluster(0, n), "127.0.0.1", timeout_s=20)
        except BaseException as e:
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


SECRET = "s3cret-of-the-deployment-0123456789"


def test_leader_survives_bad_peers_until_the_real_followers_join(kv, monkeypatch):
    """A port probe, garbage, a 1 GiB length prefix, a silent peer, a wrong proof and a
    process id out of range are each refused (logged), and the real followers still join."""
    from k3serve.server.cluster.runtime import connect_to_leader
    from k3serve.server.shared_secret import sign

    monkeypatch.setenv("K3SERVE_CLUSTER_SECRET", SECRET)
    th, box = _lead_in_thread()
    host, port = kv.blocking_key_value_get("k3serve/control", 10_000).rsplit(":", 1)
    addr = (host, int(port))
    socket.create_connection(addr).close()  # a port probe
    with socket.create_connection(addr) as s:  # garbage
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.05)
    with socket.create_connection(addr) as s:  # "here come 1 GiB": refused from the length alone
        s.settimeout(5)
        s.sendall((1 << 30).to_bytes(4, "big") + b"x" * 100)
        try:
            while s.recv(4096):  # the leader closes it (a reset: our bytes are unread)
                pass
        except ConnectionResetError:
            pass
    silent = socket.create_connection(addr)  # says nothing (its hello thread times out later)
    for secret, pid, why in ((b"not-the-deployment-secret-at-all", 1, "wrong proof"),
                             (SECRET.encode(), 7, "not a follower")):
        with socket.create_connection(addr) as s:
            s.settimeout(5)
            op, (nonce,) = wire.recv(s)
            wire.send(s, "hello", [pid, "n", sign(secret, "hello", pid, nonce)])
            op, args = wire.recv(s)
            assert op == "refused" and why in args[0]
    assert th.is_alive() and "error" not in box
    socks = {pid: connect_to_leader(_cluster(pid), timeout_s=10) for pid in (2, 1)}
    th.join(10)
    assert "error" not in box and sorted(box["followers"]) == [1, 2]
    wire.send(box["followers"][2], "op", ["x"])  # the joined connections carry frames
    assert wire.recv(socks[2]) == ("op", ["x"])
    for s in [silent, *socks.values(), *box["followers"].values()]:
        s.close()


def test_a_follower_refuses_an_impostor_leader(kv, monkeypatch):
    """A listener at the control address that cannot prove the secret gets a hello it
    cannot replay, and the follower raises before sending anything else."""
    from k3serve.server.cluster.hello import HelloRefused
    from k3serve.server.cluster.runtime import connect_to_leader

    monkeypatch.setenv("K3SERVE_CLUSTER_SECRET", SECRET)
    srv = socket.create_server(("127.0.0.1", 0))
    kv.key_value_set("k3serve/control-secret", "configured")
    kv.key_value_set("k3serve/control", f"127.0.0.1:{srv.getsockname()[1]}")
    got = []

    def impostor():
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(5)
            wire.send(conn, "challenge", ["abc"])
            got.append(wire.recv(conn))
            wire.send(conn, "welcome", ["0" * 64])  # a guess
            try:
                while data := conn.recv(4096):  # anything the follower sends after the hello
                    got.append(data)
            except OSError:
                pass

    th = threading.Thread(target=impostor, daemon=True)
    th.start()
    with pytest.raises(HelloRefused, match="did not prove"):
        connect_to_leader(_cluster(1, 2), timeout_s=10)
    th.join(5)
    srv.close()
    assert [g[0] for g in got] == ["hello"]  # the hello, then nothing


def test_generated_secret_and_mixed_configuration(kv, monkeypatch):
    """No secret anywhere: the leader draws one and publishes it in the store; a follower
    that has one while the leader has none is refused with a message."""
    from k3serve.server.cluster.runtime import connect_to_leader, control_secret

    monkeypatch.delenv("K3SERVE_CLUSTER_SECRET", raising=False)
    th, box = _lead_in_thread(n=2)
    sock = connect_to_leader(_cluster(1, 2), timeout_s=10)
    th.join(10)
    assert list(box["followers"]) == [1]
    assert len(bytes.fromhex(kv.d["k3serve/control-secret"].removeprefix("generated:"))) == 32
    monkeypatch.setenv("K3SERVE_CLUSTER_SECRET", SECRET)
    with pytest.raises(ValueError, match="the leader none"):
        control_secret(_cluster(1, 2))
    sock.close()
    box["followers"][1].close()
