"""The prefill side: the rooms smg's dual dispatch meets in, and the bootstrap service.

A *room* is keyed by ``(bootstrap_room, request_id)``: smg draws the room once and sends the
same request id on both legs. Either leg may arrive first. The decode's ``AwaitHandoff``
*registers* the room (it has reserved a slot and pages) and waits; the prefill's ``Generate``
waits (``wait_s``) for that registration before it computes anything — a prefill never runs
for a decode that has no room for the result — then runs the prompt with ``export=True``,
stages the arrays on the transfer endpoint and *publishes* the handoff, which answers
``AwaitHandoff``. ``Release`` (the decode pulled) or the staging deadline ends the room.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from concurrent import futures

import grpc

from ..engine.request import RequestError
from . import bootstrap_pb2 as pb
from . import bootstrap_pb2_grpc as pb_grpc
from ...intmath import cdiv
from ..engine.cache.deal import cut_pieces
from .layout import destination_of, engine_devices, incompatibility, prompt_crc32


class HandoffError(RequestError):
    """A P/D handoff failed: ``code`` is the gRPC status the caller gets."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass
class Room:
    key: tuple[int, str]
    created: float = dataclasses.field(default_factory=time.monotonic)
    registered: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    request: "pb.AwaitHandoffRequest | None" = None  # the decode's registration
    dest: object = None  # its deal.Destination, checked
    handoff: "pb.Handoff | None" = None
    error: HandoffError | None = None
    staged_at: float | None = None
    decode_left: bool = False  # the decode's AwaitHandoff ended (cancelled): nothing to stage for


class Rooms:
    """Thread-safe table of open rooms, with the figures GetLoads reports."""

    def __init__(self, ttl_s: float, staged_s: float | None = None):
        self.ttl_s = ttl_s  # a room nobody finishes is dropped after this long
        self.staged_s = staged_s if staged_s is not None else ttl_s  # ... and a staged one nobody released
        self._lock = threading.Lock()
        self._rooms: dict[tuple[int, str], Room] = {}
        self.handoffs = 0
        self.stage_s = 0.0  # prompt done -> staged, summed

    def get(self, key) -> Room:
        with self._lock:
            self._sweep()
            room = self._rooms.get(key)
            if room is None:
                room = self._rooms[key] = Room(key)
            return room

    def end(self, key) -> None:
        with self._lock:
            self._rooms.pop(key, None)

    def fail(self, key, err: HandoffError) -> None:
        """End the room's wait with ``err`` (a room already gone stays gone)."""
        with self._lock:
            room = self._rooms.get(key)
        if room is not None and not room.done.is_set():
            room.error = err
            room.done.set()

    def counts(self) -> tuple[int, int]:
        """(rooms waiting for their decode, rooms computing or staged)."""
        with self._lock:
            self._sweep()
            waiting = sum(1 for r in self._rooms.values() if not r.registered.is_set())
            return waiting, len(self._rooms) - waiting

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._rooms)

    def _sweep(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self._rooms.items() if now - r.created > self.ttl_s
                    or (r.staged_at is not None and now - r.staged_at > self.staged_s)]:
            room = self._rooms.pop(key)
            if not room.done.is_set():
                room.error = HandoffError("DEADLINE_EXCEEDED", f"room {key[0]} expired after {self.ttl_s:.0f} s")
                room.done.set()


class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, rooms: Rooms, layout: "pb.CacheLayout", prefill_id: str, await_s: float):
        self.rooms, self.layout, self.prefill_id, self.await_s = rooms, layout, prefill_id, await_s

    def Register(self, request, context):
        why = incompatibility(self.layout, request.layout)
        return pb.RegisterResponse(prefill_id=self.prefill_id, layout=self.layout, compatible=why is None,
                                   reason=why or "")

    def AwaitHandoff(self, request, context):
        why = incompatibility(self.layout, request.layout)
        if why is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        key = (request.bootstrap_room, request.request_id)
        room = self.rooms.get(key)
        room.request = request
        room.registered.set()
        deadline = time.monotonic() + self.await_s
        while not room.done.wait(0.1):
            if not context.is_active():  # the decode gave up (abort, deadline, death)
                room.decode_left = True
                self.rooms.fail(key, HandoffError("CANCELLED", "the decode server left the room"))
                self.rooms.end(key)
                return pb.Handoff()
            if time.monotonic() > deadline:
                self.rooms.fail(key, HandoffError("DEADLINE_EXCEEDED", "the prefill did not finish in time"))
        if room.error is not None:
            self.rooms.end(key)
            context.abort(getattr(grpc.StatusCode, room.error.code, grpc.StatusCode.UNAVAILABLE), str(room.error))
        return room.handoff

    def Release(self, request, context):
        self.rooms.end((request.bootstrap_room, request.request_id))
        return pb.ReleaseResponse()


class PrefillSide:
    """What a prefill-role server adds: the rooms, the bootstrap gRPC service on
    ``bootstrap_port`` (same host as the scheduler service, as smg derives it from the
    worker URL) and the transfer endpoint."""

    def __init__(self, engine, *, host: str, bootstrap_port: int, wait_s: float = 30.0, stage_s: float = 60.0):
        from .layout import cache_layout
        from .transfer import TransferEndpoint

        self.wait_s, self.stage_s = wait_s, stage_s
        self.devices = engine_devices(engine)
        self.num_heads, self.page_size = engine.model.config.kda_num_heads, engine.capacity_plan.page_size
        self.rooms = Rooms(ttl_s=wait_s + stage_s + 60.0, staged_s=stage_s)
        self.transfer = TransferEndpoint(host)
        self.layout = cache_layout(engine)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="k3-bootstrap"),
                                  options=[("grpc.so_reuseport", 0)])
        self.servicer = BootstrapServicer(self.rooms, self.layout, f"prefill@{host}:{bootstrap_port}",
                                          await_s=wait_s + stage_s)
        pb_grpc.add_BootstrapServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{bootstrap_port}")
        if not self.port:
            raise OSError(f"cannot bind the bootstrap port {host}:{bootstrap_port}")
        self.server.start()

    def wait_for_decode(self, key, context) -> Room:
        """The room once its decode has registered; HandoffError if it does not within
        ``wait_s`` or the caller left."""
        room = self.rooms.get(key)
        deadline = time.monotonic() + self.wait_s
        while not room.registered.wait(0.1):
            if not context.is_active():
                self.rooms.end(key)
                raise HandoffError("CANCELLED", "the request was cancelled before its decode server arrived")
            if time.monotonic() > deadline:
                self.rooms.end(key)
                raise HandoffError("UNAVAILABLE", f"no decode server asked for bootstrap room {key[0]} within "
                                                  f"{self.wait_s:.0f} s")
        if room.error is not None:  # the decode came and left already
            self.rooms.end(key)
            raise room.error
        return room

    def check_registration(self, room: Room, ids) -> None:
        req = room.request
        if req.prompt_len != len(ids) or req.prompt_crc32 != prompt_crc32(ids):
            err = HandoffError("FAILED_PRECONDITION", f"bootstrap room {room.key[0]}: the decode's prompt differs "
                                                      "from this request's")
            self.rooms.fail(room.key, err)
            raise err
        try:
            room.dest = destination_of(req.destination)
            room.dest.check(self.num_heads, cdiv(len(ids), self.page_size))
        except ValueError as e:
            err = HandoffError("FAILED_PRECONDITION", f"bootstrap room {room.key[0]}: bad destination: {e}")
            self.rooms.fail(room.key, err)
            raise err from None

    def publish(self, room: Room, out, finished_at: float) -> None:
        """Stage the final output's handoff and answer the decode's AwaitHandoff."""
        if room.decode_left or room.done.is_set():  # nobody waits for it: drop it
            self.rooms.end(room.key)
            return
        h = out.handoff
        pieces = cut_pieces(h.arrays, room.dest, self.devices)
        uuid = random.getrandbits(63)
        self.transfer.stage(uuid, pieces, self.stage_s)
        msg = pb.Handoff(bootstrap_room=room.key[0], request_id=room.key[1], prompt_crc32=room.request.prompt_crc32,
                         prompt_len=h.prompt_len, first_token=h.first_token, cached_tokens=h.cached_tokens,
                         transfer_address=self.transfer.address, transfer_uuid=uuid,
                         nbytes=sum(int(a.nbytes) for a in pieces),
                         arrays=[pb.TensorSpec(shape=a.shape, dtype=str(a.dtype)) for a in pieces])
        if h.logprob is not None:
            lp, top = h.logprob
            msg.first_logprob.CopyFrom(pb.TokenLogprob(logprob=lp, top_ids=[int(a) for a, _ in top],
                                                       top_logprobs=[float(b) for _, b in top]))
        room.handoff = msg
        room.staged_at = time.monotonic()
        self.rooms.handoffs += 1
        self.rooms.stage_s += room.staged_at - finished_at
        room.done.set()

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)
