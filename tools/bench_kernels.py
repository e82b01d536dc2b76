"""Pallas kernel microbenchmarks: achieved bandwidth and FLOP rate against the chip's roofline.

    PYTHONPATH=<dir holding k3serve> python tools/bench_kernels.py [--hbm-gbps 7380] [--tflops 2307]
        [--experts 8] [--tokens 64,512] [--k 7168] [--n 3072] [--interpret]

On a TPU, times each kernel (``kernels/gmm_mxfp4.py``: the MXFP4 grouped matmul, plain and
fused gate/up) over random routing on K3-sized expert matrices and prints, per shape, the
median time, the bytes it must move from HBM and the FLOPs (as its docstring counts them),
and achieved ÷ roofline for each (the larger ratio is the bound that matters). The default
peaks are TPU v7's announced per-chip figures (7.37 TB/s HBM; 4.6 PFLOP/s FP8, so about 2.3
for bf16): pass your chip's. Elsewhere it prints why it
skips and exits 0, unless ``--interpret`` asks for the interpreter on tiny shapes (a check
that the tool runs, not a measurement).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hbm-gbps", type=float, default=7380.0, help="HBM bandwidth per chip, GB/s")
    ap.add_argument("--tflops", type=float, default=2307.0, help="peak bf16 TFLOP/s per chip")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", default="64,512", help="rows (token, expert pairs) per call")
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--interpret", action="store_true", help="tiny shapes through the interpreter (any backend)")
    a = ap.parse_args()
    interpret = None
    if a.interpret:
        from jax.experimental.pallas import tpu as pltpu

        interpret, a.k, a.n, a.tokens, a.experts = pltpu.InterpretParams(), 128, 128, "16", 2
    elif jax.default_backend() != "tpu":
        print(f"skipped: Pallas TPU kernels need a TPU (this backend is {jax.default_backend()}); "
              "--interpret runs tiny shapes through the interpreter")
        return
    from k3serve.kernels.gmm_mxfp4 import default_blocks, mxfp4_gmm, repack_halves, tile_k

    rng = np.random.default_rng(0)
    E, K, N = a.experts, a.k, a.n
    tm = 8 if a.interpret else 128
    w = [(jnp.asarray(repack_halves(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8),
                                    tile_k(K))),
          jnp.asarray(rng.integers(120, 134, (E, N, K // 32), dtype=np.uint8))) for _ in range(2)]
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    print(f"{'kernel':<14} {'M':>6} {'ms':>9} {'MB':>9} {'GFLOP':>9} {'HBM %':>7} {'MXU %':>7}")
    for M in map(int, a.tokens.split(",")):
        M = -(-M // tm) * tm
        sizes = np.bincount(rng.integers(0, E, M), minlength=E).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        blocks = default_blocks(K, N, tm)
        touched = int((sizes > 0).sum())
        for name, fused in (("gmm", {}), ("gmm gate+up", {"up": w[1], "act": act})):
            nw = 2 if fused else 1
            fn = lambda x, s, fused=fused: mxfp4_gmm(x, *w[0], s, num_experts=E, blocks=blocks,  # noqa: E731
                                                     interpret=interpret, **fused)
            sec = _time(fn, x, jnp.asarray(sizes), reps=2 if a.interpret else 10)
            visits = -(-M // tm) + touched - 1
            weight_bytes = nw * touched * N * K * (0.5 + 1 / 32)  # each touched expert's tiles, at least once
            nbytes = weight_bytes + (N // blocks[2]) * M * K * 2 + M * N * 4
            flops = nw * 2 * M * N * K
            print(f"{name:<14} {M:>6} {sec * 1e3:>9.3f} {nbytes / 1e6:>9.1f} {flops / 1e9:>9.2f} "
                  f"{100 * nbytes / sec / (a.hbm_gbps * 1e9):>6.1f}% {100 * flops / sec / (a.tflops * 1e12):>6.1f}%"
                  f"  ({visits} visits)")


if __name__ == "__main__":
    main()
