"""The leader's side of the control channel: replay every device call on the followers, and
watch that they are alive.

:class:`LeaderDispatch` is the engine's dispatch on process 0. A call sends the operation's
name and host arguments to every follower (one frame each, in call order, on one TCP
connection per follower), then runs it locally; the followers run the same operation on
their own engine, so every process launches the same programs in the same order. The send
never waits for a follower to run anything, so async scheduling keeps its overlap: the
leader plans step N+1 while step N runs everywhere.

Liveness: each follower sends a heartbeat frame every ``heartbeat_s`` from a thread of its
own (it keeps beating while its main thread compiles or waits in a collective). One monitor
thread per follower reads them with a timeout of ``timeout_s``; a follower whose channel
closes (its process died: the kernel closes the socket, even on SIGKILL), that reports an
error, or that is silent for ``timeout_s`` is *lost*: the ``on_lost`` callbacks run once,
with a message saying which process and why. A collective waiting for a dead peer may
never return, so the leader does not wait for the engine to notice: the serving process
fails every request and exits.

Orderly stop: :meth:`stop` sends "stop"; each follower answers "bye" and exits 0.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Callable

from ..engine.dispatch import LocalDispatch
from . import wire


class LeaderDispatch(LocalDispatch):
    def __init__(self, followers: dict[int, socket.socket], *, timeout_s: float = 10.0):
        super().__init__()
        self.followers = dict(followers)  # process id -> connected socket (after "hello")
        self.num_processes = 1 + len(self.followers)
        self.timeout_s = timeout_s
        self.on_lost: list[Callable[[str], None]] = []
        self.lost: str | None = None
        self._stopping = False
        self._bye: set[int] = set()
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        for pid, sock in self.followers.items():
            sock.settimeout(timeout_s)
            threading.Thread(target=self._watch, args=(pid, sock), name=f"k3-watch-{pid}", daemon=True).start()

    def __call__(self, name: str, *args):
        self._send("op", [name, *args])
        return super().__call__(name, *args)

    def _send(self, op: str, args) -> None:
        frame = wire.encode(op, args)
        with self._send_lock:
            for pid, sock in self.followers.items():
                try:
                    sock.sendall(frame)
                except OSError as e:
                    self._lose(pid, f"sending to it failed: {e!r}")

    def _watch(self, pid: int, sock: socket.socket) -> None:
        while True:
            try:
                op, args = wire.recv(sock)
            except (socket.timeout, TimeoutError):
                if pid in self._bye:
                    return
                self._lose(pid, f"no heartbeat for {self.timeout_s:g} s")
                return
            except (wire.ChannelClosed, OSError) as e:
                if pid not in self._bye:
                    self._lose(pid, f"its control channel closed ({e})")
                return
            if op == "bye":
                with self._cv:
                    self._bye.add(pid)
                    self._cv.notify_all()
            elif op == "error":
                self._lose(pid, f"it failed: {args[0] if args else '?'}")
                return

    def _lose(self, pid: int, why: str) -> None:
        with self._cv:
            if self.lost is not None or (self._stopping and pid in self._bye):
                return
            self.lost = f"process {pid} of {self.num_processes} was lost: {why}"
            self._cv.notify_all()
        print(f"k3serve: {self.lost}", file=sys.stderr, flush=True)
        for cb in list(self.on_lost):
            try:
                cb(self.lost)
            except Exception as e:  # a listener must not hide the loss
                print(f"k3serve: on_lost listener failed: {e!r}", file=sys.stderr, flush=True)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Tell every follower to exit; True when all said "bye" within ``timeout_s``."""
        with self._cv:
            self._stopping = True
        self._send("stop", [])
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while len(self._bye) < len(self.followers) and self.lost is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            done = len(self._bye) == len(self.followers)
        for sock in self.followers.values():
            try:
                sock.close()
            except OSError:
                pass
        return done
