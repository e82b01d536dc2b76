"""Warm-up time of ``k3serve serve`` at its defaults, for demo models of several depths.

    python -m k3serve.server.bench.warmup [--layers 13,49] [--json out.json]
    k3serve bench warmup [same flags]

For each depth L a demo checkpoint of the same shape with L layers is generated (cached like
the demo), then a fresh Python process loads it and builds the engine exactly as ``k3serve
serve`` does with its default flags (prefix caching on, 4 rows, 256-token budget), without
the persistent compilation cache: ``warmup_s`` is the cold compile of every step program.
The depths run one after the other in one invocation, so their ratio is side by side. With
the layer scan (``model.layer_plan``) the traced graph is the same 3 layer bodies at every
depth, so warm-up should barely grow with L.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from .report import emit

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from k3serve.checkpoints import load_pretrained
from k3serve.server.cli import build_parser
from k3serve.server.api.engine_args import prefix_kwargs
from k3serve.server.engine.engine import Engine
args = build_parser().parse_args(["serve", "--model", sys.argv[1]])
m = load_pretrained(args.model, dtype=args.dtype)
t1 = time.perf_counter()
eng = Engine(m, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
             chunk_size=args.chunk_size, page_size=args.page_size, max_model_len=args.max_model_len,
             bucket_growth=args.bucket_growth,
             async_scheduling=not args.sync, **prefix_kwargs(args))
from k3serve.model.layer_plan import plan_layers
plan = plan_layers(m.config)
print(json.dumps({"load_s": round(t1 - t0, 2), "warmup_s": round(eng.warmup_s, 2),
                  "programs": eng.stats()["num_compiles"], "traced_layer_bodies": plan.traced_bodies}))
"""


def checkpoint_for(layers: int):
    """The demo checkpoint with ``layers`` layers (the demo itself at 13), generated once."""
    from ...checkpoints.synthetic import DEMO_SEED, default_cache_dir, demo_checkpoint_name, demo_config, generate_checkpoint
    from ...demo import demo_checkpoint

    if layers == 13:
        return demo_checkpoint()
    cfg = demo_config(layers)
    out = default_cache_dir() / demo_checkpoint_name(cfg, DEMO_SEED)
    if not (out / "config.json").is_file():
        generate_checkpoint(out, cfg, DEMO_SEED)
    return out


def run(layers: list[int]) -> dict:
    rows = []
    for L in layers:
        path = checkpoint_for(L)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"warm-up child for {L} layers failed:\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res.update(layers=L, process_s=round(time.perf_counter() - t, 2))
        rows.append(res)
    base = rows[0]["warmup_s"]
    for r in rows:
        r["warmup_ratio_to_first"] = round(r["warmup_s"] / base, 2)
    return {"serve_defaults": True, "compile_cache": False, "results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="13,49", help="comma-separated depths of the demo model")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    return emit(run([int(x) for x in a.layers.split(",")]), a.json)


if __name__ == "__main__":
    sys.exit(main())
