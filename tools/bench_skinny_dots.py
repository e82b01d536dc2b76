"""How fast XLA:CPU multiplies a few rows by a weight matrix (issue #13): the linears of a
decode step at 1, 8 and 32 rows.

    PYTHONPATH=.. python tools/bench_skinny_dots.py [--rows 1,8,32] [--dim 512] [--count 16]
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= PYTHONPATH=.. python tools/bench_skinny_dots.py

One jitted program of ``count`` independent ``[rows, dim] x [dim, dim]`` float32 products
(the model's ``...i,oi->...o`` linear), summed. Prints ms per call (median of 30) and the
weight bytes read per ms. At one row the weights stream at memory speed; the gap at 8 rows is
the kernel's, not the bytes'. The second command turns XLA:CPU's YNNPACK dot fusion off (the
Eigen fallback) for comparison.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--count", type=int, default=16)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.random((args.dim, args.dim), np.float32)) for _ in range(args.count)]
    f = jax.jit(lambda x, *ws: sum(jnp.einsum("...i,oi->...o", x, w) for w in ws))
    nbytes = args.count * args.dim * args.dim * 4
    print(f"jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {args.count} x [{args.dim}, "
          f"{args.dim}] float32 ({nbytes / 1e6:.1f} MB)")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.ones((rows, args.dim), jnp.float32)
        f(x, *ws).block_until_ready()
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            f(x, *ws).block_until_ready()
            ts.append(time.perf_counter() - t)
        ms = float(np.median(ts)) * 1e3
        print(f"rows {rows:>3}: {ms:7.2f} ms  {nbytes / ms / 1e6:6.1f} GB/s of weights")


if __name__ == "__main__":
    main()
