"""How a P/D handoff's arrays reach the decode's devices, whatever the two layouts (issue #16).

The prefill exports a request's cache in one layout-free form (``CacheManager.export_request``):
KDA state ``[nK, H, dk, dv]``, conv windows ``[nK, W-1, C]`` and the MLA rows of its prompt's
pages in page order ``[nM, P', ps, W]``. The decode's cache may be laid out otherwise: KDA heads
split over mesh axes, a sequence's page k on DCP rank ``(k + rank0) mod dcp`` of its DP group,
several DP groups. JAX's transfer server copies raw buffers and never reshards, so:

1. the decode describes what its devices need (a :class:`Destination`, computed from its
   reservation by ``CacheManager.handoff_target``);
2. the prefill cuts one *piece* per distinct need out of its export (:func:`cut_pieces`):
   the conv windows (every device needs all of them), one KDA-state piece per distinct head
   range, and one rows piece per DCP rank of the request's group that holds a prompt page —
   its pages in sequence order, padded with page ``-1`` (zeros, never written) to a common
   power of two; piece r of each kind is staged on the prefill's device r, so between two equal
   layouts rank r sends to rank r;
3. the decode pulls each piece onto one device that needs it and builds its load's inputs
   (:func:`assemble`), copying a piece locally to the other devices that hold the same bytes
   (replicas over tensor-parallel ranks, the state over DP groups) and filling the page blocks
   of other groups and of empty ranks with zeros that the load drops.

Pages the decode already holds from its own prefix cache (``Destination.first_page``: it
maps the longest cached prefix's whole pages when it reserves) are not asked for: the
prefill still sends the whole KDA state, which is the state after the prompt.

The load writes the rows in *block order* ``[nM, blocks * Pb, ps, W]``, sharded over pages like
the pool, so each device's part is exactly its own block's pages (``HandoffTarget.load_index``).
One device and no recipe is the case of one block and one head range.

The two cut programs (``_heads``, ``_pages``) are module functions, so their compiled forms
are shared by every engine of the process: they count in :data:`PROGRAMS`, which an engine
with a P/D role adds to its ``num_compiles``, and a prefill engine compiles them at warm-up
(:func:`warm_cuts`) for every shape a decode can ask.
"""
from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..programs import Programs


@dataclasses.dataclass(frozen=True)
class Destination:
    """What the decode's devices need of one request's handoff (sent to the prefill)."""
    head_count: int  # KDA heads per state piece
    head_starts: tuple[int, ...]  # one state piece per entry: heads [start, start + head_count)
    page_lists: tuple[tuple[int, ...], ...]  # one rows piece per DCP rank: prompt page numbers, -1 = padding
    first_page: int = 0  # the decode holds the prompt's pages before this one already (its prefix cache)
    # a multi-process decode: per piece, how many of its processes pull it (each its own copy,
    # staged once per pull: a staged array is pulled once); empty: one pull of each
    pulls: tuple[int, ...] = ()

    def num_pulls(self, i: int) -> int:
        return self.pulls[i] if self.pulls else 1

    @property
    def pages_per_block(self) -> int:
        return len(self.page_lists[0])

    @property
    def sent_ranks(self) -> tuple[int, ...]:
        """The DCP ranks that get a rows piece: those holding a prompt page (a short prompt
        leaves ranks empty; they are zeros the decode makes itself)."""
        return tuple(r for r, pages in enumerate(self.page_lists) if any(k >= 0 for k in pages))

    def piece_shapes(self, state_shape, conv_shape, rows_shape) -> list[tuple[int, ...]]:
        """Shapes of the pieces, in order, given the export's ``[nK, H, dk, dv]``,
        ``[nK, W-1, C]`` and ``[nM, P', ps, W]``."""
        nK, _, dk, dv = state_shape
        nM, _, ps, W = rows_shape
        return ([tuple(conv_shape)] + [(nK, self.head_count, dk, dv)] * len(self.head_starts)
                + [(nM, self.pages_per_block, ps, W)] * len(self.sent_ranks))

    def check(self, num_heads: int, prompt_pages: int) -> None:
        """ValueError unless this destination fits a ``num_heads``-head model and a prompt of
        ``prompt_pages`` pages (a bad or hostile one must not index out of the export)."""
        if not self.head_starts or self.head_count <= 0 or any(
                h < 0 or h + self.head_count > num_heads for h in self.head_starts):
            raise ValueError(f"head ranges {self.head_starts} x {self.head_count} do not fit {num_heads} heads")
        if not self.page_lists or len({len(p) for p in self.page_lists}) != 1:
            raise ValueError("the destination's page lists are missing or of different lengths")
        if len(set(self.head_starts)) * self.head_count > num_heads or len(set(self.head_starts)) != len(self.head_starts):
            raise ValueError("the destination's head ranges overlap")
        if self.pages_per_block > 2 * max(1, prompt_pages):  # a power of two over at most that many pages
            raise ValueError("the destination pads its page lists beyond the prompt")
        real = sorted(k for p in self.page_lists for k in p if k != -1)
        if real != list(range(self.first_page, prompt_pages)):
            raise ValueError(f"the destination's page lists do not cover pages {self.first_page} to {prompt_pages - 1} "
                             "of the prompt once each")


def cut_pieces(arrays, dest: Destination, devices) -> list:
    """The prefill's side: the export ``(state, conv, rows)`` cut into ``dest``'s pieces, each
    a single-device array on its device of :func:`piece_devices`."""
    return [jax.device_put(_cut(i, arrays, dest), dev) for i, dev in enumerate(piece_devices(dest, devices))]


def _cut(i: int, arrays, dest: Destination):
    """Piece ``i`` of ``dest`` out of the export ``(state, conv, rows)``: the conv windows, a
    head range of the state, or a DCP rank's pages (padding pages: past the end, zeros)."""
    state, conv, rows = arrays
    if i == 0:
        return conv
    if i <= len(dest.head_starts):
        return _heads(state, jnp.int32(dest.head_starts[i - 1]), dest.head_count)
    pages = dest.page_lists[dest.sent_ranks[i - 1 - len(dest.head_starts)]]
    return _pages(rows, jnp.asarray(np.asarray([k if k >= 0 else rows.shape[1] for k in pages], np.int32)))


def piece_devices(dest: Destination, devices) -> list:
    """The prefill device each of ``dest``'s pieces is cut onto and staged from, in piece
    order (:func:`cut_pieces`' rule: piece r of each kind on ``devices[r % len(devices)]``).
    Devices of several processes are taken in turn (each process's first device, then each
    one's second, ...), so that every prefill process sends a share of each handoff."""
    if len({d.process_index for d in devices}) > 1:
        seen: dict = {}
        turn = [seen.setdefault(d.process_index, [0]) for d in devices]
        rank = []
        for t in turn:
            rank.append(t[0])
            t[0] += 1
        devices = [d for _, _, d in sorted(zip(rank, [d.process_index for d in devices], devices),
                                           key=lambda x: x[:2])]
    n = len(devices)
    return ([devices[0]] + [devices[r % n] for r in range(len(dest.head_starts))]
            + [devices[r % n] for r in dest.sent_ranks])


def cut_local_pieces(arrays, dest: Destination, devices) -> dict:
    """A multi-process prefill's side: ``{piece index: piece}`` for the pieces whose device
    (:func:`piece_devices`) is this process's, cut from this process's whole copy of the
    export (``CacheManager.export_request`` replicates it on every device under multi-host)."""
    local = tuple(a.addressable_shards[0].data for a in arrays)  # whole: the export is replicated
    return {i: jax.device_put(_cut(i, local, dest), dev) for i, dev in enumerate(piece_devices(dest, devices))
            if dev.process_index == jax.process_index()}


def stage_pulls(endpoint, pieces: dict, dest: Destination, uuid: int, timeout_s: float) -> None:
    """Stage each of ``pieces`` (``{piece index: array}``) once per decode process that pulls
    it (``dest.pulls``), each under its own id (:func:`pull_uuid`): a staged array is pulled once."""
    for i, piece in pieces.items():
        for k in range(dest.num_pulls(i)):
            endpoint.stage(pull_uuid(uuid, i, k), [piece], timeout_s)


def pull_uuid(uuid: int, piece: int, reader: int) -> int:
    """The transfer id of the ``reader``-th pull of ``piece`` of handoff ``uuid`` (a staged
    array is pulled once, so a piece that several decode processes need is staged once per
    process, each under its own id)."""
    return (uuid + 1 + piece * 1024 + reader) % (1 << 63)


PROGRAMS = Programs()  # the cut programs' traces, in this process


def _cut_heads(state, h0, count):
    return jax.lax.dynamic_slice_in_dim(state, h0, count, axis=1)


def _cut_pages(rows, idx):
    return jnp.take(rows, idx, axis=1, mode="fill", fill_value=0)


_heads = PROGRAMS.jit(_cut_heads, "deal_heads", static_argnums=2)
_pages = PROGRAMS.jit(_cut_pages, "deal_pages")


def warm_cuts(exports) -> None:
    """Compile the cut programs for every piece a decode can ask of these ``exports`` (one
    ``(state, conv, rows)`` per export page count ``P'``, as ``export_request`` gives them):
    a state piece per head count dividing the heads (the decode splits its heads evenly over
    mesh axes, ``Recipe.validate``), a rows piece per power of two ``Pb <= P'`` (a DCP rank's
    pages, ``Destination.check``)."""
    for state, _, rows in exports:
        for kind, n in cut_variants(state.shape[1], rows.shape[1]):
            if kind == "heads":
                _heads(state, jnp.int32(0), n)
            else:
                _pages(rows, jnp.asarray(np.full(n, rows.shape[1], np.int32)))


def cut_variants(num_heads: int, width: int):
    """``("heads", count)`` per head count dividing ``num_heads`` and ``("pages", Pb)`` per power
    of two ``Pb <= width``: the cut programs an export of ``width`` pages may need."""
    for count in (c for c in range(1, num_heads + 1) if num_heads % c == 0):
        yield "heads", count
    pb = 1
    while pb <= width:
        yield "pages", pb
        pb *= 2


def without_slot_axis(sharding, ndim: int):
    """The sharding of one slot of a ``[n, slots, ...]`` pool sharded as ``sharding``."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, P(spec[0], *spec[2:]))
    return sharding  # one device


def replicated(sharding):
    """Whole on every device of ``sharding``'s mesh (the conv window of a handoff: its pool
    may split the channels, rank-major, which the load program deals out)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P())
    return sharding  # one device


@dataclasses.dataclass
class HandoffTarget:
    """The decode's side of one request's handoff: the :class:`Destination` it asks for, where
    each piece is pulled, and how the load's inputs are laid out."""
    dest: Destination
    shapes: tuple  # global shapes of the load's inputs: state, conv, rows in block order
    dtypes: tuple
    shardings: tuple  # their shardings (the pool's, without the slot axis for state and conv)
    group_blocks: tuple[int, ...]  # the pool blocks of the request's DCP ranks, in rank order
    load_index: np.ndarray  # [blocks * Pb] destination page of each block-order row (num_pages: dropped)
    load_pos0: np.ndarray  # [blocks * Pb] first position of that page

    def _need(self, which: int, dev) -> int | None:
        """Index (into the pieces) of what device ``dev`` holds of input ``which`` (0 state,
        1 conv, 2 rows), or None for zeros (another group's page block)."""
        sl = self.shardings[which].devices_indices_map(self.shapes[which])[dev]
        if which == 1:
            return 0
        if which == 0:
            start = sl[1].start or 0
            return 1 + self.dest.head_starts.index(start)
        block = (sl[1].start or 0) // self.dest.pages_per_block
        rank = self.group_blocks.index(block) if block in self.group_blocks else None
        if rank in self.dest.sent_ranks:
            return 1 + len(self.dest.head_starts) + self.dest.sent_ranks.index(rank)
        return None

    @property
    def num_pieces(self) -> int:
        return 1 + len(self.dest.head_starts) + len(self.dest.sent_ranks)

    def _first_needers(self, devices_of) -> list:
        where: list = [None] * self.num_pieces
        for which in range(3):
            for dev in devices_of(which):
                i = self._need(which, dev)
                if i is not None and where[i] is None:
                    where[i] = dev
        return where

    def pull_devices(self) -> list:
        """One device per piece to pull it onto: the first that needs it (every piece has one:
        a one-process engine)."""
        where = self.local_pull_devices()
        if any(d is None for d in where):
            raise RuntimeError(f"no device of this engine holds piece(s) {[i for i, d in enumerate(where) if d is None]}")
        return where

    def local_pull_devices(self) -> list:
        """Under multi-host: per piece, the first of this process's devices that needs it, or
        None where none does (another process pulls it)."""
        return self._first_needers(
            lambda w: self.shardings[w].addressable_devices_indices_map(self.shapes[w]))

    def readers(self) -> list[list[int]]:
        """Per piece, the processes that pull it (those with a device that needs it), sorted:
        process p makes pull number ``readers[i].index(p)`` of piece i."""
        out: list[set] = [set() for _ in range(self.num_pieces)]
        for which in range(3):
            for dev in self.shardings[which].devices_indices_map(self.shapes[which]):
                i = self._need(which, dev)
                if i is not None:
                    out[i].add(dev.process_index)
        return [sorted(r) for r in out]

    def assemble(self, pieces) -> tuple:
        """The load's inputs (state, conv, rows in block order) from the pulled pieces."""
        out = []
        for which in range(3):
            shape, sharding = self.shapes[which], self.shardings[which]
            bufs = []
            for dev, sl in sharding.addressable_devices_indices_map(shape).items():
                i = self._need(which, dev)
                if i is None:
                    local = tuple(len(range(*s.indices(n))) for s, n in zip(sl, shape))
                    # from host memory, not jnp.zeros: an eager op would compile once per
                    # shape and device while serving, uncounted (a transfer compiles nothing)
                    bufs.append(jax.device_put(np.zeros(local, self.dtypes[which]), dev))
                else:
                    piece = pieces[i]
                    bufs.append(piece if piece.devices() == {dev} else jax.device_put(piece, dev))
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, bufs))
        return tuple(out)
