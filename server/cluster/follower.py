"""A follower process's loop: run what the leader dispatches, beat, and exit with it.

The follower built the same engine as the leader (same arguments, so the same cache
allocation and warm-up programs, in the same order). It never schedules: it receives the
leader's frames and runs each operation on its own engine's objects (``engine.dispatch``),
in order. Three threads:

* a reader, which only moves frames from the socket to a queue. A closed channel means the
  leader is gone; the follower may at that moment be blocked inside a collective that will
  never complete, so the reader ends the process itself (exit 1);
* a heartbeat thread, one small frame every ``heartbeat_s`` (see ``leader.py``);
* the main thread, which runs the operations. An operation that raises is reported to the
  leader ("error") and the process exits 1; "stop" is answered with "bye", exit 0.
"""
from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import traceback

from . import wire


class FollowerChannel:
    """The follower's end of the control channel, beating from the moment it is made (so a
    follower that is still loading or compiling counts as alive)."""

    def __init__(self, sock: socket.socket, *, heartbeat_s: float = 1.0):
        self.sock = sock
        self.frames: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._done = threading.Event()
        threading.Thread(target=self._read, name="k3-follower-read", daemon=True).start()
        threading.Thread(target=self._beat, args=(heartbeat_s,), name="k3-follower-beat", daemon=True).start()

    def send(self, op: str, args=()) -> None:
        with self._send_lock:
            wire.send(self.sock, op, args)

    def _read(self) -> None:
        try:
            while True:
                self.frames.put(wire.recv(self.sock))
        except (wire.ChannelClosed, OSError) as e:
            if not self._done.is_set():
                print(f"k3serve: the leader is gone ({e}); exiting", file=sys.stderr, flush=True)
                os._exit(1)  # the main thread may be inside a collective that never completes

    def _beat(self, every: float) -> None:
        while not self._done.wait(every):
            try:
                self.send("hb")
            except OSError:
                return  # the reader sees the closed channel

    def close(self) -> None:
        self._done.set()
        try:
            self.sock.close()
        except OSError:
            pass


def run_follower(engine, channel: FollowerChannel) -> int:
    """Run the leader's operations on ``engine`` until "stop" (returns 0). A failing
    operation is reported to the leader and returns 1. After each operation the follower
    moves its finished host-tier offload copies to host memory, as the leader does after
    each step."""
    drain = getattr(getattr(engine, "cache_mgr", None), "drain_host", None)
    while True:
        op, args = channel.frames.get()
        if op == "op":
            try:
                engine.dispatch(*args)
                if drain is not None:
                    drain()
            except BaseException as e:
                traceback.print_exc()
                try:
                    channel.send("error", [f"{args[0] if args else '?'}: {e!r}"])
                except OSError:
                    pass
                channel.close()
                return 1
        elif op == "stop":
            channel._done.set()
            channel.send("bye")
            channel.close()
            return 0
        else:
            print(f"k3serve: unknown control frame {op!r}", file=sys.stderr, flush=True)
