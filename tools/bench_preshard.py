"""Pre-shard and restore: peak RSS and time per GB, at two checkpoint sizes, against a plain
safetensors load (issue #17).

    PYTHONPATH=<dir holding k3serve> python tools/bench_preshard.py [--sizes 0.5,2] [--out DIR]
        [--recipe ep=8,tp=1] [--other ep=4,tp=2,dp=2,dcp=4] [--max-memory-gb 0.5] [--json F]

For each size, generates a synthetic K3 (``k3serve.checkpoints.synthetic``) whose layers all
have the same size (the size comes from the layer count, so a bigger checkpoint is more of the
same layers), then runs, each in a fresh process with 8 virtual CPU devices, measuring its
peak RSS (``ru_maxrss`` of the child) and wall time:

* ``preshard``: ``k3serve preshard SRC DST --recipe R --max-memory-gb G``;
* ``preshard_procs`` (``--processes N``, default 2; 0 skips it): the same pre-shard written by N
  processes of 8 / N devices each (``--coordinator``, gloo): the pair's wall time, and per
  process its peak RSS and the source bytes it read;
* ``restore``: ``load_pretrained(DST)`` into the recipe's shardings, and into ``--other``'s;
* ``safetensors``: ``load_pretrained(SRC)`` into the recipe's shardings (the plain load).

A loaded model lives in host memory on CPU, so a load's peak RSS includes the model (every
device's shards, replicas included: ``model_mib``); the pre-shard's must not grow with the
checkpoint, nor a load's peak beyond the model.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LOAD = """
import sys, time
from k3serve.checkpoints import load_pretrained
from k3serve.server.engine.llm import recipe_placement
path, recipe = sys.argv[1], sys.argv[2]
t = time.perf_counter()
m = load_pretrained(path, placement=recipe_placement(path, recipe))
print("SECONDS", time.perf_counter() - t)
import jax
print("HELD", sum(s.data.nbytes for a in jax.tree.leaves(m.params) for s in a.addressable_shards))
"""


def config_for(layers: int) -> dict:
    from k3serve.checkpoints.synthetic import k3_config

    mla = [i for i in range(4, layers + 1, 4)]  # 1-based: MLA every 4th layer, as K3
    return k3_config(vocab_size=4096, hidden_size=512, num_hidden_layers=layers, full_attn_layers=mla,
                     kda_num_heads=8, kda_head_dim=64, mla_heads=8, q_lora_rank=128, kv_lora_rank=64,
                     qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, num_experts=64,
                     num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=512,
                     routed_expert_hidden_size=512, intermediate_size=1024, attn_res_block_size=4)


def run(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; its wall time, peak RSS (MiB) and stdout."""
    import tempfile

    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:  # no pipe to fill up
        p = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        fo.seek(0), fe.seek(0)
        out, err = fo.read(), fe.read()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{err[-3000:]}")
    return {"seconds": round(time.perf_counter() - t, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "stdout": out}


def run_processes(src: Path, dst: Path, args, env: dict) -> dict:
    """``k3serve preshard`` by ``args.processes`` processes on one machine: wall time of the
    whole, and each process's peak RSS (MiB) and source bytes read."""
    import socket
    import tempfile
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = args.processes
    shutil.rmtree(dst, ignore_errors=True)
    each: list = [None] * n

    def one(i):
        cmd = [sys.executable, "-m", "k3serve.server.cli", "preshard", str(src), str(dst), "--recipe", args.recipe,
               "--max-memory-gb", str(args.max_memory_gb), "--quiet", "--json", "--coordinator",
               f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i)]
        r = run(cmd, {k: v for k, v in env.items() if k != "XLA_FLAGS"})
        each[i] = {"peak_rss_mib": r["peak_rss_mib"],
                   "source_bytes_read": json.loads(r["stdout"].strip().splitlines()[-1])["source_bytes_read"]}

    t = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if any(e is None for e in each):
        raise SystemExit("a pre-shard process failed (its error is above)")
    shutil.rmtree(dst, ignore_errors=True)
    return {"processes": n, "seconds": round(time.perf_counter() - t, 2), "each": each}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5,2", help="checkpoint sizes in GB (approximate)")
    ap.add_argument("--out", default=None, help="work folder (default: a new temporary folder)")
    ap.add_argument("--recipe", default="ep=8,tp=1")
    ap.add_argument("--other", default="ep=4,tp=2,dp=2,dcp=4")
    ap.add_argument("--max-memory-gb", type=float, default=0.5)
    ap.add_argument("--processes", type=int, default=2, help="also pre-shard with this many processes (0: no)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from k3serve.checkpoints.synthetic import generate_checkpoint

    import tempfile

    out = Path(args.out or tempfile.mkdtemp(prefix="k3serve-bench-preshard-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    probe = out / "probe"
    shutil.rmtree(probe, ignore_errors=True)
    generate_checkpoint(probe, config_for(4))
    per_layer = sum(f.stat().st_size for f in probe.glob("*.safetensors")) / 4
    shutil.rmtree(probe)
    results = []
    for size in [float(s) for s in args.sizes.split(",")]:
        layers = max(4, round(size * 1e9 / per_layer / 4) * 4)
        src, dst = out / f"src-{size}", out / f"dst-{size}"
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
        generate_checkpoint(src, config_for(layers), seed=1)
        gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        row = {"size_gb": round(gb, 3), "layers": layers}
        pre = run([sys.executable, "-m", "k3serve.server.cli", "preshard", str(src), str(dst), "--recipe", args.recipe,
                   "--max-memory-gb", str(args.max_memory_gb), "--quiet", "--json"], env)
        row["preshard"] = {k: pre[k] for k in ("seconds", "peak_rss_mib")}
        row["preshard"]["source_bytes_read"] = json.loads(pre["stdout"].strip().splitlines()[-1])["source_bytes_read"]
        if args.processes > 1:
            row["preshard_procs"] = run_processes(src, out / f"dst-{size}-procs", args, env)
        for name, path, recipe in (("restore", dst, args.recipe), ("restore_other", dst, args.other),
                                   ("safetensors", src, args.recipe)):
            r = run([sys.executable, "-c", LOAD, str(path), recipe], env)
            load_s = float(r["stdout"].split("SECONDS")[-1].split()[0])
            held = int(r["stdout"].split("HELD")[-1].split()[0]) / 2**20
            row[name] = {"seconds": r["seconds"], "load_seconds": round(load_s, 2), "peak_rss_mib": r["peak_rss_mib"],
                         "model_mib": round(held, 1), "s_per_gb": round(load_s / gb, 2)}
        row["preshard"]["s_per_gb"] = round(row["preshard"]["seconds"] / gb, 2)
        results.append(row)
        print(json.dumps(row), flush=True)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"recipe": args.recipe, "other": args.other,
                                               "max_memory_gb": args.max_memory_gb, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
