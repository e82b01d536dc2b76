"""P/D handoffs of an engine whose cache spans processes (multi-host; issue #36).

No process holds a whole handoff: each holds its devices' shards. So every step of a handoff
that touches device arrays is an operation every process runs on its own part (dispatched by
the leader, ``engine/dispatch.py``), and the bytes move between the processes' own JAX transfer
servers — never through the leader:

prefill
  ``pd_export``  every process reads the request's slot and pages out, whole on each of its
                 devices (the read program's output is replicated: one all-gather inside the
                 prefill), and keeps it under a key;
  ``pd_stage``   every process cuts the pieces staged from its own devices
                 (``deal.cut_local_pieces``) and stages each once per decode process that
                 pulls it (``Destination.pulls``, ids ``deal.pull_uuid``); the leader answers
                 the decode with each piece's transfer address;
  ``pd_drop``    the export of a handoff nobody will take is forgotten everywhere.

decode
  ``pd_pull``    every process starts pulling the pieces its devices need, from the process
                 that staged each (``HandoffTarget.local_pull_devices``);
  ``pd_load``    in the engine's program order: every process waits for its pieces (up to the
                 transfer deadline), then all of them agree — one tiny collective, the minimum
                 of every device's "arrived" flag — and either all write the handoff into the
                 reservation or all drop it, and the leader fails that request alone. A lost
                 prefill process can never leave one decode process loading while another
                 waits.

Each process's transfer server address is published in the distributed runtime's key-value
store at construction; the leader reads them when it first stages.
"""
from __future__ import annotations

import threading
import time

import jax
import numpy as np

from .deal import Destination, HandoffTarget, cut_local_pieces, piece_devices, pull_uuid, stage_pulls

_ADDRESS_KEY = "k3serve/pd/transfer/{}"


def dest_to_wire(dest: Destination) -> list:
    """``dest`` as the control channel carries it (lists and ints, ``cluster/wire.py``)."""
    return [dest.head_count, list(dest.head_starts), [list(p) for p in dest.page_lists], dest.first_page,
            list(dest.pulls)]


def dest_from_wire(d: list) -> Destination:
    head_count, head_starts, page_lists, first_page, pulls = d
    return Destination(head_count=int(head_count), head_starts=tuple(int(h) for h in head_starts),
                       page_lists=tuple(tuple(int(k) for k in p) for p in page_lists), first_page=int(first_page),
                       pulls=tuple(int(n) for n in pulls))


class HandoffPlane:
    """This process's part of every P/D handoff of a multi-host engine."""

    def __init__(self, cache_mgr, dispatch, endpoint):
        """``endpoint``: this process's ``pd.transfer.TransferEndpoint`` (made by the caller: the
        engine's floor does not know the transfer library's wrapper)."""
        from ..process_barrier import distributed_store

        self.mgr, self.dispatch = cache_mgr, dispatch
        self.endpoint = endpoint
        self._exports: dict[int, tuple] = {}
        self._imports: dict[int, tuple] = {}  # key -> (target, {piece: array}, deadline)
        self._lock = threading.Lock()
        self._next = 0
        self._addresses: list[str] | None = None
        self._agree_fn = None
        distributed_store().key_value_set(_ADDRESS_KEY.format(jax.process_index()), self.endpoint.address)
        for name, fn in (("pd_export", self._run_export), ("pd_stage", self._run_stage), ("pd_drop", self._run_drop),
                         ("pd_pull", self._run_pull), ("pd_load", self._run_load)):
            dispatch.register(name, fn)
        self._warm_agree()

    # ------------------------------------------------------------------ shared
    @property
    def mesh(self):
        return self.mgr.device_cache.mla_kv.sharding.mesh

    def addresses(self) -> list[str]:
        """Every process's transfer server address, by process index."""
        if self._addresses is None:
            from ..process_barrier import distributed_store

            store = distributed_store()
            self._addresses = [store.blocking_key_value_get(_ADDRESS_KEY.format(p), 60_000)
                               for p in range(jax.process_count())]
        return self._addresses

    def new_key(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _warm_agree(self) -> None:
        """Compile the agreement program now (construction runs in every process alike): a
        minimum over one flag per device, the result on every device."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = self.mesh
        flags = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        fn = jax.jit(lambda f: f.min(), out_shardings=NamedSharding(mesh, P()))
        self._flags_sharding = flags
        self._agree_fn = fn.lower(jax.ShapeDtypeStruct((mesh.devices.size,), np.int32, sharding=flags)).compile()

    def _agree(self, ok: bool) -> bool:
        """True when every process of the engine says ``ok`` (a collective: all must call it)."""
        mesh = self.mesh
        shape = (mesh.devices.size,)
        bufs = [jax.device_put(np.full((1,), int(ok), np.int32), d)
                for d in self._flags_sharding.addressable_devices_indices_map(shape)]
        flags = jax.make_array_from_single_device_arrays(shape, self._flags_sharding, bufs)
        return bool(int(np.asarray(self._agree_fn(flags).addressable_shards[0].data)))

    # ------------------------------------------------------------------ prefill
    def export(self, rid, tokens: int) -> int:
        """Read ``rid``'s handoff out on every process (dispatched after every step launched so
        far); its key."""
        req = self.mgr._req(rid)
        self.mgr.flush_copies()
        idx, _ = self.mgr._prefix_index(req, tokens)
        key = self.new_key()
        self.dispatch("pd_export", key, req.slot, idx)
        return key

    def _run_export(self, key: int, slot: int, idx: np.ndarray) -> None:
        import jax.numpy as jnp

        self._exports[key] = self.mgr._program("read_replicated")(self.mgr.device_cache, jnp.int32(slot),
                                                                  jnp.asarray(idx))

    def stage(self, key: int, dest: Destination, uuid: int, timeout_s: float) -> list[str]:
        """Stage export ``key`` for ``dest`` on every process; each piece's transfer address."""
        self.dispatch("pd_stage", key, dest_to_wire(dest), uuid, float(timeout_s))
        addrs = self.addresses()
        return [addrs[d.process_index] for d in piece_devices(dest, self.stage_devices())]

    def stage_devices(self) -> list:
        return list(self.mesh.devices.flat)

    def _run_stage(self, key: int, dest: dict, uuid: int, timeout_s: float) -> None:
        arrays = self._exports.pop(key, None)
        if arrays is None:
            return
        dest = dest_from_wire(dest)
        stage_pulls(self.endpoint, cut_local_pieces(arrays, dest, self.stage_devices()), dest, uuid, timeout_s)

    def drop(self, key: int) -> None:
        self.dispatch("pd_drop", key)

    def _run_drop(self, key: int) -> None:
        self._exports.pop(key, None)
        self._imports.pop(key, None)

    # ------------------------------------------------------------------ decode
    def pull(self, target: HandoffTarget, addresses: list[str], uuid: int, specs, timeout_s: float) -> int:
        """Start every process's pulls of one handoff (each piece from ``addresses[i]``);
        its key. The leader's own pieces: :meth:`local_pieces`."""
        key = self.new_key()
        self.dispatch("pd_pull", key, dest_to_wire(target.dest), np.asarray(target.group_blocks, np.int32),
                      target.load_index, target.load_pos0, list(addresses), uuid,
                      [[list(s), str(d)] for s, d in specs], float(timeout_s))
        return key

    def _run_pull(self, key: int, dest: dict, group_blocks, index, pos0, addresses, uuid: int, specs,
                  timeout_s: float) -> None:
        dest = dest_from_wire(dest)
        target = self.mgr.target_for(dest, tuple(int(b) for b in group_blocks), np.asarray(index, np.int32),
                                     np.asarray(pos0, np.int32))
        readers = target.readers()
        me = jax.process_index()
        pieces = {}
        for i, dev in enumerate(target.local_pull_devices()):
            if dev is None:
                continue
            s, d = specs[i]
            pieces[i] = self.endpoint.pull(addresses[i], pull_uuid(uuid, i, readers[i].index(me)), [(tuple(s), d)],
                                           devices=[dev])[0]
        self._imports[key] = (target, pieces, time.monotonic() + timeout_s)

    def local_pieces(self, key: int) -> list:
        entry = self._imports.get(key)
        return [] if entry is None else list(entry[1].values())

    def load(self, rid, key: int, tokens: int) -> bool:
        """Write handoff ``key`` into ``rid``'s reservation on every process; False (nothing
        written anywhere) when some process's pieces did not arrive in time."""
        req = self.mgr._req(rid)
        self.mgr.flush_copies()
        return bool(self.dispatch("pd_load", key, req.slot, tokens))

    def _run_load(self, key: int, slot: int, tokens: int) -> bool:
        target, pieces, deadline = self._imports.pop(key, (None, {}, 0.0))
        ok = target is not None and all_ready(list(pieces.values()), deadline)
        if not self._agree(ok):
            return False
        self.mgr._load(target.assemble(pieces), target.load_index, target.load_pos0, slot, tokens, "the handoff")
        return True



def all_ready(arrays, deadline: float) -> bool:
    """True once every array is ready and holds its bytes; False if the monotonic
    ``deadline`` passed first, or a pull failed. A pull from a peer that died is *ready* at
    once, holding an error: handed on, it fails the program it feeds on that device alone,
    and the program's collectives then wait forever on the other devices (XLA:CPU aborts the
    process after 40 s), so it must be caught here."""
    poll = 0.002
    pending = list(arrays)
    while pending:
        waiting = []
        for a in pending:
            if not a.is_ready():
                waiting.append(a)
                continue
            try:
                a.block_until_ready()  # ready: returns at once, or raises the pull's error
            except Exception:  # noqa: BLE001 - any error means the bytes are not here
                return False
        pending = waiting
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
        poll = min(poll * 2, 0.05)
    return True
