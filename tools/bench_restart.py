"""Start-up of ``k3serve serve``: from a safetensors checkpoint and from its pre-shard, cold
(empty compile cache) and then restarted (the persistent XLA cache filled by the first run).

    PYTHONPATH=<dir holding k3serve> python tools/bench_restart.py --model SRC --preshard DST
        [--recipe R] [--devices N] [--json F]

Each start runs in a fresh process with its own ``K3SERVE_CACHE`` folder (shared by the cold
start and the restart of the same checkpoint); the time to ``SERVING`` is split into the
load (the server's "loaded ... in X s" line) and the warm-up ("warm-up Y s"). The server is
stopped with SIGTERM as soon as it serves.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time


def start(model: str, cache: str, recipe: str | None, devices: int | None) -> dict:
    env = dict(os.environ, K3SERVE_CACHE=cache)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    cmd = [sys.executable, "-m", "k3serve.server.cli", "serve", "--model", model, "--port", "0",
           "--metrics-port", "-1"] + (["--recipe", recipe] if recipe else [])
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = {"model": os.path.basename(model.rstrip("/"))}
    try:
        for line in p.stdout:
            m = re.search(r"loaded \S+ in ([\d.]+)s", line)
            if m:
                out["load_s"] = float(m.group(1))
            m = re.search(r"SERVING .*warm-up ([\d.]+)s", line)
            if m:
                out["warmup_s"] = float(m.group(1))
                out["to_serving_s"] = round(time.perf_counter() - t, 2)
                break
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if "to_serving_s" not in out:
        raise SystemExit(f"{model}: the server did not reach SERVING")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="safetensors checkpoint")
    ap.add_argument("--preshard", required=True, help="its pre-shard (k3serve preshard)")
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--devices", type=int, default=None, help="virtual CPU devices")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    for path in (a.model, a.preshard):
        with tempfile.TemporaryDirectory() as cache:
            for run in ("cold", "restart"):
                r = dict(start(path, cache, a.recipe, a.devices), run=run)
                rows.append(r)
                print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"recipe": a.recipe, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
