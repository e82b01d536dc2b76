"""``k3serve preshard``: a Hugging Face safetensors checkpoint → an Orbax checkpoint laid out
for a recipe (format: ``preshard_format.py``; usage: docs/preshard.md).

The source is streamed tensor by tensor through the same conversions the safetensors load
does (``model.weights.load_weights`` with a sink): each converted parameter, or row of a
layer-stacked parameter, is placed on the recipe's mesh slice by slice and added to the open
batch. A batch is written as one Orbax checkpoint (``parts/NNNNN``) once it holds a quarter
of ``max_memory_gb`` (counted over every device copy: on CPU a replicated array costs one
copy per virtual device), then dropped. Host memory is therefore bounded by one batch plus
one layer's routed experts, whatever the size of the checkpoint.

An interrupted run resumes: parts on disk are complete (Orbax commits a part by renaming it
into place), their leaves are skipped and the next part number follows the last. Only the
same run resumes: every part records its run's identity (``preshard_format.run_identity``:
dtype, source config and files, layout, versions), and a resume that differs is refused, as
is a source tensor whose hash differs from the one an earlier part was made from. The
manifest is written last; until it exists the directory is not a checkpoint a load accepts.

The destination is only ever deleted when it is a pre-shard (``--overwrite``); a folder that
is something else, or that holds the source, is refused with nothing in it touched.

**Several processes** (``jax.distributed`` initialised, the recipe's mesh spanning them): each
process reads from the source only the slices its own devices hold (lazy tensors, as a
multi-process safetensors load does; a tensor a conversion needs whole is read whole), and
Orbax's multi-process save writes each shard from the process that holds it. Each leaf's
``sum64`` (``preshard_format.sum64``) is summed from the processes' partial sums over their
shards, and each process records the sha256 of every source slice it read; both are
exchanged through the distributed runtime's key-value store before a part is saved, so every
process passes the same metadata. Process 0 alone removes (``--overwrite``, a resume's
half-written part) and writes the manifest and the side files, between barriers. The
destination must be one folder every process sees (a shared file system or a bucket).
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .preshard_load import release_freed_memory
from .preshard_format import (FORMAT, MANIFEST, PARTS, TRANSFORMS_VERSION, PreshardError, digest, identity_diff,
                              is_preshard, leaf_key, nest, run_identity, slice_key, sum64, sum64_hex,
                              write_json_atomic)

DEFAULT_CHUNK_MB = 32  # storage chunks: a restore on another recipe reads these, not whole saved shards


def _orbax_context(chunk_bytes: int, inflight_bytes: int):
    import orbax.checkpoint as ocp

    o = ocp.v1.options
    saving = o.ArrayOptions.Saving(storage_options=o.ArrayOptions.Saving.StorageOptions(chunk_byte_size=chunk_bytes),
                                   use_compression=False)
    return ocp.v1.Context(array_options=o.ArrayOptions(saving=saving),
                          memory_options=o.MemoryOptions(write_concurrent_bytes=inflight_bytes,
                                                         transfer_concurrent_bytes=inflight_bytes))


def _check_destination(src: Path, dst: Path, overwrite: bool) -> bool:
    """Refuse, before anything is written or removed, a ``dst`` that holds the source, that
    is not a pre-shard and not empty, or that is a complete pre-shard (without ``overwrite``).
    Returns whether ``dst`` is a pre-shard to remove (``overwrite``; never anything else)."""
    s, d = src.resolve(), dst.resolve()
    if s == d or d in s.parents:
        raise PreshardError(f"{dst}: holds the source {src}; choose a destination outside it (nothing was touched)")
    if not dst.exists():
        return False
    if not dst.is_dir():
        raise PreshardError(f"{dst}: exists and is not a folder (nothing was touched)")
    if not is_preshard(dst):
        if any(dst.iterdir()):
            raise PreshardError(f"{dst}: exists and is not a pre-sharded checkpoint; choose an empty or new folder "
                                "(nothing in it was touched; --overwrite replaces only a pre-shard)")
        return False
    if (dst / MANIFEST).exists() and not overwrite:
        raise PreshardError(f"{dst}: a complete pre-sharded checkpoint is already there (pass --overwrite "
                            "to replace it)")
    return overwrite


def _committed_parts(parts_dir: Path, identity: dict) -> tuple[dict, dict, int, list]:
    """Leaves and source hashes of the parts an earlier run committed, which must have been
    written by a run of the same ``identity`` (else :class:`PreshardError`, naming what
    differs). Returns (leaves, sources, next part number, what else is there to remove: an
    interrupted part's temporary folder)."""
    import orbax.checkpoint as ocp

    leaves: dict = {}
    sources: dict = {}
    nxt = 0
    if not parts_dir.is_dir():
        return leaves, sources, nxt, []
    entries = sorted(parts_dir.iterdir())
    committed = [p for p in entries if p.name.isdigit() and ocp.v1.is_orbax_checkpoint(p)]
    for p in committed:
        meta = ocp.v1.pytree_metadata(p).custom_metadata or {}
        if meta.get("format") != FORMAT:
            raise PreshardError(f"{p}: a part of format {meta.get('format')!r}, not {FORMAT!r}: "
                                "use --overwrite to start over")
        diff = identity_diff(meta.get("run"), identity)
        if diff:
            raise PreshardError(f"{p}: written by another run ({diff}); resume with the same source, --dtype, "
                                "--recipe and --chunk-mb, or pass --overwrite to start over")
        for k, v in meta["leaves"].items():
            leaves[k] = dict(v, part=p.name)
        sources.update(meta.get("sources", {}))
        nxt = max(nxt, int(p.name) + 1)
    return leaves, sources, nxt, [p for p in entries if p not in committed]


def _remove(paths) -> None:
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


_runs = 0  # pre-shards run by this process: every process runs the same ones, in the same order


class _Processes:
    """What the processes of a multi-process pre-shard share: barriers and an all-gather of
    small JSON values, both through the distributed runtime's key-value store (no device
    collective), named per run (a barrier or key is used once). With one process both are
    trivial."""

    def __init__(self, timeout_s: float = 1800.0):
        import jax

        global _runs
        _runs += 1
        self.run = _runs
        self.index, self.count = jax.process_index(), jax.process_count()
        self.timeout_ms = int(timeout_s * 1000)
        self.client = None
        if self.count > 1:
            from jax._src import distributed

            self.client = distributed.global_state.client

    @property
    def lead(self) -> bool:
        return self.index == 0

    def barrier(self, tag: str) -> None:
        if self.client is not None:
            self.client.wait_at_barrier(f"k3serve/preshard/{self.run}/{tag}", self.timeout_ms)

    def gather(self, tag: str, value) -> list:
        """Every process's ``value`` (JSON), in process order."""
        if self.client is None:
            return [value]
        key = f"k3serve/preshard/{self.run}/{tag}"
        self.client.key_value_set(f"{key}/{self.index}", json.dumps(value))
        return [json.loads(self.client.blocking_key_value_get(f"{key}/{i}", self.timeout_ms))
                for i in range(self.count)]


class _Recorded:
    """A source tensor read lazily (``safetensors_io.LazyTensor``) whose every read is handed
    to ``record(key, array)`` (``slice_key``: the tensor's name, with the slice when not
    whole): in a multi-process run each process hashes the slices it reads."""

    unread = True  # the weight loader keeps it unread until a device takes its slice

    def __init__(self, lazy, name: str, record):
        self.lazy, self.name, self.record = lazy, name, record
        self.shape, self.dtype, self.ndim = lazy.shape, lazy.dtype, lazy.ndim

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.lazy)
        self.record(self.name, a)
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index):
        a = self.lazy[index]
        self.record(slice_key(self.name, index, self.shape), a)
        return a


class _Progress:
    """Bytes read of the source, with rate and ETA: a rich bar on a terminal, a line per
    part elsewhere (logs)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.bar = Progress("pre-shard", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                TimeRemainingColumn(), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("pre-shard", total=total)
        self.lines = enabled and self.bar is None

    def read(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def part(self, name: str, leaves: int, nbytes: int) -> None:
        if self.lines:
            dt = time.perf_counter() - self.t0
            rate = self.done / dt if dt > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            print(f"pre-shard: part {name}: {leaves} arrays, {nbytes / 2**20:.1f} MiB; read "
                  f"{self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB, {rate / 2**20:.0f} MiB/s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


SIDE_FILE_LIMIT = 256 * 2**20


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json, the tokenizer files and the like (every file of ``src`` that is not
    weights), so that ``serve --model DST`` finds its tokenizer."""
    root = src if src.is_dir() else src.parent  # a single .safetensors file: its folder
    for f in sorted(root.iterdir()):
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) \
                and f.stat().st_size <= SIDE_FILE_LIMIT:
            shutil.copy2(f, dst / f.name)


def preshard(src, dst, *, recipe=None, dtype: str = "float32", max_memory_gb: float = 4.0,
             chunk_mb: int = DEFAULT_CHUNK_MB, overwrite: bool = False, progress: bool = False,
             on_part: Callable[[str], None] | None = None) -> dict:
    """Write ``src`` (a safetensors checkpoint directory) to ``dst`` for ``recipe`` (a recipe
    string or :class:`Recipe`; None: one device). Returns the manifest, plus ``this_process``
    (what this process read of the source; not in the file). ``on_part(name)`` is called after
    each part is committed (tests interrupt a run there). With ``jax.distributed`` initialised,
    every process calls it alike (see the module doc)."""
    import jax
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from ..model.config import K3Config
    from ..model.k3 import KimiLM
    from ..model.pretrained import resolve_dtype
    from ..model.weights import _placed, _row_sharding, load_weights
    from ..sharding.mesh import build_mesh, placement_for
    from ..sharding.recipe import Recipe
    from .safetensors_io import open_checkpoint
    import orbax.checkpoint as ocp

    src, dst = Path(src), Path(dst).absolute()  # Orbax takes absolute paths only
    procs = _Processes()
    spans = procs.count > 1
    remove = _check_destination(src, dst, overwrite)  # every process checks before any removes
    procs.barrier("checked")
    if remove and procs.lead:
        shutil.rmtree(dst)
    procs.barrier("cleared")
    dt = resolve_dtype(dtype)
    with open_checkpoint(src) as ckpt:
        cfg = K3Config.from_dict(ckpt.config).replace(kernels="reference")
        rec = Recipe.parse(recipe).validate(cfg) if recipe is not None else None
        if spans and rec is None:
            raise PreshardError(f"a pre-shard by {procs.count} processes needs a recipe whose mesh spans them "
                                "(--recipe)")
        if rec is not None and rec.devices > len(jax.devices()):
            raise PreshardError(f"recipe {rec} needs {rec.devices} devices, this process sees {len(jax.devices())} "
                                f"(on a CPU host: k3serve preshard --devices {rec.devices})")
        devs = jax.devices()[: rec.devices if rec else 1]
        place = placement_for(build_mesh(rec, devs)) if rec else (lambda path, shape: SingleDeviceSharding(devs[0]))
        module = nnx.eval_shape(lambda: KimiLM(cfg, dt))
        files = [{"name": f, "bytes": (ckpt._root / f).stat().st_size} for f in ckpt.files]
        experts = "mxfp4-packed" if cfg.experts_mxfp4 else "dense"
        identity = run_identity(dtype=dt.name, config=ckpt.config, source_files=files,
                                layout=str(rec) if rec else None, experts=experts, chunk_mb=chunk_mb)

        parts_dir = dst / PARTS
        done, sources, number, junk = _committed_parts(parts_dir, identity)
        procs.barrier("resumed")  # every process has read the committed parts before any removal
        if procs.lead:
            _remove(junk)
            parts_dir.mkdir(parents=True, exist_ok=True)
        procs.barrier("ready")
        resumed = len(done)
        budget = int(max_memory_gb * 2**30)
        bar = _Progress(ckpt.nbytes, progress and procs.lead)
        batch: dict = {}
        batch_meta: dict = {}
        batch_sources: dict = {}
        held = [0.0]
        specs: dict = {}

        def flush():
            nonlocal number
            if not batch:
                return
            name = f"{number:05d}"
            if spans:  # every process passes the same metadata: the leaves' sums and all sources
                mine = {"sums": {k: v.pop("sum64_part") for k, v in batch_meta.items()}, "sources": batch_sources}
                everyone = procs.gather(f"part/{name}", mine)
                for k, v in batch_meta.items():
                    v["sum64"] = sum64_hex(sum(int(o["sums"][k]) for o in everyone))
                merged: dict = {}
                for o in everyone:
                    merged.update(o["sources"])
                batch_sources.clear()
                batch_sources.update(merged)
            with _orbax_context(chunk_mb * 2**20, max(budget // 4, 1 << 20)):
                ocp.v1.save_pytree(parts_dir / name, nest(batch), custom_metadata={
                    "format": FORMAT, "run": identity, "leaves": batch_meta, "sources": batch_sources})
            for k, v in batch_meta.items():
                done[k] = dict(v, part=name)
            sources.update(batch_sources)
            bar.part(name, len(batch), int(held[0]))
            batch.clear(), batch_meta.clear(), batch_sources.clear()
            release_freed_memory()
            held[0] = 0.0
            number += 1
            if on_part is not None:
                on_part(name)

        def sink(path, row, host, shape, pdtype):
            key = leaf_key(path, row)
            sharding = place(path, shape)
            specs[path] = [None if s is None else (list(s) if isinstance(s, tuple) else s)
                           for s in getattr(sharding, "spec", ())]
            if key in done:
                return
            want = tuple(shape if row is None else shape[1:])
            if row is not None:
                sharding = _row_sharding(sharding)
            if spans:  # each process reads and sums only its devices' slices
                arr = _placed(host, want, pdtype, sharding)  # load_weights checked the tensors' shapes
                part = sum(sum64(np.asarray(s.data), [i.start or 0 for i in s.index], want)
                           for s in arr.addressable_shards if s.replica_id == 0)
                meta = {"shape": list(want), "dtype": np.dtype(pdtype).name, "sum64_part": str(part)}
            else:
                a = np.asarray(host).astype(pdtype)
                if a.shape != want:  # load_weights checked the tensors; this guards the sink itself
                    raise PreshardError(f"{key}: converted to shape {list(a.shape)}, expected {list(want)}")
                arr = jax.make_array_from_callback(want, sharding, lambda idx: a[idx], dtype=pdtype)
                meta = {"shape": list(want), "dtype": np.dtype(pdtype).name, "sha256": digest(a),
                        "sum64": sum64_hex(sum64(a))}
            batch[key] = arr
            batch_meta[key] = meta
            # every device's copy, counted alike by every process (the same flushes everywhere)
            held[0] += (len(sharding.device_set) * int(np.prod(sharding.shard_shape(want), dtype=np.int64))
                        * np.dtype(pdtype).itemsize / procs.count)
            if held[0] >= budget // 4:
                flush()

        def record(key, a):
            h = digest(a)
            if sources.get(key, h) != h:  # same files and sizes, other contents
                name = key.partition("[")[0]
                raise PreshardError(f"{src}: tensor {name!r} differs from the one the earlier run pre-sharded "
                                    f"into {dst}; pass --overwrite to start over")
            batch_sources[key] = h
            bar.read(a.nbytes)

        def reader(name):
            if spans:
                return lambda: _Recorded(ckpt.lazy(name), name, record)

            def read():
                a = np.asarray(ckpt.lazy(name))  # the whole tensor, read once: hashed, then converted
                record(name, a)
                return a
            return read

        try:
            tensors = ((n, reader(n), ckpt.shape(n)) for n in ckpt.keys())
            # with several processes, a placement keeps routed experts unread until each device takes its slice
            load_weights(module, cfg, tensors, source=str(src), sink=sink, placement=place if spans else None)
            flush()
        finally:
            bar.close()
        source_bytes = ckpt.nbytes
        read_bytes = ckpt.bytes_read

    from .. import __version__

    manifest = {
        "format": FORMAT, "transforms_version": TRANSFORMS_VERSION, "k3serve_version": __version__,
        "config": ckpt.config, "dtype": dt.name,
        "experts": experts, "run": identity,
        "recipe": rec.describe() if rec else None, "chunk_mb": chunk_mb, "processes": procs.count,
        "source": {"files": files, "bytes": source_bytes, "tensors": dict(sorted(sources.items()))},
        "param_specs": dict(sorted(specs.items())),
        "leaves": dict(sorted(done.items())),
        "resumed_leaves": resumed,
    }
    if procs.lead:
        _copy_side_files(src, dst)
        write_json_atomic(dst / MANIFEST, manifest)
    procs.barrier("manifest")  # no process reports done before the pre-shard is complete
    return dict(manifest, this_process={"process": procs.index, "source_bytes_read": read_bytes})
