"""The prefill side: the rooms smg's dual dispatch meets in, and the bootstrap service.

A *room* is keyed by ``(bootstrap_room, request_id)``: smg draws the room once and sends the
same request id on both legs. Either leg may arrive first. The decode's ``AwaitHandoff``
*registers* the room (it has reserved a slot and pages) and waits; the prefill's ``Generate``
waits (``wait_s``) for that registration before it computes anything — a prefill never runs
for a decode that has no room for the result — then runs the prompt with ``export=True``,
stages the arrays on the transfer endpoint and *publishes* the handoff, which answers
``AwaitHandoff``. ``Release`` (the decode pulled) or the staging deadline ends the room.

A room that ends in a failure before its decode came (the prefill refused the request, or
gave up waiting) leaves a *tombstone* for ``tombstone_s``: a decode that arrives later is
answered at once with that error instead of holding its slot and pages for its whole wait.
Staged handoffs hold memory outside the KV pools: each takes its bytes from the
``HandoffBudget`` before it is computed and gives them back when its room ends. Every
bootstrap call is authenticated with the cluster secret (``auth.py``).
"""
from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from concurrent import futures

import grpc

from . import bootstrap_pb2 as pb
from . import bootstrap_pb2_grpc as pb_grpc
from ...intmath import cdiv
from ..engine.cache.deal import cut_pieces, piece_devices, stage_pulls
from .auth import BootstrapAuth
from .budget import HandoffBudget, Share, nbytes_of
from .errors import HandoffError
from .layout import (destination_of, engine_devices, export_specs, incompatibility, piece_specs, prompt_crc32,
                     side_processes)

__all__ = ["HandoffError", "PrefillSide", "Rooms", "BootstrapServicer"]


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
    charged: Share = Share((0,))  # handoff memory this room holds, per process (given back when it ends;
    # Rooms sizes it to the side's processes)
    export_bytes: Share = Share((0,))  # of which the export, given back once it is cut into pieces


class Rooms:
    """Thread-safe table of open rooms and of tombstones (rooms that failed before their
    decode came), with the figures GetLoads reports."""

    def __init__(self, ttl_s: float, staged_s: float | None = None, budget: HandoffBudget | None = None,
                 tombstone_s: float | None = None):
        self.ttl_s = ttl_s  # a room nobody finishes is dropped after this long
        self.staged_s = staged_s if staged_s is not None else ttl_s  # ... and a staged one nobody released
        self.tombstone_s = tombstone_s if tombstone_s is not None else ttl_s  # a failure answers late decodes this long
        self.budget = budget if budget is not None else HandoffBudget(None)
        self._lock = threading.Lock()
        self._rooms: dict[tuple[int, str], Room] = {}
        self._tombstones: dict[tuple[int, str], tuple[float, HandoffError]] = {}  # key -> (until, error)
        self.handoffs = 0
        self.stage_s = 0.0  # prompt done -> staged, summed

    def get(self, key) -> Room:
        with self._lock:
            self._sweep()
            room = self._rooms.get(key)
            if room is None:
                room = self._rooms[key] = Room(key, charged=self._nothing())
            return room

    def tombstone(self, key) -> HandoffError | None:
        """The error a failed room left for a decode that comes late, or None."""
        with self._lock:
            self._sweep()
            t = self._tombstones.get(key)
            return t[1] if t is not None else None

    def end(self, key, err: HandoffError | None = None) -> None:
        """Drop the room (its handoff memory is given back); with ``err``, leave a tombstone."""
        with self._lock:
            self._drop(key)
            if err is not None:
                self._tombstones[key] = (time.monotonic() + self.tombstone_s, err)

    def charge(self, room: Room, nbytes: Share) -> bool:
        """Book ``nbytes`` (already taken from the budget) on ``room``; False (not booked) if the
        room has ended meanwhile: the caller gives them back."""
        with self._lock:
            if self._rooms.get(room.key) is not room or room.done.is_set():
                return False
            room.charged += nbytes
            return True

    def refund(self, room: Room, nbytes: Share) -> None:
        """Give back part of what ``room`` holds (e.g. the export, once cut into pieces)."""
        with self._lock:
            nbytes = nbytes.minimum(room.charged)
            room.charged -= nbytes
        self.budget.release(nbytes)

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

    def _drop(self, key) -> Room | None:
        room = self._rooms.pop(key, None)
        if room is not None and room.charged:
            self.budget.release(room.charged)
            room.charged = self._nothing()
        return room

    def _nothing(self) -> Share:
        return Share.of(0, self.budget.processes)

    def _sweep(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self._rooms.items() if now - r.created > self.ttl_s
                    or (r.staged_at is not None and now - r.staged_at > self.staged_s)]:
            room = self._drop(key)
            if not room.done.is_set():
                room.error = HandoffError("DEADLINE_EXCEEDED", f"room {key[0]} expired after {self.ttl_s:.0f} s")
                room.done.set()
        for key in [k for k, (until, _) in self._tombstones.items() if until < now]:
            del self._tombstones[key]


class BootstrapServicer(pb_grpc.BootstrapServicer):
    def __init__(self, rooms: Rooms, layout: "pb.CacheLayout", prefill_id: str, await_s: float,
                 auth: BootstrapAuth | None = None):
        self.rooms, self.layout, self.prefill_id, self.await_s = rooms, layout, prefill_id, await_s
        self.auth = auth if auth is not None else BootstrapAuth(None)

    def Register(self, request, context):
        self.auth.check("Register", request, context)
        why = incompatibility(self.layout, request.layout)
        return pb.RegisterResponse(prefill_id=self.prefill_id, layout=self.layout, compatible=why is None,
                                   reason=why or "")

    def AwaitHandoff(self, request, context):
        self.auth.check("AwaitHandoff", request, context)
        why = incompatibility(self.layout, request.layout)
        if why is not None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        key = (request.bootstrap_room, request.request_id)
        dead = self.rooms.tombstone(key)
        if dead is not None:  # the prefill failed this request before the decode came
            context.abort(_code(dead), f"the prefill refused or gave up on this request: {dead}")
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
            context.abort(_code(room.error), str(room.error))
        return room.handoff

    def Release(self, request, context):
        self.auth.check("Release", request, context)
        self.rooms.end((request.bootstrap_room, request.request_id))
        return pb.ReleaseResponse()


def _code(err) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, getattr(err, "code", ""), grpc.StatusCode.UNAVAILABLE)


class PrefillSide:
    """What a prefill-role server adds: the rooms, the bootstrap gRPC service on
    ``bootstrap_port`` (same host as the scheduler service, as smg derives it from the
    worker URL) and the transfer endpoint. ``secret``: the cluster secret every bootstrap
    call must prove (None: open, loopback only). ``handoff_bytes``: the bound on staged
    handoffs (``--pd-handoff-memory-gb``; None: unbounded)."""

    def __init__(self, engine, *, host: str, bootstrap_port: int, wait_s: float = 30.0, stage_s: float = 60.0,
                 secret: bytes | None = None, handoff_bytes: int | None = None, transfer_host: str | None = None):
        from .auth import check_bind
        from .layout import cache_layout
        from .transfer import TransferEndpoint

        check_bind(host, secret)
        self.engine = engine
        self.wait_s, self.stage_s = wait_s, stage_s
        self.devices = engine_devices(engine)
        self.num_heads, self.page_size = engine.model.config.kda_num_heads, engine.capacity_plan.page_size
        self.processes = side_processes(engine)
        self.budget = HandoffBudget(handoff_bytes, self.processes)  # per process of this side
        self.rooms = Rooms(ttl_s=wait_s + stage_s + 60.0, staged_s=stage_s, budget=self.budget)
        plane = engine.handoff_plane  # multi-host: each process's own endpoint (this is the leader's)
        self.transfer = plane.endpoint if plane is not None else TransferEndpoint(transfer_host or host)
        self.layout = cache_layout(engine)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="k3-bootstrap"),
                                  options=[("grpc.so_reuseport", 0)])
        self.servicer = BootstrapServicer(self.rooms, self.layout, f"prefill@{host}:{bootstrap_port}",
                                          await_s=wait_s + stage_s, auth=BootstrapAuth(secret))
        pb_grpc.add_BootstrapServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{bootstrap_port}")
        if not self.port:
            raise OSError(f"cannot bind the bootstrap port {host}:{bootstrap_port}")
        self.server.start()

    def reject(self, key, err: HandoffError) -> None:
        """This server refused or gave up on the request of ``key``: end its room with ``err``
        and leave a tombstone, so that its decode, waiting or still to come, gets ``err`` at once."""
        self.rooms.fail(key, err)
        self.rooms.end(key, err)

    def wait_for_decode(self, key, context) -> Room:
        """The room once its decode has registered; HandoffError if it does not within
        ``wait_s`` or the caller left."""
        room = self.rooms.get(key)
        deadline = time.monotonic() + self.wait_s
        while not room.registered.wait(0.1):
            if not context.is_active():
                err = HandoffError("CANCELLED", "the request was cancelled before its decode server arrived")
                self.rooms.end(key, HandoffError("ABORTED", "the prefill leg of this request was cancelled"))
                raise err
            if time.monotonic() > deadline:
                err = HandoffError("UNAVAILABLE", f"no decode server asked for bootstrap room {key[0]} within "
                                                  f"{self.wait_s:.0f} s")
                self.rooms.end(key, err)
                raise err
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

    def handoff_nbytes(self, n_prompt: int, dest) -> tuple[Share, Share]:
        """(bytes of the export, bytes of the pieces cut from it and staged, once per pull) of an
        ``n_prompt``-token handoff, per process of this side. On a multi-host prefill the export
        is whole on every device, and each process stages the pieces of its own devices."""
        export = nbytes_of(export_specs(self.engine, n_prompt))
        specs = piece_specs(self.engine, n_prompt, dest)
        plane = self.engine.handoff_plane
        if plane is None:
            return Share.of(export), Share.of(sum(nbytes_of([sp]) * dest.num_pulls(i) for i, sp in enumerate(specs)))
        ex, pc = [0] * self.processes, [0] * self.processes
        for d in self.devices:
            ex[d.process_index] += export
        for i, d in enumerate(piece_devices(dest, plane.stage_devices())):
            pc[d.process_index] += nbytes_of([specs[i]]) * dest.num_pulls(i)
        return Share(ex), Share(pc)

    def reserve_memory(self, room: Room, ids, context) -> None:
        """Take the handoff's memory (export + pieces) from the budget before anything is
        computed, waiting up to ``wait_s`` for it; the room holds it until it ends."""
        export, pieces = self.handoff_nbytes(len(ids), room.dest)
        try:
            self.budget.acquire(export + pieces, deadline=time.monotonic() + self.wait_s,
                                alive=lambda: context.is_active() and not room.done.is_set(),
                                what=f"the handoff of bootstrap room {room.key[0]}")
        except HandoffError as e:
            self.rooms.fail(room.key, e)
            raise
        if not self.rooms.charge(room, export + pieces):
            self.budget.release(export + pieces)
            raise room.error or HandoffError("ABORTED", f"bootstrap room {room.key[0]} ended")
        room.export_bytes = export

    def publish(self, room: Room, out, finished_at: float) -> None:
        """Stage the final output's handoff and answer the decode's AwaitHandoff."""
        if room.decode_left or room.done.is_set():  # nobody waits for it: drop it
            self.rooms.end(room.key)
            if out.handoff.key is not None:
                self.engine.handoff_plane.drop(out.handoff.key)
            return
        h = out.handoff
        plane = self.engine.handoff_plane
        uuid = secrets.randbits(63)
        specs = piece_specs(self.engine, h.prompt_len, room.dest)
        nbytes = nbytes_of(specs)
        addresses = []
        if plane is not None:  # multi-host: every process stages the pieces of its own devices
            addresses = plane.stage(h.key, room.dest, uuid, self.stage_s)
        else:
            pieces = cut_pieces(h.arrays, room.dest, self.devices)
            if room.dest.pulls:  # a multi-host decode: each piece once per process that pulls it
                stage_pulls(self.transfer, dict(enumerate(pieces)), room.dest, uuid, self.stage_s)
                addresses = [self.transfer.address] * len(pieces)
            else:
                self.transfer.stage(uuid, pieces, self.stage_s)
        h.arrays = ()  # the export is cut: only the pieces stay
        self.rooms.refund(room, room.export_bytes)
        msg = pb.Handoff(bootstrap_room=room.key[0], request_id=room.key[1], prompt_crc32=room.request.prompt_crc32,
                         prompt_len=h.prompt_len, first_token=h.first_token, cached_tokens=h.cached_tokens,
                         transfer_address=self.transfer.address, transfer_uuid=uuid, nbytes=nbytes,
                         arrays=[pb.TensorSpec(shape=s, dtype=d) for s, d in specs], piece_addresses=addresses)
        if h.logprob is not None:
            lp, top = h.logprob
            msg.first_logprob.CopyFrom(pb.TokenLogprob(logprob=lp, top_ids=[int(a) for a, _ in top],
                                                       top_logprobs=[float(b) for _, b in top]))
        if h.id_logprobs is not None:
            msg.first_id_logprobs.CopyFrom(pb.TopLogprobs(ids=[int(a) for a, _ in h.id_logprobs],
                                                          logprobs=[float(b) for _, b in h.id_logprobs]))
        room.handoff = msg
        room.staged_at = time.monotonic()
        self.rooms.handoffs += 1
        self.rooms.stage_s += room.staged_at - finished_at
        room.done.set()

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)
