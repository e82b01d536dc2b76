"""The control channel's frames: a step plan or a control word, never a tensor's worth of data.

A frame is a 4-byte big-endian length, then a JSON header, then the raw bytes of the numpy
arrays the header names. Values allowed in a message: None, bools, ints, floats, strings,
lists and 1-byte-to-8-byte numpy arrays (the packed metadata of a step, page and slot index
lists, a token table row). No pickle: a frame is data, whoever sent it.

    {"op": "step", "args": [16, {"nd": 0}, -1]}  +  the bytes of array 0

Sizes: a step's metadata is a few KiB; the largest frame the engine sends is a token table
row (``vocab_size`` int32s, 650 KB for K3), once per admission that uses penalties.
"""
from __future__ import annotations

import json
import socket
import struct

import numpy as np

MAX_FRAME = 1 << 30
HELLO_MAX_FRAME = 4096  # before a peer has proved itself (``hello.py``): a few KB, never a GiB
_LEN = struct.Struct(">I")


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or it broke) before a whole frame arrived."""


def encode(op: str, args=()) -> bytes:
    arrays: list[np.ndarray] = []

    def enc(v):
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            arrays.append(a)
            return {"nd": len(arrays) - 1, "dtype": a.dtype.str, "shape": list(a.shape)}
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise TypeError(f"a control message cannot carry {type(v).__name__}")

    header = json.dumps({"op": op, "args": [enc(a) for a in args]}).encode()
    body = _LEN.pack(len(header)) + header + b"".join(a.tobytes() for a in arrays)
    if len(body) > MAX_FRAME:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> tuple[str, list]:
    (n,) = _LEN.unpack_from(body)
    head = json.loads(body[4:4 + n])
    view, off = memoryview(body), 4 + n
    metas: dict[int, dict] = {}

    def collect(v):
        if isinstance(v, dict):
            metas[v["nd"]] = v
        elif isinstance(v, list):
            for x in v:
                collect(x)

    collect(head["args"])
    arrays = {}
    for i in sorted(metas):
        m = metas[i]
        dt = np.dtype(m["dtype"])
        count = int(np.prod(m["shape"], dtype=np.int64))
        arrays[i] = np.frombuffer(view[off:off + count * dt.itemsize], dt).reshape(m["shape"]).copy()
        off += count * dt.itemsize

    def dec(v):
        if isinstance(v, dict):
            return arrays[v["nd"]]
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    return head["op"], [dec(a) for a in head["args"]]


def send(sock: socket.socket, op: str, args=()) -> None:
    sock.sendall(encode(op, args))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ChannelClosed("the peer closed the control channel")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, max_frame: int = MAX_FRAME) -> tuple[str, list]:
    """The next frame's (op, args); raises :class:`ChannelClosed` at the end of the stream,
    ``socket.timeout`` when the socket's timeout passes first, ``ValueError`` for a frame over
    ``max_frame`` bytes (checked before anything is allocated for it)."""
    (n,) = _LEN.unpack(_read_exact(sock, 4))
    if n > max_frame:
        raise ValueError(f"control frame of {n} bytes exceeds {max_frame}")
    return decode(_read_exact(sock, n))
