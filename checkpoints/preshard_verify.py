"""Verify a pre-sharded checkpoint on disk: one run wrote every part, every array has the
shape, dtype and hash the manifest records, and (given the safetensors source) the source's
tensors and a short prompt's logits are the same. ``k3serve preshard verify`` runs this.

It sits beside the reader (``preshard_load.py``) rather than in it because the logits check
loads both checkpoints through ``loader.load_pretrained``, which itself uses the reader.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .loader import load_pretrained
from .preshard_format import PreshardError, digest, parse_slice_key, read_manifest, sum64, sum64_hex
from .preshard_load import _batches, _check_against_model, _check_stored, _load, _part_metadata, check_one_run
from .safetensors_io import open_checkpoint


def verify(path, source=None, *, max_memory_gb: float = 2.0, logits_prompt=(1, 2, 3, 4, 5, 6, 7, 8)) -> dict:
    """Check a pre-sharded checkpoint: every part written by one run (:func:`check_one_run`),
    every array's shape and dtype what the model holds, and its checksums the manifest's
    (``sum64``, and ``sha256`` where one process wrote it; read onto one device, a batch at a
    time). With ``source`` (the safetensors directory it came from): the hashes of the source
    tensors, or of the slices of them each process of a multi-process run read, too, and the
    logits of a short prompt from both (they must be equal). Raises :class:`PreshardError`
    naming the first array that differs; returns a summary."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from flax import nnx

    from ..model.config import K3Config
    from ..model.k3 import KimiLM
    from ..model.pretrained import resolve_dtype
    from ..model.weights import _all_params

    path = Path(path).absolute()  # Orbax takes absolute paths only
    man = read_manifest(path)
    t0 = time.perf_counter()
    parts = check_one_run(path, man)
    cfg = K3Config.from_dict(man["config"]).replace(kernels="reference")
    _check_against_model(path, man, _all_params(nnx.eval_shape(lambda: KimiLM(cfg, resolve_dtype(man["dtype"])))))
    dev = SingleDeviceSharding(jax.devices()[0])
    checked = nbytes = 0
    for part, keys, part_keys in _batches(man, sorted(man["leaves"]), int(max_memory_gb * 2**30)):
        want = {k: jax.ShapeDtypeStruct(tuple(man["leaves"][k]["shape"]), np.dtype(man["leaves"][k]["dtype"]),
                                        sharding=dev) for k in keys}
        _check_stored(path, part, _part_metadata(path, part)[0], want)
        got = _load(path, part, part_keys, want)
        for k in keys:
            a = np.asarray(got[k])
            meta = man["leaves"][k]
            if ("sha256" in meta and digest(a) != meta["sha256"]) or \
                    ("sum64" in meta and sum64_hex(sum64(a)) != meta["sum64"]):
                raise PreshardError(f"{path}: array {k!r} (part {part}) does not match its recorded hash: the "
                                    "checkpoint is corrupted")
            checked += 1
            nbytes += a.nbytes
        del got
    out = {"arrays": checked, "parts": parts, "bytes": nbytes, "seconds": round(time.perf_counter() - t0, 3)}
    if source is not None:
        recorded: dict = {}  # tensor -> [(slice (None: whole), sha256)]
        for key, h in man["source"]["tensors"].items():
            name, index = parse_slice_key(key)
            recorded.setdefault(name, []).append((index, h))
        with open_checkpoint(source) as ckpt:
            for name in ckpt.keys():
                if name not in recorded:
                    raise PreshardError(f"{source}: tensor {name!r} is not in the pre-shard's source record")
                lazy = ckpt.lazy(name)
                for index, h in recorded[name]:
                    if digest(np.asarray(lazy) if index is None else lazy[index]) != h:
                        raise PreshardError(f"{source}: tensor {name!r} differs from the one pre-sharded")
        a = load_pretrained(path, dtype=man["dtype"]).logits(list(logits_prompt))
        b = load_pretrained(source, dtype=man["dtype"]).logits(list(logits_prompt))
        gap = float(np.max(np.abs(a - b)))
        if gap != 0.0:
            raise PreshardError(f"{path}: logits differ from the source's by up to {gap:.3g}")
        out.update(source_tensors=len(man["source"]["tensors"]), logits_gap=gap)
    return out
