"""How XLA:CPU reads per-layer weights out of a stacked parameter inside a scan (issue #13).

    PYTHONPATH=.. python tools/bench_weight_slices.py --rows 1,8 [--layers 16 --dim 512 --ffn 4096]

A toy stack of ``layers`` two-matrix MLP layers (``[dim, ffn]`` and ``[ffn, dim]`` float32),
run four ways on the same weights, side by side:

* ``unrolled``: one array per layer, the layers unrolled (no slicing at all);
* ``scan_index``: one stacked array, ``lax.scan`` over the layer index, ``W[i]`` in the body
  (what the model's layer scan does);
* ``scan_xs``: the stacked arrays as the scan's ``xs``;
* ``scan_reduce``: ``W[i]`` fed to a multiply-and-reduce instead of a dot (a loop fusion can
  read a dynamic slice in place, a dot cannot).

Prints ms per call (median of 20) and the weight bytes read per ms. The gap between
``unrolled`` and the scans is the cost of XLA:CPU copying each layer's slice before its dot.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=4096)
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp

    L, D, N = a.layers, a.dim, a.ffn
    rng = np.random.default_rng(0)
    W1 = jnp.asarray(rng.standard_normal((L, D, N), np.float32) * 0.02)
    W2 = jnp.asarray(rng.standard_normal((L, N, D), np.float32) * 0.02)
    W1s, W2s = [W1[i] for i in range(L)], [W2[i] for i in range(L)]

    def mlp(x, w1, w2):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2)

    def mlp_reduce(x, w1, w2):
        h = jnp.tanh(jnp.sum(x[:, :, None] * w1[None], axis=1))
        return jnp.tanh(jnp.sum(h[:, :, None] * w2[None], axis=1))

    ways = {
        "unrolled": (jax.jit(lambda x, ws1, ws2: _unrolled(mlp, x, ws1, ws2)), (W1s, W2s)),
        "scan_index": (jax.jit(lambda x, w1, w2: jax.lax.scan(
            lambda c, i: (mlp(c, w1[i], w2[i]), None), x, jnp.arange(L))[0]), (W1, W2)),
        "scan_xs": (jax.jit(lambda x, w1, w2: jax.lax.scan(
            lambda c, ws: (mlp(c, *ws), None), x, (w1, w2))[0]), (W1, W2)),
        "scan_reduce": (jax.jit(lambda x, w1, w2: jax.lax.scan(
            lambda c, i: (mlp_reduce(c, w1[i], w2[i]), None), x, jnp.arange(L))[0]), (W1, W2)),
    }
    nbytes = 2 * L * D * N * 4
    for R in (int(r) for r in a.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((R, D), np.float32))
        ref = None
        for name, (fn, ws) in ways.items():
            out = fn(x, *ws).block_until_ready()
            ref = out if ref is None else ref
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                fn(x, *ws).block_until_ready()
                ts.append(time.perf_counter() - t)
            ms = float(np.median(ts)) * 1e3
            err = float(jnp.max(jnp.abs(out - ref)))
            print(f"rows {R:2d}  {name:11s} {ms:8.2f} ms  {nbytes / ms / 1e6:6.1f} GB/s  max diff {err:.1e}")


def _unrolled(mlp, x, ws1, ws2):
    for w1, w2 in zip(ws1, ws2):
        x = mlp(x, w1, w2)
    return x


if __name__ == "__main__":
    main()
