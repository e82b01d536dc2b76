"""Reading a pre-sharded checkpoint (``preshard_format.py``): restore straight into a
model's parameter shardings (``preshard_verify.py`` checks what is on disk).

A restore asks Orbax for each array with the sharding the serving recipe gives it
(``placement``), so each device receives only its slice, and a process only reads what its
devices hold. Under the recipe the checkpoint was written for, the chunks read are the
saved shards; under another one Orbax reads the chunks that cover each new shard
(``chunk_mb`` at save time bounds what is read beyond it). Arrays are read a batch at a
time (``max_memory_gb``), stack rows written into their stack in place, so the host holds the
model plus one batch.

Nothing is cast on the way: every array's dtype and shape, as the manifest records it, must
be what the model holds (Orbax would convert a bfloat16 array into a float32 parameter
without a word); ``preshard_verify.verify`` also checks what each part stores, and refuses a pre-shard whose parts
were written by different runs (``preshard_format.run_identity``).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .preshard_format import PARTS, PreshardError, identity_diff, nest, read_manifest, split_key, unnest


def release_freed_memory() -> None:
    """Hand the memory freed since the last call back to the OS (glibc ``malloc_trim``).
    Orbax's reader threads each allocate from their own malloc arena, and glibc keeps what
    they free: without this a restore's RSS grows by far more than a batch. A no-op where
    there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _by_part(manifest: dict, keys) -> dict:
    """``{part: [keys stored in it]}``."""
    out: dict = {}
    for k in keys:
        out.setdefault(manifest["leaves"][k]["part"], []).append(k)
    return out


def _batches(manifest: dict, keys, budget: int):
    """``(part, [keys], [every key of the part])`` groups of at most ``budget`` bytes (one
    array at least), by part."""
    wanted, stored = _by_part(manifest, keys), _by_part(manifest, manifest["leaves"])
    for part in sorted(wanted):
        cur, size = [], 0
        for k in wanted[part]:
            meta = manifest["leaves"][k]
            n = int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
            if cur and size + n > budget:
                yield part, cur, stored[part]
                cur, size = [], 0
            cur.append(k)
            size += n
        if cur:
            yield part, cur, stored[part]


def _load(path: Path, part: str, part_keys: list, wanted: dict) -> dict:
    """Load ``wanted`` ({key: ShapeDtypeStruct}) from one part, whose arrays are
    ``part_keys``; the others are skipped. A read that fails is retried array by array so the
    error names the array."""
    import orbax.checkpoint as ocp

    where = path / PARTS / part

    def read(keys):
        tree = nest({k: wanted[k] if k in keys else ocp.v1.PLACEHOLDER for k in part_keys})
        return unnest(ocp.v1.load_pytree(where, tree), keys)

    try:
        return read(set(wanted))
    except Exception as err:  # noqa: BLE001 - find the array, then say what it was
        first = err
    for k in sorted(wanted):
        try:
            read({k})
        except Exception as err:  # noqa: BLE001
            raise PreshardError(f"{path}: array {k!r} (part {part}) cannot be read: "
                                f"{type(err).__name__}: {str(err)[:300]}") from None
    raise PreshardError(f"{path}: part {part} cannot be read: {type(first).__name__}: {str(first)[:300]}")


def _check_against_model(path: Path, man: dict, params: dict) -> tuple[dict, bool]:
    """Every stored array must be one the model holds, of its shape and dtype (a stack row:
    the stack's shape without the layer axis). Returns ``({param path: stored rows}, tied)``
    (``tied``: ``lm_head`` is the embedding and not stored)."""
    stored: dict = {}
    for k in man["leaves"]:
        p, row = split_key(k)
        stored.setdefault(p, set()).add(row)
    tied = "lm_head.weight" in params and "lm_head.weight" not in stored
    want = set(params) - ({"lm_head.weight"} if tied else set())
    missing, extra = sorted(want - set(stored)), sorted(set(stored) - want)
    if missing or extra:
        raise PreshardError(f"{path}: arrays do not match the model: missing {missing[:8]}, unexpected {extra[:8]}")
    for p, rows in stored.items():
        value = params[p].get_value()
        shape, dtype = tuple(value.shape), np.dtype(value.dtype)
        if rows != {None} and rows != set(range(shape[0])):
            raise PreshardError(f"{path}: {p} has rows {sorted(rows)[:8]}..., the model stacks {shape[0]}")
        for row in sorted(rows, key=lambda r: -1 if r is None else r):
            k = p if row is None else f"{p}/row_{row:03d}"
            _check_array(path, f"array {k!r}", man["leaves"][k], shape if row is None else shape[1:], dtype,
                         man.get("dtype"))
    return stored, tied


def _check_array(path: Path, what: str, got: dict, shape, dtype, stored_as=None) -> None:
    """``got`` ({"shape", "dtype"}) is ``shape`` and ``dtype``, or a :class:`PreshardError`."""
    if tuple(got["shape"]) != tuple(shape):
        raise PreshardError(f"{path}: {what} has shape {list(got['shape'])}, the model expects {list(shape)}")
    if np.dtype(got["dtype"]) != np.dtype(dtype):
        whole = stored_as and np.dtype(stored_as) != np.dtype(dtype) and np.dtype(got["dtype"]) == np.dtype(stored_as)
        hint = (f"; this pre-shard is {stored_as}: load it with dtype {stored_as} (serve --dtype {stored_as})"
                if whole else "; pre-shard the checkpoint again")
        raise PreshardError(f"{path}: {what} is stored as {np.dtype(got['dtype']).name}, the model expects "
                            f"{np.dtype(dtype).name}{hint}")


def _part_metadata(path: Path, part: str):
    """(the arrays Orbax stored in ``part``, as a nested dict of ArrayMetadata; the part's
    custom metadata)."""
    import orbax.checkpoint as ocp

    m = ocp.v1.pytree_metadata(path / PARTS / part)
    return m.metadata, (m.custom_metadata or {})


def _check_stored(path: Path, part: str, stored_tree, want: dict) -> None:
    """What ``part`` really holds (Orbax's own metadata, not the manifest) is what ``want``
    ({key: ShapeDtypeStruct}) asks for: a part rewritten in another dtype is refused."""
    for k, meta in unnest(stored_tree, sorted(want)).items():
        _check_array(path, f"array {k!r} (part {part})", {"shape": meta.shape, "dtype": meta.dtype},
                     want[k].shape, want[k].dtype)


def restore_into(module, path, placement=None, *, max_memory_gb: float = 0.5) -> dict:
    """Fill the (abstract) NNX ``module``'s parameters from the pre-sharded checkpoint at
    ``path``; ``placement(param_path, shape) -> Sharding`` as for ``load_pretrained`` (None:
    the default device). Every array must be stored in the shape and dtype the module holds
    (nothing is cast). Returns load statistics."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from ..model.weights import _all_params, _row_sharding, _set_row, _zeros

    path = Path(path).absolute()  # Orbax takes absolute paths only
    t0 = time.perf_counter()
    man = read_manifest(path)
    params = _all_params(module)
    stored, tied = _check_against_model(path, man, params)
    default = SingleDeviceSharding(jax.devices()[0])
    shardings, abstract = {}, {}
    for p, rows in stored.items():
        var = params[p]
        shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
        sharding = (placement(p, shape) if placement is not None else None) or default
        shardings[p] = sharding
        for row in rows:
            k = p if row is None else f"{p}/row_{row:03d}"
            abstract[k] = jax.ShapeDtypeStruct(shape if row is None else shape[1:], dtype,
                                               sharding=sharding if row is None else _row_sharding(sharding))
        if rows != {None}:
            var.set_value(_zeros(shape, dtype, sharding))
    nbytes = 0
    # the manifest's dtype and shape of every leaf were checked against the model above; what the
    # parts themselves store is ``preshard_verify``'s check: reading every part's Orbax metadata
    # here cost 1.2 ms per array on local disk and turned a process's share of a small
    # pre-shard's reads from 0.74 to 0.92 of the whole (test_two_processes_restore_...)
    for part, keys, part_keys in _batches(man, sorted(abstract), int(max_memory_gb * 2**30)):
        want = {k: abstract[k] for k in keys}
        got = _load(path, part, part_keys, want)
        for k in keys:
            p, row = split_key(k)
            arr = got[k]
            nbytes += sum(s.data.nbytes for s in arr.addressable_shards if s.replica_id == 0)
            var = params[p]
            var.set_value(arr if row is None else _set_row(var.get_value(), arr, np.int32(row)))
        del got, arr
        release_freed_memory()
    if tied:
        emb = params["embed_tokens"].get_value()
        sharding = (placement("lm_head.weight", tuple(emb.shape)) if placement is not None else None) or default
        params["lm_head.weight"].set_value(emb if emb.sharding == sharding else jax.device_put(emb, sharding))
    total = sum(int(np.prod(m["shape"], dtype=np.int64)) * np.dtype(m["dtype"]).itemsize for m in man["leaves"].values())
    return {"bytes_read": nbytes, "checkpoint_bytes": total, "seconds": time.perf_counter() - t0, "manifest": man}


def check_one_run(path, man: dict) -> int:
    """Every part was written by the run the manifest records (``run``), or, for a pre-shard
    of an older k3serve without one, all parts by the same run; else a
    :class:`PreshardError` naming the part and what differs. Returns the number of parts."""
    path = Path(path)
    parts = sorted({m["part"] for m in man["leaves"].values()})
    ref, ref_name = man.get("run"), "the manifest"
    for i, part in enumerate(parts):
        run = _part_metadata(path, part)[1].get("run")
        if i == 0 and "run" not in man:
            ref, ref_name = run, f"part {part}"
            continue
        diff = identity_diff(run, ref, labels=(f"part {part}", ref_name))
        if diff:
            raise PreshardError(f"{path}: a mixed pre-shard: part {part} was written by another run than "
                                f"{ref_name} ({diff}); pre-shard the checkpoint again")
    return len(parts)
