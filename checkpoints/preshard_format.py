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
