"""Child-process body for ``test_roofline.py`` (8 virtual CPU devices): load a synthetic K3
straight into each recipe's shards and report the parameter bytes every device holds next
to the planner's ``weights_per_device`` for the same recipe. Prints one JSON line."""
from __future__ import annotations

import json
import sys

import jax

from k3serve.checkpoints.config_of import checkpoint_config
from k3serve.checkpoints import load_pretrained
from k3serve.model import K3Config
from k3serve.server.engine.llm import recipe_placement
from k3serve.sharding.memory import param_inventory, weights_per_device
from k3serve.sharding.recipe import Recipe


def main():
    src, spec = sys.argv[1], json.loads(sys.argv[2])
    cfg = K3Config.from_dict(checkpoint_config(src))
    inv = param_inventory(cfg, "float32")
    out = {}
    for text in spec["recipes"]:
        m = load_pretrained(src, placement=recipe_placement(src, text))
        per_device = {d.id: 0 for d in jax.devices()}
        for a in jax.tree.leaves(m.params):
            for s in a.addressable_shards:
                per_device[s.device.id] += s.data.nbytes
        out[text] = {"held": sorted(set(per_device.values())), "plan": weights_per_device(inv, Recipe.parse(text))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
