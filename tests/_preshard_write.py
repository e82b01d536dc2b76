"""Child-process body for ``test_preshard.py``'s multi-process pre-shard: process ``i`` of
``n`` (``jax.distributed`` on loopback, gloo), each with ``8 / n`` virtual CPU devices, writes
SRC to DST for RECIPE with ``preshard()``. With STOP_AFTER (a part name) every process stops
right after that part is committed, as an interrupted run would (exit 3). Prints one JSON
line: the process's summary (what it read of the source, the arrays it resumed).

    python _preshard_write.py SRC DST RECIPE PORT I N MAX_MEMORY_GB [STOP_AFTER]
"""
from __future__ import annotations

import json
import os
import sys

src, dst, recipe, port, pid, n, mem = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), \
    int(sys.argv[6]), float(sys.argv[7])
stop_after = sys.argv[8] if len(sys.argv) > 8 else None
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // n}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)

from k3serve.checkpoints.preshard import preshard  # noqa: E402


class Stop(Exception):
    pass


def on_part(name):
    if name == stop_after:
        raise Stop


try:
    man = preshard(src, dst, recipe=recipe, max_memory_gb=mem, on_part=on_part)
except Stop:
    print(json.dumps({"process": pid, "stopped_after": stop_after}), flush=True)
    sys.exit(3)
print(json.dumps(dict(man["this_process"], resumed=man["resumed_leaves"], arrays=len(man["leaves"]),
                      source_bytes=man["source"]["bytes"])), flush=True)
