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
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .preshard_load import release_freed_memory
from .preshard_format import (FORMAT, MANIFEST, PARTS, TRANSFORMS_VERSION, PreshardError, digest, identity_diff,
                              is_preshard, leaf_key, nest, run_identity, write_json_atomic)

DEFAULT_CHUNK_MB = 32  # storage chunks: a restore on another recipe reads these, not whole saved shards


def _orbax_context(chunk_bytes: int, inflight_bytes: int):
    import orbax.checkpoint as ocp

    o = ocp.v1.options
    saving = o.ArrayOptions.Saving(storage_options=o.ArrayOptions.Saving.StorageOptions(chunk_byte_size=chunk_bytes),
                                   use_compression=False)
    return ocp.v1.Context(array_options=o.ArrayOptions(saving=saving),
                          memory_options=o.MemoryOptions(write_concurrent_bytes=inflight_bytes,
                                                         transfer_concurrent_bytes=inflight_bytes))


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse, before anything is written or removed, a ``dst`` that holds the source, that
    is not a pre-shard and not empty, or that is a complete pre-shard (without ``overwrite``);
    with ``overwrite``, remove a pre-shard (and only that)."""
    s, d = src.resolve(), dst.resolve()
    if s == d or d in s.parents:
        raise PreshardError(f"{dst}: holds the source {src}; choose a destination outside it (nothing was touched)")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise PreshardError(f"{dst}: exists and is not a folder (nothing was touched)")
    if not is_preshard(dst):
        if any(dst.iterdir()):
            raise PreshardError(f"{dst}: exists and is not a pre-sharded checkpoint; choose an empty or new folder "
                                "(nothing in it was touched; --overwrite replaces only a pre-shard)")
        return
    if (dst / MANIFEST).exists() and not overwrite:
        raise PreshardError(f"{dst}: a complete pre-sharded checkpoint is already there (pass --overwrite "
                            "to replace it)")
    if overwrite:
        shutil.rmtree(dst)


def _committed_parts(parts_dir: Path, identity: dict) -> tuple[dict, dict, int]:
    """Leaves and source hashes of the parts an earlier run committed, which must have been
    written by a run of the same ``identity`` (else :class:`PreshardError`, naming what
    differs, and nothing is removed); then removes anything else (an interrupted part's
    temporary folder). Returns (leaves, sources, next part number)."""
    import orbax.checkpoint as ocp

    leaves: dict = {}
    sources: dict = {}
    nxt = 0
    if not parts_dir.is_dir():
        return leaves, sources, nxt
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
    for p in entries:
        if p in committed:
            continue
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return leaves, sources, nxt


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
    string or :class:`Recipe`; None: one device). Returns the manifest. ``on_part(name)`` is
    called after each part is committed (tests interrupt a run there)."""
    import jax
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from ..model.config import K3Config
    from ..model.k3 import KimiLM
    from ..model.pretrained import resolve_dtype
    from ..model.weights import _row_sharding, load_weights
    from ..sharding.mesh import build_mesh, placement_for
    from ..sharding.recipe import Recipe
    from .safetensors_io import open_checkpoint
    import orbax.checkpoint as ocp

    src, dst = Path(src), Path(dst)
    _check_destination(src, dst, overwrite)
    dt = resolve_dtype(dtype)
    with open_checkpoint(src) as ckpt:
        cfg = K3Config.from_dict(ckpt.config).replace(kernels="reference")
        rec = Recipe.parse(recipe).validate(cfg) if recipe is not None else None
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
        done, sources, number = _committed_parts(parts_dir, identity)
        parts_dir.mkdir(parents=True, exist_ok=True)
        resumed = len(done)
        budget = int(max_memory_gb * 2**30)
        bar = _Progress(ckpt.nbytes, progress)
        batch: dict = {}
        batch_meta: dict = {}
        batch_sources: dict = {}
        held = [0]
        specs: dict = {}

        def flush():
            nonlocal number
            if not batch:
                return
            name = f"{number:05d}"
            with _orbax_context(chunk_mb * 2**20, max(budget // 4, 1 << 20)):
                ocp.v1.save_pytree(parts_dir / name, nest(batch), custom_metadata={
                    "format": FORMAT, "run": identity, "leaves": batch_meta, "sources": batch_sources})
            for k, v in batch_meta.items():
                done[k] = dict(v, part=name)
            sources.update(batch_sources)
            bar.part(name, len(batch), held[0])
            batch.clear(), batch_meta.clear(), batch_sources.clear()
            release_freed_memory()
            held[0] = 0
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
            want = shape if row is None else shape[1:]
            a = np.asarray(host).astype(pdtype)
            if a.shape != tuple(want):  # load_weights checked the tensors; this guards the sink itself
                raise PreshardError(f"{key}: converted to shape {list(a.shape)}, expected {list(want)}")
            if row is not None:
                sharding = _row_sharding(sharding)
            arr = jax.make_array_from_callback(tuple(want), sharding, lambda idx: a[idx], dtype=pdtype)
            batch[key] = arr
            batch_meta[key] = {"shape": list(want), "dtype": np.dtype(pdtype).name, "sha256": digest(a)}
            held[0] += sum(s.data.nbytes for s in arr.addressable_shards)
            if held[0] >= budget // 4:
                flush()

        def reader(name):
            def read():
                a = np.asarray(ckpt.lazy(name))  # the whole tensor, read once: hashed, then converted
                h = digest(a)
                if sources.get(name, h) != h:  # same files and sizes, other contents
                    raise PreshardError(f"{src}: tensor {name!r} differs from the one the earlier run pre-sharded "
                                        f"into {dst}; pass --overwrite to start over")
                batch_sources[name] = h
                bar.read(a.nbytes)
                return a
            return read

        try:
            tensors = ((n, reader(n), ckpt.shape(n)) for n in ckpt.keys())
            load_weights(module, cfg, tensors, source=str(src), sink=sink)
            flush()
        finally:
            bar.close()
        source_bytes = ckpt.nbytes

    _copy_side_files(src, dst)
    from .. import __version__

    manifest = {
        "format": FORMAT, "transforms_version": TRANSFORMS_VERSION, "k3serve_version": __version__,
        "config": ckpt.config, "dtype": dt.name,
        "experts": experts, "run": identity,
        "recipe": rec.describe() if rec else None, "chunk_mb": chunk_mb,
        "source": {"files": files, "bytes": source_bytes, "tensors": dict(sorted(sources.items()))},
        "param_specs": dict(sorted(specs.items())),
        "leaves": dict(sorted(done.items())),
        "resumed_leaves": resumed,
    }
    write_json_atomic(dst / MANIFEST, manifest)
    return manifest
