"""Peak host memory of a sharded load, per process: N processes × (8 / N) virtual CPU devices.

    PYTHONPATH=<dir holding k3serve> python tools/load_memory.py --model DIR [--recipe ep=4,tp=2]
        [--processes 1,2]

For each process count, starts that many processes (``jax.distributed`` on loopback, gloo),
each loading the checkpoint straight into its shards of the recipe's 8-device mesh
(``load_pretrained(..., placement=...)``) while a thread samples ``/proc/self/status`` every
5 ms. Prints, per process: peak RSS, anonymous and file-backed RSS (before the load and
peak), the bytes of parameter shards it holds, and the checkpoint bytes it read.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time


def _status() -> dict:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) / 1024
    return d


def child(pid: int, n: int, port: int, recipe: str, model: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // n}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if n > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    jax.devices()
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.engine.llm import recipe_placement

    placement = recipe_placement(model, recipe)
    before, peak = _status(), {}

    def sample():
        while True:
            for k, v in _status().items():
                peak[k] = max(peak.get(k, 0.0), v)
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    t = time.perf_counter()
    m = load_pretrained(model, placement=placement)
    secs = time.perf_counter() - t
    time.sleep(0.05)
    held = sum(s.data.nbytes for a in jax.tree.leaves(m.params) for s in a.addressable_shards)
    st = getattr(m, "load_stats", None) or {"bytes_read": float("nan"), "checkpoint_bytes": float("nan")}  # older code
    print(json.dumps({"process": pid, "of": n, "load_s": round(secs, 2), "before_mib": before, "peak_mib": peak,
                      "shards_mib": held / 2**20, "read_mib": st["bytes_read"] / 2**20,
                      "checkpoint_mib": st["checkpoint_bytes"] / 2**20}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipe", default="ep=4,tp=2")
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        pid, n, port, recipe = a.child
        return child(int(pid), int(n), int(port), recipe, a.model)
    for n in map(int, a.processes.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--model", a.model, "--child", str(i), str(n), str(port),
                                   a.recipe], stdout=subprocess.PIPE, text=True) for i in range(n)]
        for p in procs:
            out, _ = p.communicate(timeout=600)
            r = json.loads(out.strip().splitlines()[-1])
            pk, b = r["peak_mib"], r["before_mib"]
            print(f"{n} process(es), process {r['process']}: load {r['load_s']} s, peak RSS {pk['VmRSS']:.0f} MiB "
                  f"(before {b['VmRSS']:.0f}; anon {b['RssAnon']:.0f} -> peak {pk['RssAnon']:.0f}, file "
                  f"{b['RssFile']:.0f} -> peak {pk['RssFile']:.0f}), shards held {r['shards_mib']:.0f} MiB, "
                  f"read {r['read_mib']:.0f} of {r['checkpoint_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
