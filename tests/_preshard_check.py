"""Child-process body for ``test_preshard.py`` (8 virtual CPU devices): pre-shard a tiny
synthetic K3 for recipe A and restore it under A, under B and on one device.

Per restore: every parameter bit-identical (values and dtype) to a safetensors load placed
for the same recipe, carrying the same sharding; greedy tokens of the restored model equal
those of the safetensors one. A restore under A reads the saved shards as they are (the fast
path): each restored array's sharding equals the one saved. Prints one JSON line."""
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
        res[name] = r
    res["devices"] = len(jax.devices())
    res["format"] = read_manifest(dst)["format"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
