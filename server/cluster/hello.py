"""The control channel's hello: who may become a follower, and who may be the leader.

The channel carries every prompt's token ids and every step the deployment runs, so the
leader admits only a peer that proves it holds the deployment's shared secret
(``server/shared_secret.py``), and a follower talks only to a leader that proves the same.
Challenge-response, both ways, three frames; the secret never crosses the network:

    leader   -> follower   "challenge" [nonce_L]
    follower -> leader     "hello"     [process_id, nonce_F, sign(secret, "hello", process_id, nonce_L)]
    leader   -> follower   "welcome"   [sign(secret, "welcome", process_id, nonce_F, nonce_L)]
                        or "refused"   [why]

Fresh nonces on both sides make a recorded hello or welcome useless later; the different
labels keep one side's proof from being played back as the other's.

Until a peer has proved itself, a frame may be at most ``wire.HELLO_MAX_FRAME`` bytes and the
peer has ``hello_timeout_s`` to finish. Whatever a bad peer does — a port probe that connects
and closes, garbage, a huge length prefix, silence, a wrong proof, a process id out of range
or already taken — costs the leader one log line and one short-lived thread, and the leader
keeps accepting until every real follower has joined (:func:`accept_hellos`).

What this is not: the frames after the hello are neither encrypted nor signed. The hello
keeps strangers and stray processes off the channel; someone who can rewrite the traffic
between two hosts of the deployment is out of its reach (keep the control host on the
deployment's private network; docs/multihost.md).
"""
from __future__ import annotations

import socket
import sys
import threading
import time

from ..shared_secret import new_nonce, sign, verify
from . import wire


class HelloRefused(ConnectionError):
    """The other end of the hello did not prove it holds the deployment's secret (or refused us)."""


def _log(msg: str) -> None:
    print(f"k3serve: control channel: {msg}", file=sys.stderr, flush=True)


def _recv_small(sock: socket.socket) -> tuple[str, list]:
    return wire.recv(sock, max_frame=wire.HELLO_MAX_FRAME)


def welcome(conn: socket.socket, secret: bytes, pid: int, their_nonce: str, nonce: str) -> None:
    wire.send(conn, "welcome", [sign(secret, "welcome", pid, their_nonce, nonce)])


def _refuse(conn: socket.socket, why: str) -> None:
    try:
        wire.send(conn, "refused", [why])
    except OSError:
        pass


def greet(sock: socket.socket, secret: bytes, process_id: int) -> None:
    """Follower: answer the leader's challenge and check its welcome. Raises
    :class:`HelloRefused` when the leader refuses us or cannot prove it holds the secret (an
    impostor gets a hello it cannot replay, and never a single step or prompt)."""
    op, args = _recv_small(sock)
    if op != "challenge" or len(args) != 1 or not isinstance(args[0], str):
        raise HelloRefused(f"the control address did not answer as a k3serve leader (got {op!r})")
    theirs, mine = args[0], new_nonce()
    wire.send(sock, "hello", [process_id, mine, sign(secret, "hello", process_id, theirs)])
    op, args = _recv_small(sock)
    if op == "refused":
        raise HelloRefused(f"the leader refused this process: {args[0] if args else '?'}")
    if op != "welcome" or len(args) != 1 or not verify(secret, args[0], "welcome", process_id, mine, theirs):
        raise HelloRefused("the leader did not prove it holds the deployment's cluster secret; "
                           "not sending it anything")


def accept_hellos(srv: socket.socket, secret: bytes, num_processes: int, timeout_s: float = 300.0,
                  hello_timeout_s: float = 10.0) -> dict[int, socket.socket]:
    """Leader: accept on the listening ``srv`` until followers 1..num_processes-1 have each
    proved themselves; returns process id -> connection (``srv`` is left open). Every
    connection's hello runs on its own thread, so a slow or silent peer delays nobody. Raises
    ``TimeoutError`` naming the missing followers after ``timeout_s``."""
    followers: dict[int, socket.socket] = {}
    cv = threading.Condition()
    done = False
    want = num_processes - 1

    def handshake(conn: socket.socket, addr) -> None:
        try:
            conn.settimeout(hello_timeout_s)
            nonce = new_nonce()
            wire.send(conn, "challenge", [nonce])
            op, args = _recv_small(conn)
            pid = _check_hello(conn, secret, num_processes, nonce, op, args)
            with cv:
                if done or pid in followers:
                    why = "the deployment is complete" if done else f"process {pid} has already joined"
                    _refuse(conn, why)
                    raise HelloRefused(why)
                welcome(conn, secret, pid, args[1], nonce)
                conn.settimeout(30.0)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                followers[pid] = conn
                cv.notify_all()
        except Exception as e:  # a bad peer never stops the accept loop
            _log(f"refused a connection from {addr}: {e if isinstance(e, HelloRefused) else repr(e)}")
            try:
                conn.close()
            except OSError:
                pass

    deadline = time.monotonic() + timeout_s
    srv.settimeout(0.2)
    try:
        while True:
            with cv:
                if len(followers) >= want:
                    done = True
                    return dict(followers)
            if time.monotonic() > deadline:
                with cv:
                    done = True
                    missing = sorted(set(range(1, num_processes)) - set(followers))
                    for c in followers.values():
                        c.close()
                raise TimeoutError(f"followers {missing} did not join the control channel within {timeout_s:g} s "
                                   "(a follower with another cluster secret is refused: see the log)")
            try:
                conn, addr = srv.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError as e:  # e.g. too many open files: keep going
                _log(f"accept failed: {e!r}")
                time.sleep(0.05)
                continue
            threading.Thread(target=handshake, args=(conn, addr), name="k3-hello", daemon=True).start()
    finally:
        with cv:
            done = True


def _check_hello(conn, secret: bytes, num_processes: int, nonce: str, op, args) -> int:
    if op != "hello" or not isinstance(args, list) or len(args) != 3:
        raise HelloRefused(f"expected a hello, got {op!r}")
    pid, their_nonce, proof = args
    if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(their_nonce, str) or len(their_nonce) > 64:
        raise HelloRefused("malformed hello")
    if not verify(secret, proof, "hello", pid, nonce):
        _refuse(conn, "wrong proof: this process does not hold the deployment's cluster secret")
        raise HelloRefused(f"wrong proof (claimed process {pid})")
    if not 0 < pid < num_processes:
        _refuse(conn, f"process id {pid} is not a follower of a {num_processes}-process deployment")
        raise HelloRefused(f"process id {pid} out of range")
    return pid
