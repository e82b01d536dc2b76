"""The multi-host control channel without JAX processes: frames round-trip (and refuse what
is not data), the leader replays every call on its followers in order before running it,
and a follower that closes, reports an error or falls silent is reported lost once; the
follower loop runs operations in order, answers "stop" with "bye" and reports a failing
operation. Sockets are local socket pairs."""
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
