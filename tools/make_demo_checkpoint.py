"""Write the synthetic K3 demo checkpoint and print where it is.

Why: the demo server and tests use a ~30M-parameter K3-shaped checkpoint that is generated
on first use; this CLI makes (or locates) it ahead of time, e.g. in a Docker build step.

    python tools/make_demo_checkpoint.py               # cached under $K3SERVE_CACHE
    python tools/make_demo_checkpoint.py --out DIR --seed 3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from k3serve.checkpoints.synthetic import DEMO_SEED, count_parameters, demo_config, generate_checkpoint
from k3serve.demo import demo_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/make_demo_checkpoint.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write here (default: the demo cache, reused if present)")
    ap.add_argument("--seed", type=int, default=DEMO_SEED, help=f"value seed (default {DEMO_SEED})")
    ap.add_argument("--cache-dir", type=Path, help="cache root when --out is not given (default $K3SERVE_CACHE or ~/.cache/k3serve)")
    ap.add_argument("--max-shard-bytes", type=int, help="with --out: split into shards of at most this size")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    if args.out is not None:
        path = generate_checkpoint(args.out, demo_config(), seed=args.seed, max_shard_bytes=args.max_shard_bytes)
    else:
        if args.max_shard_bytes is not None:
            ap.error("--max-shard-bytes needs --out (the cached demo is a single file)")
        path = demo_checkpoint(args.cache_dir, seed=args.seed)
    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    print(path)
    print(f"parameters: {count_parameters(demo_config()):,}  size: {size / 2**20:.1f} MiB  "
          f"time: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
