"""Child-process body for ``test_preshard.py``'s multi-process restore: process ``i`` of ``n``
(``jax.distributed`` on loopback, gloo), each with ``8 / n`` virtual CPU devices, restores a
pre-sharded checkpoint into the 8-device mesh of ``recipe`` and loads the safetensors
checkpoint the same way. Every shard it holds must equal the safetensors load's, and it
reports the bytes its read syscalls returned during a second restore (``/proc/self/io``
rchar; the first one also reads the modules it imports)
next to the bytes of the shards its devices hold. Prints one JSON line.

    python _preshard_multiprocess.py SRC DST RECIPE PORT I N
"""
from __future__ import annotations

import json
import os
import sys

src, dst, recipe, port, pid, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), \
    int(sys.argv[6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // n}"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)

from k3serve.checkpoints import load_pretrained  # noqa: E402
from k3serve.server.engine.llm import recipe_placement  # noqa: E402


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


placement = recipe_placement(src, recipe)
load_pretrained(dst, placement=placement)  # once first: the modules a restore imports are read here
before = rchar()
got = load_pretrained(dst, placement=placement)
read = rchar() - before
want = load_pretrained(src, placement=placement)
a, b = jax.tree.leaves(got.params), jax.tree.leaves(want.params)
differ = 0
held = 0
for x, y in zip(a, b):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
    for sx, sy in zip(x.addressable_shards, y.addressable_shards):
        differ += int(not np.array_equal(np.asarray(sx.data), np.asarray(sy.data)))
        held += sx.data.nbytes if sx.replica_id == 0 else 0
print(json.dumps({"process": pid, "arrays": len(a), "differ": differ, "read_bytes": read, "held_bytes": held,
                  "global_bytes": got.load_stats["checkpoint_bytes"]}), flush=True)
