"""Round trip of one step-sized control message on loopback: our framing (server/cluster/wire.py
over TCP) against a gRPC unary call and a gRPC bidirectional stream carrying the same bytes.

The leader never waits for a follower per step (sends are one-way), so the round trip is an
upper bound on what the channel adds; docs/multihost.md quotes the medians.

    python tools/control_channel_rtt.py [--n 2000] [--ints 1024]
"""
from __future__ import annotations

import argparse
import queue
import socket
import statistics
import threading
import time
from concurrent import futures

import grpc
import numpy as np

from k3serve.server.cluster import wire


def _median_us(fn, n):
    for _ in range(min(200, n)):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6, sorted(ts)[int(0.99 * n)] * 1e6


def ours(step, n):
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    conn, _ = srv.accept()
    for s in (cli, conn):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def follower():
        try:
            while True:
                wire.recv(conn)
                wire.send(conn, "hb")
        except (wire.ChannelClosed, OSError):
            pass

    threading.Thread(target=follower, daemon=True).start()

    def once():
        wire.send(cli, "op", ["step", 256, step, 7])
        wire.recv(cli)

    out = _median_us(once, n)
    cli.close()
    srv.close()
    return out


def grpc_calls(step, n):
    payload = wire.encode("op", ["step", 256, step, 7])  # the same bytes
    ident = (lambda b: b)
    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"ok", ident, ident),
                "Chat": grpc.stream_stream_rpc_method_handler(lambda it, ctx: (b"ok" for _ in it), ident, ident)}
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("k3.Control", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    echo = ch.unary_unary("/k3.Control/Echo", ident, ident)
    unary = _median_us(lambda: echo(payload), n)
    q: queue.SimpleQueue = queue.SimpleQueue()
    replies = ch.stream_stream("/k3.Control/Chat", ident, ident)(iter(q.get, None))

    def once():
        q.put(payload)
        next(replies)

    stream = _median_us(once, n)
    q.put(None)
    ch.close()
    server.stop(0)
    return unary, stream


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--ints", type=int, default=1024, help="int32s of step metadata per message (default 4 KiB)")
    a = p.parse_args(argv)
    step = np.arange(a.ints, dtype=np.int32)
    size = len(wire.encode("op", ["step", 256, step, 7]))
    rows = [("wire.py over TCP", ours(step, a.n)), *zip(("gRPC unary", "gRPC bidi stream"), grpc_calls(step, a.n))]
    print(f"round trip of a {size}-byte step message on loopback, {a.n} times (median, p99):")
    for name, (med, p99) in rows:
        print(f"  {name:18s} {med:8.1f} us  {p99:8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
