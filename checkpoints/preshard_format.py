"""The on-disk format of a pre-sharded checkpoint (``k3serve preshard``), shared by the
writer (``preshard.py``) and the reader (``preshard_load.py``).

A pre-sharded checkpoint is a directory::

    DST/k3serve-preshard.json   the manifest, written last: its presence means "complete"
    DST/parts/00000/ ...        Orbax checkpoints (OCDBT), one per batch of parameters

Every array on disk is exactly what the model holds, already converted (names resolved,
``A_log`` narrowed, conv weights reshaped, routed experts stacked ``[E, ...]`` and still
MXFP4-packed), in the model's dtype. A layer-stacked parameter (``model.layer_plan``) is stored
one row per array — the row a checkpoint layer fills — so that neither the writer nor a
reader ever holds more than one row of a stack beyond the model itself. Leaves are named by
the parameter's NNX path with a final ``row_NNN`` for stack rows; in an Orbax tree the path's
dots become nesting (``ffn.1.experts.w1_packed`` row 3 is ``["ffn"]["1"]["experts"]
["w1_packed"]["row_003"]``).

Each part's Orbax ``custom_metadata`` lists its leaves (shape, dtype, sha256 of the bytes),
the source tensors it was made from, and the run that wrote it (``run``: :func:`run_identity`),
so an interrupted run resumes from the parts on disk, a resume by another run (another dtype,
source, recipe or version) is refused instead of mixing parts, and the manifest can be
assembled from them.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

FORMAT = "k3serve-preshard/1"
TRANSFORMS_VERSION = 1  # bump when a conversion of weights.py changes what is stored
MANIFEST = "k3serve-preshard.json"
PARTS = "parts"


class PreshardError(ValueError):
    """A pre-sharded checkpoint that cannot be written or read as asked."""


def is_preshard(path) -> bool:
    """``path`` is a pre-sharded checkpoint directory (complete or not)."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / PARTS).is_dir())


def run_identity(*, dtype: str, config: dict, source_files: list, layout: str | None, experts: str,
                 chunk_mb: int) -> dict:
    """What makes two runs write interchangeable parts: every part records it, a resume must
    match it, ``verify`` finds a pre-shard whose parts differ in it. The source is named by
    its config and files (names and sizes); its tensors' hashes are compared one by one as a
    resume reads them again (``preshard.py``)."""
    return {"format": FORMAT, "transforms_version": TRANSFORMS_VERSION, "dtype": dtype,
            "config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
            "source_files": [dict(f) for f in source_files], "layout": layout, "experts": experts,
            "chunk_mb": chunk_mb}


def identity_diff(a: dict | None, b: dict | None, labels=("earlier run", "this run")) -> str:
    """The fields in which run identities ``a`` and ``b`` differ, for a message ("dtype
    'float32' (earlier run) vs 'bfloat16' (this run); ..."); empty when equal."""
    if a == b:
        return ""
    if a is None or b is None:
        return f"no run identity recorded ({labels[0 if a is None else 1]}: written by an older k3serve)"
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if x != y:
            if k in ("config_sha256", "source_files"):  # long values: name the field only
                out.append(f"{k.replace('_sha256', '')} differs")
            else:
                out.append(f"{k} {x!r} ({labels[0]}) vs {y!r} ({labels[1]})")
    return "; ".join(out)


def leaf_key(param_path: str, row: int | None) -> str:
    """The flat name of one stored array: ``ffn.1.experts.w1_packed/row_003``."""
    return param_path if row is None else f"{param_path}/row_{row:03d}"


def split_key(key: str) -> tuple[str, int | None]:
    path, _, row = key.partition("/row_")
    return path, (int(row) if row else None)


def nest(flat: dict) -> dict:
    """``{leaf_key: x}`` as the nested dict Orbax stores (dots and the row are levels)."""
    out: dict = {}
    for key, v in flat.items():
        path, row = split_key(key)
        parts = path.split(".") + ([f"row_{row:03d}"] if row is not None else [])
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def unnest(tree: dict, wanted) -> dict:
    """The leaves of ``tree`` (a loaded :func:`nest` tree) for the keys ``wanted``."""
    out = {}
    for key in wanted:
        path, row = split_key(key)
        node = tree
        for p in path.split(".") + ([f"row_{row:03d}"] if row is not None else []):
            node = node[p]
        out[key] = node
    return out


def digest(host: np.ndarray) -> str:
    """sha256 of an array's C-order bytes (what a leaf's hash is)."""
    return hashlib.sha256(np.ascontiguousarray(host).view(np.uint8).reshape(-1).data).hexdigest()


_MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9)
_ROWS = 1 << 14  # rows of a block contracted at once (bounds the uint64 temporaries)


def sum64(block: np.ndarray, starts=None, shape=None) -> int:
    """A leaf's checksum that any partition of it can compute: the sum, modulo 2**64, over its
    elements of (the element's bits + 1) times the product of one odd weight per axis, mixed
    from the element's index on that axis (and the axis). ``block`` sits at ``starts`` (its
    first index on every axis) in an array of ``shape`` (default: ``block`` is the whole
    array). The partial sums of disjoint blocks that cover the array add up (mod 2**64) to the
    whole array's: what the processes of a multi-process pre-shard compute for their own
    shards, and what ``verify`` and a one-process pre-shard compute whole, whatever the
    recipe. Any one changed element changes it (the weights are odd); it is a checksum
    against corruption, not a cryptographic hash. The weights being per axis, it is a chain
    of contractions (about 2 GB/s of uint8 on one core)."""
    block = np.ascontiguousarray(block)
    shape = tuple(block.shape) if shape is None else tuple(shape)
    starts = (0,) * len(shape) if starts is None else tuple(starts)
    bits = block.reshape(-1).view(f"u{block.dtype.itemsize}").reshape(block.shape)
    if bits.size == 0:
        return 0
    if bits.ndim == 0:
        return int(bits) + 1
    ws = [_weights(np.arange(starts[k], starts[k] + bits.shape[k], dtype=np.uint64), k) for k in range(bits.ndim)]
    ones = 1
    for w in ws:  # the "+ 1" of every element: the product of the weights' sums
        ones = ones * int(np.sum(w, dtype=np.uint64)) % (1 << 64)
    last = bits.reshape(-1, bits.shape[-1])
    acc = np.empty(last.shape[0], np.uint64)
    for r0 in range(0, last.shape[0], _ROWS):
        acc[r0:r0 + _ROWS] = np.einsum("ij,j->i", last[r0:r0 + _ROWS], ws[-1], dtype=np.uint64)
    acc = acc.reshape(bits.shape[:-1])
    for w in reversed(ws[:-1]):
        acc = np.einsum("...j,j->...", acc, w, dtype=np.uint64)
    return (int(acc) + int(ones)) % (1 << 64)


def _weights(idx: np.ndarray, axis: int) -> np.ndarray:
    x = (idx + np.uint64(axis * 0x632BE59BD9B4E019 % (1 << 64))) * _MIX1
    x ^= x >> np.uint64(31)
    x *= _MIX2
    x ^= x >> np.uint64(29)
    return x | np.uint64(1)


def sum64_hex(value: int) -> str:
    return f"{value % (1 << 64):016x}"


def slice_key(name: str, index, shape) -> str:
    """The name under which a slice of source tensor ``name`` is recorded: ``name`` for the
    whole tensor, else ``name[a:b,c:d]`` (every axis, plain slices)."""
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    spans = []
    for i, n in zip(index, shape):
        if isinstance(i, slice):
            a, b, step = i.indices(n)
            if step != 1:
                raise ValueError(f"slice {i} of {name!r} has a step")
        else:
            a, b = int(i), int(i) + 1
        spans.append((a, max(a, b)))
    if all(s == (0, n) for s, n in zip(spans, shape)):
        return name
    return f"{name}[{','.join(f'{a}:{b}' for a, b in spans)}]"


def parse_slice_key(key: str) -> tuple[str, tuple | None]:
    """``slice_key``'s inverse: (tensor name, tuple of slices, or None for the whole)."""
    if not key.endswith("]") or "[" not in key:
        return key, None
    name, _, spans = key[:-1].rpartition("[")
    return name, tuple(slice(int(a), int(b)) for a, b in (s.split(":") for s in spans.split(",")))


def read_manifest(path) -> dict:
    """The manifest of a complete pre-sharded checkpoint; a clear error for anything else."""
    p = Path(path)
    f = p / MANIFEST
    if not f.is_file():
        if (p / PARTS).is_dir():
            raise PreshardError(f"{p}: an unfinished pre-shard (no {MANIFEST}); run k3serve preshard again "
                                "to resume it")
        raise PreshardError(f"{p}: not a pre-sharded checkpoint (no {MANIFEST})")
    try:
        with open(f) as fh:
            man = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise PreshardError(f"{f}: unreadable manifest ({err})") from None
    fmt = man.get("format")
    if fmt != FORMAT:
        raise PreshardError(f"{p}: format {fmt!r}, this k3serve reads {FORMAT!r}: pre-shard the checkpoint "
                            "again with this version")
    if man.get("transforms_version") != TRANSFORMS_VERSION:
        raise PreshardError(f"{p}: written with weight transforms v{man.get('transforms_version')}, this k3serve "
                            f"uses v{TRANSFORMS_VERSION}: pre-shard again")
    return man


def write_json_atomic(path, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
