"""What names a checkpoint's weights, read cheaply: the processes of a multi-host deployment
compare it at start-up (``server/api/multihost.py``), so that a follower started on another
checkpoint, or on another copy at the same path, is refused instead of serving wrong logits.

Reading 1.5 TB to hash it at every start is not affordable, so a fingerprint holds what can
be read in milliseconds and still tells checkpoints apart:

- a safetensors checkpoint: ``config.json`` (parsed, so formatting does not count), every
  weight file's name and size, its header (tensor names, dtypes, shapes, offsets) and the
  sha256 of three 64 KiB samples of its data (start, middle, end), which differ between two
  trainings of the same architecture;
- a pre-shard (``k3serve preshard``): its config, dtype and every stored array's shape,
  dtype and checksum (``sum64``, which neither the recipe nor the number of processes that
  wrote it changes; ``sha256`` for a pre-shard of an older k3serve), as its manifest records
  them (not the recipe or the part numbers: a copy laid out for another recipe holds the same
  weights);
- the embedded demo: it is a safetensors checkpoint in the cache like any other.

Two copies of one checkpoint at different paths have equal fingerprints.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SAMPLE_BYTES = 64 * 1024


def _safetensors_file(f: Path) -> dict:
    size = f.stat().st_size
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = fh.read(min(n, size - 8))
        start = 8 + n
        h = hashlib.sha256()
        for at in sorted({start, start + (size - start) // 2, max(start, size - SAMPLE_BYTES)}):
            h.update(os.pread(fh.fileno(), SAMPLE_BYTES, at))
    return {"name": f.name, "bytes": size, "header_sha256": hashlib.sha256(header).hexdigest(),
            "samples_sha256": h.hexdigest()}


def _config(path: Path):
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        return {"unreadable": f"{type(err).__name__}"}


def model_fingerprint(path) -> dict:
    """A description of the weights at ``path`` (a safetensors checkpoint folder or file, or a
    pre-shard) that differs when the weights do; see the module docstring for what it reads."""
    from .preshard_format import MANIFEST, PreshardError, is_preshard, read_manifest

    p = Path(path)
    if is_preshard(p):
        try:
            man = read_manifest(p)
        except PreshardError as err:  # the load will refuse it; name it all the same
            return {"kind": "preshard", "error": str(err).replace(str(p), "DST"),
                    "manifest": (p / MANIFEST).is_file()}
        return {"kind": "preshard", "config": man["config"], "dtype": man["dtype"],
                "leaves": {k: [v.get("sum64", v.get("sha256")), v["dtype"], v["shape"]]
                           for k, v in sorted(man["leaves"].items())}}
    root = p.parent if p.is_file() else p
    files = [p] if p.is_file() else sorted(f for f in root.glob("*.safetensors") if f.is_file())
    return {"kind": "safetensors", "config": _config(root), "files": [_safetensors_file(f) for f in files]}


def model_digest(path) -> str:
    """A short hash of :func:`model_fingerprint`."""
    return hashlib.sha256(json.dumps(model_fingerprint(path), sort_keys=True).encode()).hexdigest()[:16]
