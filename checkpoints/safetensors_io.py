"""Read and write Hugging Face safetensors checkpoints one tensor at a time.

Why this module exists: K3 checkpoints (real: 96 shards / 1.5 TB; synthetic: tens of MB)
must never be materialised whole. The reader opens ``model.safetensors`` or the sharded
``model-XXXXX-of-YYYYY.safetensors`` + ``model.safetensors.index.json`` layout, answers
names/shapes/dtypes from the headers alone and reads a single tensor on request. The writer
consumes an iterable of ``(name, array)`` and streams each tensor to disk as it arrives, so
a generator can produce a checkpoint with at most one tensor in memory.

Reading uses ``safetensors.safe_open(framework="numpy")``; ``ml_dtypes`` is imported first so
BF16 tensors come back as ``ml_dtypes.bfloat16`` arrays.

Writing implements the safetensors file format directly (8-byte little-endian header length,
JSON header, contiguous data) because ``safetensors.numpy.save_file`` needs every tensor in a
dict at once. Tensor data of a shard is first streamed to per-itemsize spool files, then
concatenated behind the header in decreasing itemsize order (8, 4, 2, 1 bytes), and the header
is padded with spaces to a multiple of 8 — so every tensor is naturally aligned, as in files
written by the reference serializer. Metadata is ``{"format": "pt"}``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy before safetensors.numpy is used)
import numpy as np
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

_NP_TO_ST = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint16): "U16",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


def safetensors_dtype(dtype) -> str:
    """The safetensors dtype string ('BF16', 'F32', 'U8', ...) of a NumPy dtype."""
    dt = np.dtype(dtype).newbyteorder("=")
    try:
        return _NP_TO_ST[dt]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} cannot be stored in safetensors") from None


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}


class LazyTensor:
    """One tensor of a checkpoint, read only where indexed: ``t[a:b]`` reads just those rows'
    bytes and ``t[a:b, c:d]`` those columns of each row, with ``os.pread`` — no memory map,
    so nothing of the file stays resident in the process. Any other index (steps, cuts past
    the second axis) reads the whole tensor once and keeps it for the next such index.
    ``np.asarray(t)`` reads it whole. What a multi-process load uses so that each process
    reads only the slices its devices hold (``model.weights``)."""

    unread = True  # what the weight loader looks for: data it may read slice by slice

    def __init__(self, path: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, owner=None):
        self.path, self.offset, self.shape, self.dtype = path, offset, tuple(shape), np.dtype(dtype)
        self.ndim = len(self.shape)
        self.owner = owner  # the Checkpoint, which counts the bytes its tensors read
        self._whole: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def _read(self, first: int, count: int) -> np.ndarray:
        """Elements ``[first, first + count)`` of the flattened tensor."""
        n = count * self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            buf = bytearray(n)
            view, got = memoryview(buf), 0
            while got < n:
                k = os.preadv(fd, [view[got:]], self.offset + first * self.dtype.itemsize + got)
                if k <= 0:
                    raise OSError(f"{self.path}: short read at byte {self.offset + first * self.dtype.itemsize + got}")
                got += k
        finally:
            os.close(fd)
        if self.owner is not None:
            self.owner.bytes_read += n
        return np.frombuffer(buf, self.dtype)

    def __array__(self, dtype=None, copy=None):
        a = self._read(0, self.size).reshape(self.shape)
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (len(self.shape) - len(index))
        plain = [isinstance(i, slice) and i.step in (None, 1) for i in index]
        whole = [isinstance(i, slice) and i.indices(n) == (0, n, 1) for i, n in zip(index, self.shape)]
        if self.shape and plain[0] and all(whole[2:]) and (len(self.shape) == 1 or plain[1]):
            a, b, _ = index[0].indices(self.shape[0])
            b = max(a, b)
            inner = int(np.prod(self.shape[2:], dtype=np.int64))  # elements per [row, column]
            if len(self.shape) == 1 or whole[1]:  # a block of whole rows: one read
                row = int(np.prod(self.shape[1:], dtype=np.int64))
                return self._read(a * row, (b - a) * row).reshape((b - a,) + self.shape[1:])
            # columns c0:c1 of rows a:b (a column-parallel shard): one read per row
            c0, c1, _ = index[1].indices(self.shape[1])
            c1 = max(c0, c1)
            cols = self.shape[1]
            out = np.empty((b - a, c1 - c0) + self.shape[2:], self.dtype)
            for r in range(a, b):
                out[r - a] = self._read((r * cols + c0) * inner, (c1 - c0) * inner).reshape(out.shape[1:])
            return out
        # anything else (steps, integer indices, cuts past the second axis): the whole tensor
        # once, kept while this object lives (the load drops it once the parameter is placed)
        if self._whole is None:
            self._whole = np.asarray(self)
        return self._whole[index]


class Checkpoint:
    """Lazy view of a safetensors checkpoint directory (see :func:`open_checkpoint`)."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if p.is_file():  # a single .safetensors file; config.json is looked up next to it
            root, files = p.parent, {None: p.name}
        elif (p / INDEX_FILE).is_file():
            root = p
            with open(p / INDEX_FILE) as fh:
                weight_map = json.load(fh)["weight_map"]
            files = dict(weight_map)
        elif (p / SINGLE_FILE).is_file():
            root, files = p, {None: SINGLE_FILE}
        else:
            raise FileNotFoundError(
                f"{p}: no {SINGLE_FILE} or {INDEX_FILE} (not a safetensors checkpoint directory)"
            )
        self.path = p
        self._root = root
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, header), for lazy()
        self.bytes_read = 0  # by lazy() tensors
        if None in files:  # single file: names come from its header
            fname = files[None]
            self._where = {name: fname for name in self._handle(fname).keys()}
        else:
            self._where = files
            for fname in sorted(set(files.values())):
                if not (root / fname).is_file():
                    raise FileNotFoundError(f"{p}: shard {fname} listed in {INDEX_FILE} is missing")
        self._keys = sorted(self._where)
        cfg = root / CONFIG_FILE
        if cfg.is_file():
            with open(cfg) as fh:
                self.config: dict = json.load(fh)
        else:
            self.config = {}

    # -- internals ---------------------------------------------------------------------------
    def _handle(self, fname: str):
        h = self._handles.get(fname)
        if h is None:  # opened lazily (again after close())
            h = safe_open(str(self._root / fname), framework="numpy")
            self._handles[fname] = h
        return h

    def _file_of(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.path}") from None

    # -- public API --------------------------------------------------------------------------
    @property
    def files(self) -> list[str]:
        """Safetensors file names (relative to the checkpoint directory)."""
        return sorted(set(self._where.values()))

    @property
    def nbytes(self) -> int:
        """Size of the safetensors files on disk."""
        return sum((self._root / f).stat().st_size for f in self.files)

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return list(self._keys)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the header (no data read)."""
        return tuple(self._handle(self._file_of(name)).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """Safetensors dtype string from the header, e.g. 'BF16', 'F32', 'U8'."""
        return self._handle(self._file_of(name)).get_slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        """Read one tensor (BF16 -> ml_dtypes.bfloat16)."""
        return self._handle(self._file_of(name)).get_tensor(name)

    def lazy(self, name: str) -> LazyTensor:
        """A :class:`LazyTensor` of ``name``: nothing is read until it is indexed."""
        fname = self._file_of(name)
        path = str(self._root / fname)
        head = self._headers.get(fname)
        if head is None:
            with open(path, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                head = self._headers[fname] = (8 + n, json.loads(fh.read(n)))
        start, meta = head
        info = meta[name]
        if info["dtype"] not in _ST_TO_NP:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader does not know")
        return LazyTensor(path, start + info["data_offsets"][0], info["shape"], _ST_TO_NP[info["dtype"]], owner=self)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(name, array)`` one tensor at a time, in sorted name order."""
        for name in self._keys:
            yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._keys)} tensors, {len(self.files)} file(s))"


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a Hugging Face safetensors checkpoint directory (single-file or sharded)."""
    return Checkpoint(path)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class _ShardWriter:
    """Spool tensors of one shard to per-itemsize temp files; ``finish`` writes the file."""

    def __init__(self, tmp_dir: Path):
        self._tmp_dir = tmp_dir
        self._spools: dict[int, object] = {}
        self._entries: dict[int, list[tuple[str, str, list[int], int]]] = {}
        self.nbytes = 0
        self.names: list[str] = []

    def add(self, name: str, arr: np.ndarray) -> None:
        st = safetensors_dtype(arr.dtype)
        arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"))
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
            arr = arr.copy(order="C")
        size = arr.dtype.itemsize
        if size not in self._spools:
            self._spools[size] = tempfile.TemporaryFile(dir=self._tmp_dir)
            self._entries[size] = []
        self._spools[size].write(memoryview(arr.reshape(-1).view(np.uint8)))
        self._entries[size].append((name, st, list(arr.shape), arr.nbytes))
        self.nbytes += arr.nbytes
        self.names.append(name)

    def finish(self, path: Path) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        order = sorted(self._spools, reverse=True)
        for size in order:
            for name, st, shape, nbytes in self._entries[size]:
                header[name] = {"dtype": st, "shape": shape, "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            for size in order:
                spool = self._spools[size]
                spool.seek(0)
                shutil.copyfileobj(spool, out, 1 << 22)
                spool.close()
        self._spools.clear()


def _iter_tensors(tensors) -> Iterator[tuple[str, np.ndarray]]:
    if isinstance(tensors, Mapping):
        yield from tensors.items()
    else:
        yield from tensors


def write_checkpoint(
    out_dir: str | os.PathLike,
    config: dict | None,
    tensors: Iterable[tuple[str, np.ndarray]] | Mapping[str, np.ndarray],
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``config.json`` and the tensors as a Hugging Face safetensors checkpoint.

    ``tensors`` is consumed lazily; each array is written out as soon as it arrives. With
    ``max_shard_bytes=None`` (or when everything fits in one shard) the result is a single
    ``model.safetensors``; otherwise shards ``model-00001-of-0000N.safetensors`` are cut
    whenever the next tensor would push a non-empty shard past ``max_shard_bytes`` (a tensor
    larger than the limit gets a shard of its own), plus ``model.safetensors.index.json``
    (``metadata.total_size`` = tensor bytes, ``weight_map`` name -> file). Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive or None, got {max_shard_bytes}")
    if config is not None:
        with open(out / CONFIG_FILE, "w") as fh:
            json.dump(config, fh, indent=2)
            fh.write("\n")
    for stale in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)

    seen: set[str] = set()
    shard_paths: list[tuple[Path, list[str]]] = []
    total = 0
    with tempfile.TemporaryDirectory(dir=out, prefix=".spool-") as tmp:
        tmp_dir = Path(tmp)
        shard = _ShardWriter(tmp_dir)

        def flush() -> None:
            part = tmp_dir / f"part-{len(shard_paths):05d}.safetensors"
            shard.finish(part)
            shard_paths.append((part, shard.names))

        for name, arr in _iter_tensors(tensors):
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            if name in seen:
                raise ValueError(f"duplicate tensor name {name!r}")
            seen.add(name)
            arr = np.asarray(arr)
            if max_shard_bytes is not None and shard.names and shard.nbytes + arr.nbytes > max_shard_bytes:
                flush()
                shard = _ShardWriter(tmp_dir)
            shard.add(name, arr)
            total += arr.nbytes
        if shard.names or not shard_paths:
            flush()

        n = len(shard_paths)
        if n == 1:
            os.replace(shard_paths[0][0], out / SINGLE_FILE)
        else:
            weight_map: dict[str, str] = {}
            for i, (part, names) in enumerate(shard_paths):
                fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                os.replace(part, out / fname)
                weight_map.update((nm, fname) for nm in names)
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            with open(out / INDEX_FILE, "w") as fh:
                json.dump(index, fh, indent=2)
                fh.write("\n")
    return out
