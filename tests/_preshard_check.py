"""Child-process body for ``test_preshard.py`` (8 virtual CPU devices): pre-shard a tiny
synthetic K3 for recipe A and restore it under A, under B and on one device.

Per restore: every parameter bit-identical (values and dtype) to a safetensors load placed
for the same recipe, carrying the same sharding; greedy tokens of the restored model equal
those of the safetensors one. A restore under A reads the saved shards as they are (the fast
path): each restored array's sharding equals the one saved. Prints one JSON line, keyed by
``"<saved recipe> -> <restore>"``.

Under pytest (``K3SERVE_TEST_HOME`` set) the child uses the session's compile cache: the two
models of a restore run the same greedy programs (same shapes and shardings), so the second
model's are loaded instead of compiled again, as are those of a restore another child has
already compiled (``spec["restore"]`` is ordered so that the shared one comes last)."""
from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

from k3serve.checkpoints.preshard import preshard
from k3serve.checkpoints.preshard_format import read_manifest
from k3serve.checkpoints import load_pretrained
from k3serve.server.engine.llm import recipe_placement

PROMPT = [5, 17, 99, 3, 200, 41, 7]


def params_of(model) -> dict:
    from flax import nnx

    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(model.params)}


def compare(a, b) -> dict:
    pa, pb = params_of(a), params_of(b)
    assert set(pa) == set(pb), set(pa) ^ set(pb)
    differ = [k for k in pa if pa[k].get_value().dtype != pb[k].get_value().dtype
              or not np.array_equal(np.asarray(pa[k].get_value()), np.asarray(pb[k].get_value()))]
    placed = [k for k in pa if not pa[k].get_value().sharding.is_equivalent_to(pb[k].get_value().sharding, pa[k].get_value().ndim)]
    return {"params": len(pa), "differ": differ[:5], "sharding_differs": placed[:5]}


def main():
    src, root, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if os.environ.get("K3SERVE_TEST_HOME"):
        from k3serve.compile_cache import enable_compile_cache

        enable_compile_cache(os.path.join(os.environ["K3SERVE_TEST_HOME"], "jax"), min_compile_secs=1.0)
    dst = os.path.join(root, f"pre-{os.getpid()}")
    man = preshard(src, dst, recipe=spec["save"], max_memory_gb=spec.get("max_memory_gb", 4.0))
    res = {"saved_recipe": man["recipe"]["spec"], "leaves": len(man["leaves"])}
    for name in spec["restore"]:
        recipe = None if name == "one" else name
        pl = recipe_placement(src, recipe)
        got = load_pretrained(dst, placement=pl)
        want = load_pretrained(src, placement=pl)
        r = compare(got, want)
        r["tokens"] = got.greedy(PROMPT, 6)
        r["tokens_src"] = want.greedy(PROMPT, 6)
        r["bytes_read"] = got.load_stats["bytes_read"]
        r["checkpoint_bytes"] = got.load_stats["checkpoint_bytes"]
        res[f"{spec['save']} -> {name}"] = r
    for name in spec["restore"]:
        res[f"{spec['save']} -> {name}"].update(devices=len(jax.devices()), format=read_manifest(dst)["format"])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
