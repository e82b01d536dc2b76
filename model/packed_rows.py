"""16-bit layer stacks stored as row pairs in ``uint32``: the tiling XLA:TPU's matmuls read.

XLA:TPU stores a 16-bit array in ``(8, 128)`` tiles by default, and its matmuls read 16-bit
operands in ``(16, 128)(2, 1)`` tiles: 16 rows by 128 columns, each 32-bit word holding
rows ``2i`` and ``2i + 1`` of one column. A step program given a layer stack
``bf16[L, R, C]`` split over devices therefore copies the whole stack into the matmuls'
tiling before its layer loop, on every call (a temporary as large as the stack, read and
written once more per step). The compiler drops a tiling asked for a split parameter
(docs/compile.md, "The layer stacks, stored in the matmuls' tiling"), so the stacks are stored in a dtype
whose *default* tiling is the matmuls' one: ``uint32[L, R / 2, C]``, word ``(i, c)`` holding
the 16-bit rows ``2i`` and ``2i + 1`` of column ``c``. ``uint32``'s default ``(8, 128)``
tile is then byte for byte a ``(16, 128)(2, 1)`` tile of the 16-bit rows, and unpacking a
layer's row inside the step (``unpack_rows``) costs no copy: XLA unpacks it with shifts and
masks on the layer's slice in VMEM, where the scan reads it for the matmul.

What is packed (:func:`pack_layer_stacks`): the parameters the layer scan slices per layer
(``attn.*``, and ``ffn.*`` except the routed experts, which the expert op indexes whole),
16-bit, at least rank 3, with an even number of at least 16 rows and more than 128 columns
per device — the stacks the compiler re-tiles (``sharding.memory.retiled_per_device``).
Packing is lossless and the model reads packed and plain stacks alike (``KimiLM.step``
unpacks a ``uint32`` row), so every path over the parameters (prefill, decode, capture,
the engine's programs) gives the same numbers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PACKED = jnp.dtype(jnp.uint32)


def pack_rows(a):
    """``[..., R, C]`` 16-bit -> ``uint32[..., R / 2, C]`` (rows ``2i`` and ``2i + 1`` in word ``i``)."""
    *lead, R, C = a.shape
    pairs = jnp.swapaxes(a.reshape(*lead, R // 2, 2, C), -1, -2)  # [..., R/2, C, 2]
    return jax.lax.bitcast_convert_type(pairs, PACKED)


def unpack_rows(w, dtype):
    """Inverse of :func:`pack_rows`: ``uint32[..., R / 2, C]`` -> ``dtype[..., R, C]``."""
    pairs = jax.lax.bitcast_convert_type(w, jnp.dtype(dtype))  # [..., R/2, C, 2]
    return jnp.swapaxes(pairs, -1, -2).reshape(*w.shape[:-2], w.shape[-2] * 2, w.shape[-1])


def is_packed(a) -> bool:
    return jnp.dtype(a.dtype) == PACKED


def _local_shape(a) -> tuple[int, ...]:
    sharding = getattr(a, "sharding", None)
    return tuple(sharding.shard_shape(tuple(a.shape))) if sharding is not None else tuple(a.shape)


def packable_shape(local_shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether a layer stack with this per-device shape and item size is stored packed: the
    16-bit stacks XLA:TPU re-tiles (rank >= 3, at least 16 rows and more than 128 columns
    per device, libtpu 0.0.42.1), with an even number of rows per device."""
    if itemsize != 2 or len(local_shape) < 3:
        return False
    rows, cols = local_shape[-2:]
    return rows >= 16 and rows % 2 == 0 and cols > 128


def packable(a) -> bool:
    """Whether ``a`` (an array or a placed ``ShapeDtypeStruct``: a layer stack) is stored packed."""
    return packable_shape(_local_shape(a), jnp.dtype(a.dtype).itemsize)


def _scanned(path: str) -> bool:
    """A parameter the layer scan slices per layer (``KimiLM.step``'s ``rows_of``)."""
    return path.startswith(("attn.", "ffn.")) and ".experts." not in path


def _flat(params):
    """``(path, variable, packs)`` per leaf of an NNX state: ``packs`` says whether
    :func:`pack_layer_stacks` packs it."""
    from flax import nnx

    for p, v in nnx.to_flat_state(params):
        yield p, v, _scanned(".".join(map(str, p))) and packable(v.get_value())


def packed_paths(params) -> list[str]:
    """The parameters of an NNX state :func:`pack_layer_stacks` packs (by path)."""
    return [".".join(map(str, p)) for p, _, packs in _flat(params) if packs]


def _pack_leaf(a):
    if isinstance(a, jax.ShapeDtypeStruct):  # ``k3serve compile``: shapes only, same sharding
        return jax.ShapeDtypeStruct((*a.shape[:-2], a.shape[-2] // 2, a.shape[-1]), PACKED, sharding=a.sharding)
    if not isinstance(a, jax.Array):
        return np.asarray(pack_rows(jnp.asarray(a)))
    # each device packs its own rows (pairs never straddle a shard: local rows are even). Not
    # donated: XLA aliases no input to an output of another shape, so the stack is freed when
    # the last state holding it goes
    return jax.jit(pack_rows, out_shardings=a.sharding)(a)


def pack_layer_stacks(params):
    """A new NNX state with the layer stacks :func:`packable` packed (see the module doc);
    stacks packed already are kept. Placed arrays are packed on their devices."""
    from flax import nnx

    return nnx.from_flat_state([(p, v.replace(_pack_leaf(v.get_value())) if packs else v)
                                for p, v, packs in _flat(params)])


def adopt_packed(params, before, after):
    """``params`` with each leaf that is ``before``'s leaf (the same array) replaced by
    ``after``'s: a model that shared arrays with one :func:`pack_layer_stacks` packed takes
    the packed ones."""
    from flax import nnx

    old = {p: v.get_value() for p, v in nnx.to_flat_state(before)}
    new = {p: v.get_value() for p, v in nnx.to_flat_state(after)}
    flat = []
    for p, v in nnx.to_flat_state(params):
        if p in old and v.get_value() is old[p] and new[p] is not old[p]:
            v = v.replace(new[p])
        flat.append((p, v))
    return nnx.from_flat_state(flat)
