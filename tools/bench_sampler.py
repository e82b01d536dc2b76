"""Time the batched sampler (``server.engine.sampler.sample``) alone on this machine.

    PYTHONPATH=<dir holding k3serve> python tools/bench_sampler.py --vocab 4096 163840 --top-p 0.9

Every row is a sampled request with the given settings (default temperature 0.8, top_p 0.9).
Logits: ``zipf`` (each row ``-s*log(rank)`` over a random permutation, s in [1, 1.4]: a
long-tailed next-token distribution) or ``normal`` (N(0, 9)). Prints the median ms of the
jitted call after warm-up: the automatic path, then the top-k pre-filter and the full sort
forced (the automatic one costs about the full sort whenever a row's top-p mass is not
reached within the candidates).
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from k3serve.server.engine.sampler import build_sampler_inputs, default_top_candidates, sample
from k3serve.server.engine.sampling_params import SamplingParams


def _logits(B, V, dist, rng):
    if dist == "normal":
        return (rng.standard_normal((B, V)) * 3).astype(np.float32)
    out = np.empty((B, V), np.float32)
    for b in range(B):
        out[b, rng.permutation(V)] = -(1.0 + 0.4 * rng.random()) * np.log(np.arange(1, V + 1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", nargs="+", type=int, default=[4096, 163840])
    ap.add_argument("--dist", nargs="+", default=["zipf", "normal"], choices=["zipf", "normal"])
    ap.add_argument("--candidates", nargs="+", type=int, default=[0], help="0: the default for V")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    B = args.rows
    p = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; B={B}, temperature={p.temperature}, "
          f"top_p={p.top_p}, top_k={p.top_k}, min_p={p.min_p}; median ms")
    print(f"{'V':>7} {'dist':6} {'C':>5} {'auto':>9} {'prefilter':>9} {'full':>9}")
    for V in args.vocab:
        for dist in args.dist:
            logits = _logits(B, V, dist, np.random.default_rng(0))
            inp = build_sampler_inputs([p] * B, list(range(B)), [0] * B, [[]] * B, [[]] * B, vocab_size=V)
            for C in [c or default_top_candidates(V) for c in args.candidates]:
                fns = {path: (lambda path=path: sample(logits, inp, 0, C, path)) for path in (None, "prefilter", "full")}
                for f in fns.values():
                    jax.block_until_ready(f())
                    jax.block_until_ready(f())
                ts = {k: [] for k in fns}
                for _ in range(args.runs):  # interleaved: load changes hit all paths alike
                    for k, f in fns.items():
                        t0 = time.perf_counter()
                        jax.block_until_ready(f())
                        ts[k].append(time.perf_counter() - t0)
                ms = [statistics.median(ts[k]) * 1e3 for k in fns]
                print(f"{V:7d} {dist:6} {C:5d} " + " ".join(f"{m:9.2f}" for m in ms), flush=True)


if __name__ == "__main__":
    main()
