"""The decode side: reserve, await the prefill's handoff, pull it, deliver it to the engine.

A request with ``disaggregated_params`` is submitted to the engine as a P/D decode
(``EngineThread.submit(on_reserved=...)``): it queues like any request until a slot and pages
for ``prompt + 1`` tokens are free. On reservation a worker thread (never the engine thread)
registers with the prefill's bootstrap service (once per prefill), calls ``AwaitHandoff`` (the
prefill starts computing only then) with what its devices need of the cache
(``CacheManager.handoff_target``: the prefill cuts one piece per need), checks the announced
room, prompt and piece shapes against its own, pulls each piece onto a device that needs it
through the transfer endpoint with a deadline, puts the load's inputs together, releases
the room and hands the arrays to the engine (``EngineThread.deliver``). Any failure ends that
request alone with a gRPC status (UNAVAILABLE when the prefill is unreachable or died,
DEADLINE_EXCEEDED, FAILED_PRECONDITION for incompatible servers or a prefill that refuses
this server's cluster secret, the prefill's own status when it refused the request) and
frees its reservation.

Every bootstrap call carries a proof of the cluster secret (``auth.py``). Before it asks for
a handoff, the worker takes the bytes of the pulled pieces and of the load's inputs put
together from them from the ``HandoffBudget`` (``--pd-handoff-memory-gb``), waiting while
the reservation is held; they are given back once the engine has the arrays.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

import numpy as np

from ..engine.cache.deal import pull_uuid
from ..engine.handoff import Handoff
from . import bootstrap_pb2 as pb
from . import bootstrap_pb2_grpc as pb_grpc
from .auth import BootstrapAuth
from .budget import HandoffBudget, Share
from .errors import HandoffError
from .layout import cache_layout, destination_pb, incompatibility, piece_specs, prompt_crc32, side_processes
from .transfer import TransferEndpoint, wait_ready

# the prefill's status reaches the decode's client as it is; anything else is UNAVAILABLE
_KEPT = {"FAILED_PRECONDITION", "DEADLINE_EXCEEDED", "ABORTED", "INVALID_ARGUMENT", "OUT_OF_RANGE",
         "RESOURCE_EXHAUSTED"}


def pull_nbytes(target, piece_specs_, processes: int = 1) -> Share:
    """Device bytes of one handoff on the decode, per process of the side: the pieces pulled
    and the load's inputs put together from them (every device's shard of each, replicas
    included). On a multi-host decode each process pulls the pieces its devices need
    (``HandoffTarget.readers``) and holds its devices' shards."""
    sizes = [int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in piece_specs_]
    out = [0] * processes
    if processes == 1:
        out[0] = sum(sizes)
    else:
        for i, procs in enumerate(target.readers()):
            for p in procs:
                out[p] += sizes[i]
    for shape, dtype, sharding in zip(target.shapes, target.dtypes, target.shardings):
        shard = int(np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64)) * np.dtype(dtype).itemsize
        for dev in sharding.device_set:
            out[dev.process_index if processes > 1 else 0] += shard
    return Share(out)


class DecodeSide:
    def __init__(self, engine, *, host: str = "127.0.0.1", await_s: float = 120.0, transfer_s: float = 60.0,
                 secret: bytes | None = None, handoff_bytes: int | None = None, transfer_host: str | None = None):
        self.engine = engine
        self.await_s, self.transfer_s = await_s, transfer_s
        self.auth = BootstrapAuth(secret)
        self.processes = side_processes(engine)
        self.budget = HandoffBudget(handoff_bytes, self.processes)  # per process of this side
        plane = engine.handoff_plane  # multi-host: each process's own endpoint (this is the leader's)
        self.transfer = plane.endpoint if plane is not None else TransferEndpoint(transfer_host or host)
        self.layout = cache_layout(engine)
        self.decode_id = f"decode@{self.transfer.address}"
        self.pool = futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="k3-pd-pull")
        self._lock = threading.Lock()
        self._stubs: dict[str, pb_grpc.BootstrapStub] = {}
        self._registered: dict[str, str | None] = {}  # bootstrap address -> None (ok) or why not
        # (requests waiting for a reservation: the engine's stats, "waiting_prefilled")
        self.transferring = 0  # reserved, handoff not delivered yet
        self.bytes_received = 0
        self.handoffs = 0
        self.transfer_time_s = 0.0  # pull start -> arrays ready, summed
        self.last_latency_s = 0.0

    # ------------------------------------------------------------------ per request
    def submit(self, loop, ids, params, *, rid: str, dparams, **kw):
        """Submit a P/D decode request; its handoff is fetched once it has a reservation."""
        addr = f"{dparams.bootstrap_host or '127.0.0.1'}:{dparams.bootstrap_port or 8998}"
        room = int(dparams.bootstrap_room)

        def on_reserved(r: str) -> None:  # engine thread (after the step): hand over to a worker, never block
            try:  # what this reservation needs, read while the engine thread owns the cache
                target = self.engine.cache_mgr.handoff_target(r, len(ids))
            except Exception as e:
                target = e
            with self._lock:
                self.transferring += 1
            try:
                self.pool.submit(self._fetch, loop, r, addr, room, list(ids), target)
            except RuntimeError:  # the pool is shut down: the engine aborts this request alone
                with self._lock:
                    self.transferring -= 1
                raise HandoffError("UNAVAILABLE", "the decode server is stopping") from None

        return loop.submit(ids, params, rid=rid, on_reserved=on_reserved, **kw)

    def _fetch(self, loop, rid: str, addr: str, room: int, ids: list[int], target) -> None:
        held = 0  # handoff memory taken: given back once the engine thread has the arrays (or they are dropped)
        try:
            if isinstance(target, Exception):
                raise target
            alive = lambda: loop.in_flight(rid)  # noqa: E731
            deadline = time.monotonic() + self.await_s
            nbytes = pull_nbytes(target, piece_specs(self.engine, len(ids), target.dest), self.processes)
            self.budget.acquire(nbytes, deadline=deadline, alive=alive, what=f"the handoff of request {rid!r}")
            held = nbytes
            handoff = self._handoff(rid, addr, room, ids, target, alive=alive, deadline=deadline)
        except HandoffError as e:
            loop.fail_request(rid, e)
        except grpc.RpcError as e:
            code = e.code().name if e.code() is not None else "UNAVAILABLE"
            if code == "CANCELLED":  # the prefill leg was cancelled or aborted: not this client's doing
                code = "ABORTED"
            if code == "UNAUTHENTICATED":  # a deployment error between the two servers, not the client's
                code = "FAILED_PRECONDITION"
            if code not in _KEPT:
                code = "UNAVAILABLE"
            loop.fail_request(rid, HandoffError(code, f"P/D handoff from the prefill at {addr} failed: "
                                                      f"{e.details() or e.code()}"))
        except Exception as e:  # a bug here must fail the request, not leave it reserved forever
            loop.fail_request(rid, HandoffError("INTERNAL", f"P/D handoff failed: {e!r}"))
        else:
            loop.deliver(rid, handoff)  # the engine thread writes it into the reservation at its next turn
        finally:
            if held:
                self.budget.release(held)
            with self._lock:
                self.transferring -= 1

    def _stub(self, addr: str) -> pb_grpc.BootstrapStub:
        with self._lock:
            stub = self._stubs.get(addr)
            if stub is None:
                stub = self._stubs[addr] = pb_grpc.BootstrapStub(grpc.insecure_channel(addr))
            known = addr in self._registered
        if not known:
            req = pb.RegisterRequest(decode_id=self.decode_id, layout=self.layout)
            r = stub.Register(req, timeout=10, metadata=self.auth.metadata("Register", req))
            why = None if r.compatible else r.reason
            why = why or incompatibility(self.layout, r.layout)
            with self._lock:
                self._registered[addr] = why
        why = self._registered[addr]
        if why is not None:
            raise HandoffError("FAILED_PRECONDITION", f"the prefill at {addr} cannot hand over to this server: {why}")
        return stub

    def _handoff(self, rid: str, addr: str, room: int, ids: list[int], target, alive=lambda: True,
                 deadline: float | None = None) -> Handoff:
        stub = self._stub(addr)
        crc = prompt_crc32(ids)
        specs = piece_specs(self.engine, len(ids), target.dest)
        deadline = deadline if deadline is not None else time.monotonic() + self.await_s
        req = pb.AwaitHandoffRequest(
            decode_id=self.decode_id, bootstrap_room=room, request_id=rid, prompt_len=len(ids), prompt_crc32=crc,
            layout=self.layout, destination=destination_pb(target.dest))
        call = stub.AwaitHandoff.future(req, timeout=max(1.0, deadline - time.monotonic()),
                                        metadata=self.auth.metadata("AwaitHandoff", req))
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        while not done.wait(0.05):
            if not alive():  # aborted here: leaving the call tells the prefill to drop the room
                call.cancel()
                raise HandoffError("CANCELLED", f"request {rid!r} was aborted while its prefill ran")
        msg = call.result()
        if (msg.bootstrap_room, msg.request_id, msg.prompt_crc32, msg.prompt_len) != (room, rid, crc, len(ids)):
            raise HandoffError("INTERNAL", f"bootstrap room {room}: the prefill answered for another request "
                                           f"(room {msg.bootstrap_room}, id {msg.request_id!r})")
        got = [(tuple(a.shape), a.dtype) for a in msg.arrays]
        if got != specs:
            raise HandoffError("FAILED_PRECONDITION", f"the prefill announced arrays {got}, this server expects {specs}")
        t = time.monotonic()
        plane, key = self.engine.handoff_plane, None
        addresses = list(msg.piece_addresses)
        if plane is None and addresses and len(addresses) != len(specs):
            raise HandoffError("FAILED_PRECONDITION", f"the prefill named {len(addresses)} piece addresses for "
                                                      f"{len(specs)} pieces")
        if plane is not None:  # multi-host: every process pulls what its own devices need
            if len(addresses) != len(specs):  # a one-process prefill stages the pieces per pull, too
                addresses = [msg.transfer_address] * len(specs)
            key = plane.pull(target, addresses, msg.transfer_uuid, specs, self.transfer_s)
            pieces = plane.local_pieces(key)
        elif addresses:  # a multi-host prefill: each piece from the process that staged it
            pieces = [self.transfer.pull(a, pull_uuid(msg.transfer_uuid, i, 0), [spec], devices=[dev])[0]
                      for i, (a, spec, dev) in enumerate(zip(addresses, specs, target.pull_devices()))]
        else:
            pieces = self.transfer.pull(msg.transfer_address, msg.transfer_uuid, specs, devices=target.pull_devices())
        ok = wait_ready(pieces, self.transfer_s)
        dt = time.monotonic() - t
        if not ok and key is not None:
            plane.drop(key)
        try:
            rel = pb.ReleaseRequest(bootstrap_room=room, request_id=rid, pulled=ok)
            stub.Release(rel, timeout=5, metadata=self.auth.metadata("Release", rel))
        except grpc.RpcError:
            pass  # the room expires on its own; the arrays are here (or will never be)
        if not ok:
            raise HandoffError("UNAVAILABLE", f"the KV transfer from {msg.transfer_address} failed or did not "
                                              f"complete within {self.transfer_s:.0f} s (the prefill server may have "
                                              "died)")
        moved = sum(int(np.prod(sh, dtype=np.int64)) * np.dtype(d).itemsize * target.dest.num_pulls(i)
                    for i, (sh, d) in enumerate(specs))  # a multi-host decode pulls some pieces more than once
        with self._lock:
            self.bytes_received += moved
            self.handoffs += 1
            self.transfer_time_s += dt
            self.last_latency_s = dt
        lp = None
        if msg.HasField("first_logprob"):
            f = msg.first_logprob
            lp = (f.logprob, list(zip(f.top_ids, f.top_logprobs)))
        ids_lp = None
        if msg.HasField("first_id_logprobs"):
            ids_lp = list(zip(msg.first_id_logprobs.ids, msg.first_id_logprobs.logprobs))
        arrays = target.assemble(pieces) if key is None else ()
        return Handoff(len(ids), int(msg.first_token), lp, int(msg.cached_tokens), arrays, target.dest,
                       id_logprobs=ids_lp, key=key)

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
