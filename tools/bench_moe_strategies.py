"""Time the routed-expert strategies of ``kernels.moe.expert_ffn`` on this machine.

Prints one table row per (shape, token count N): the jitted median time of each strategy
(``gather``, ``dense``, ``grouped`` = ragged_dot, ``blocked``), which one won, and which one
``choose_strategy`` picks. This is where the table in ``kernels/moe.py``'s docstring and the
rule in ``choose_strategy`` come from; rerun it on new hardware before changing either.

    PYTHONPATH=<dir holding k3serve> python tools/bench_moe_strategies.py
    ... --shapes b --tokens 32 128 --tiles 8 16 32 64   # blocked at several row tiles

Shapes: ``a`` = the 105M Kimi-Linear config (E=32, k=4, I=256, K=512, float32 weights),
``b`` = a small K3-like layer (E=64, k=8, I=128, K=256, float32), ``c`` = ``b`` with MXFP4
weights. Routing is uniform random (k distinct experts per token), activation SiLU(g)*u.
A strategy whose largest intermediate would exceed ``--max-gib`` is skipped ("-").
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3serve.kernels.moe import STRATEGIES, blocked_tile_rows, choose_strategy, expert_ffn
from k3serve.kernels.mxfp4 import quantize_mxfp4_np

SHAPES = {  # name: (E, k, I, K, mxfp4)
    "a": (32, 4, 256, 512, False),
    "b": (64, 8, 128, 256, False),
    "c": (64, 8, 128, 256, True),
}


def _weights(rng, E, I, K, mx):
    ws = {}
    for name, shape in (("w1", (E, I, K)), ("w3", (E, I, K)), ("w2", (E, K, I))):
        a = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        ws[name] = tuple(jnp.asarray(p) for p in quantize_mxfp4_np(a)) if mx else jnp.asarray(a)
    return ws


def _peak_bytes(strategy, N, k, E, I, K, tm):
    """Rough largest intermediate (float32) of a strategy, to skip runs that would not fit."""
    if strategy == "gather":
        return N * k * 3 * I * K * 4
    if strategy == "dense":
        return 3 * E * I * K * 4 + N * E * I * 4 * 3
    if strategy == "grouped":
        return 3 * E * I * K * 4 + N * k * max(I, K) * 4 * 3
    return (N * k + E * tm) * 4 * 2 + 3 * I * K * 4


def _time_all(fns, args, min_rounds=7, max_rounds=41, budget_s=2.0):
    """Median seconds per call of each jitted fn. Calls are interleaved (one call of each fn
    per round), so a load change on a shared machine hits all of them alike."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile
        jax.block_until_ready(fn(*args))  # warm-up
    ts = {c: [] for c in fns}
    t_end = time.perf_counter() + budget_s
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() < t_end):
        for c, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts[c].append(time.perf_counter() - t0)
        rounds += 1
    return {c: statistics.median(v) for c, v in ts.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument("--tiles", nargs="*", type=int, default=[],
                    help="also time blocked at these row tiles (default tile always timed)")
    ap.add_argument("--max-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    act = lambda g, u: jax.nn.silu(g) * u
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; median ms of jitted calls after warm-up")
    extra = [f"blk@{t}" for t in args.tiles]
    cols = args.strategies + extra
    print(f"{'shape':5} {'N':>5} " + " ".join(f"{c:>9}" for c in cols) + "  winner    chosen")
    for sname in args.shapes:
        E, k, I, K, mx = SHAPES[sname]
        rng = np.random.default_rng(args.seed)
        ws = _weights(rng, E, I, K, mx)
        for N in args.tokens:
            x = jnp.asarray(rng.standard_normal((N, K)).astype(np.float32))
            idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32))
            w = jnp.asarray(rng.random((N, k)).astype(np.float32))
            fns = {}
            runs = [(s, s, None) for s in args.strategies] + [(f"blk@{t}", "blocked", t) for t in args.tiles]
            for col, strat, tm in runs:
                tm_eff = tm or blocked_tile_rows(N, k, E, mx)
                if _peak_bytes(strat, N, k, E, I, K, tm_eff) > args.max_gib * 2**30:
                    continue
                fns[col] = jax.jit(lambda x, i, w, a, b, c, s=strat, t=tm: expert_ffn(
                    x, i, w, a, b, c, act, E, strategy=s, tile_rows=t))
            res = _time_all(fns, (x, idx, w, ws["w1"], ws["w2"], ws["w3"]))
            base = {c: v for c, v in res.items() if c in STRATEGIES}
            winner = min(base, key=base.get) if base else "-"
            cells = " ".join(f"{res[c] * 1e3:9.2f}" if c in res else f"{'-':>9}" for c in cols)
            chosen = choose_strategy(N, k, E, I, K, mx)
            print(f"{sname:5} {N:5d} {cells}  {winner:9} {chosen}", flush=True)


if __name__ == "__main__":
    main()
