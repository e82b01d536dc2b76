"""Pallas kernel microbenchmarks: achieved bandwidth and FLOP rate against the chip's roofline.

    PYTHONPATH=<dir holding k3serve> python tools/bench_kernels.py [--hbm-gbps 7380] [--tflops 2307]
        [--experts 8] [--tokens 64,512] [--k 7168] [--n 3072] [--interpret]

On a TPU, times each kernel (``kernels/gmm_mxfp4.py``: the MXFP4 grouped matmul, plain and
fused gate/up, over random routing on K3-sized expert matrices; ``kernels/mla_ragged_kernel.py``:
ragged paged MLA, a decode step and a prefill step, ``--mla-*``; ``kernels/kda_decode_kernel.py``:
KDA decode rows of one layer against the state pools, ``--kda-*``) and prints, per shape, the
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
    ap.add_argument("--mla-heads", type=int, default=96, help="MLA heads on this chip (K3: 96, unsharded)")
    ap.add_argument("--mla-ctx", type=int, default=8192, help="cached tokens per MLA row")
    ap.add_argument("--mla-rows", type=int, default=32, help="decode rows in the MLA decode step")
    ap.add_argument("--mla-chunk", type=int, default=512, help="queries of the MLA prefill row")
    ap.add_argument("--mla-page", type=int, default=64, help="MLA page size (tokens)")
    ap.add_argument("--kda-heads", type=int, default=96, help="KDA heads on this chip (K3: 96, unsharded)")
    ap.add_argument("--kda-rows", default="8,64", help="decode rows per KDA decode call")
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
    from k3serve.kernels.gmm_mxfp4 import default_blocks, mxfp4_gmm
    from k3serve.kernels.moe_gmm import repack_experts

    rng = np.random.default_rng(0)
    E, K, N = a.experts, a.k, a.n
    tm = 8 if a.interpret else 128
    w = [tuple(jnp.asarray(v) for v in repack_experts(rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8),
                                                       rng.integers(120, 134, (E, N, K // 32), dtype=np.uint8)))
         for _ in range(2)]  # the stored layout the loader makes
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    print(f"{'kernel':<14} {'M':>6} {'ms':>9} {'MB':>9} {'GFLOP':>9} {'HBM %':>7} {'MXU %':>7}")
    for M in map(int, a.tokens.split(",")):
        M = -(-M // tm) * tm
        sizes = np.bincount(rng.integers(0, E, M), minlength=E).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        blocks = default_blocks(K, N, tm, weights=2)  # fits the fused call too
        touched = int((sizes > 0).sum())
        for name, fused in (("gmm", {}), ("gmm gate+up", {"up": w[1], "act": act})):
            nw = 2 if fused else 1
            fn = lambda x, s, fused=fused: mxfp4_gmm(x, *w[0], s, num_experts=E, blocks=blocks,  # noqa: E731
                                                     interpret=interpret, **fused)
            sec = _time(fn, x, jnp.asarray(sizes), reps=2 if a.interpret else 10)
            visits = -(-M // tm) + touched - 1
            weight_bytes = nw * touched * N * (K // 2 + w[0][1].shape[-1])  # each touched expert's tiles, at least once
            nbytes = weight_bytes + (N // blocks[2]) * M * K * 2 + M * N * 4
            flops = nw * 2 * M * N * K
            print(f"{name:<14} {M:>6} {sec * 1e3:>9.3f} {nbytes / 1e6:>9.1f} {flops / 1e9:>9.2f} "
                  f"{100 * nbytes / sec / (a.hbm_gbps * 1e9):>6.1f}% {100 * flops / sec / (a.tflops * 1e12):>6.1f}%"
                  f"  ({visits} visits)")
    bench_mla_ragged(a, interpret)
    bench_kda_decode(a, interpret)
    bench_kda_prefill(a, interpret)


def bench_mla_ragged(a, interpret) -> None:
    """Ragged paged MLA (``kernels/mla_ragged_kernel.py``): a decode-only step (``--mla-rows``
    rows, one query each, ``--mla-ctx`` cached tokens) and a prefill step (one row of
    ``--mla-chunk`` queries ending at ``--mla-ctx``), bf16 pool rows [latent 512 | rope 64]
    padded to 640, the pool donated so the in-kernel row write is in place. Bytes and FLOPs as
    the kernel's docstring counts them (kv pages read per decode row and per query block)."""
    from k3serve.kernels.mla_ragged_kernel import mla_ragged_attention_kernel

    if interpret is not None:
        H, Lat, Rr, W, ps, ctx, rows, chunk, blocks, dt = 2, 16, 8, 24, 4, 16, 4, 6, (2, 4, 2), jnp.float32
    else:
        H, Lat, Rr, W, ps = a.mla_heads, 512, 64, 640, a.mla_page
        ctx, rows, chunk, dt = a.mla_ctx, a.mla_rows, a.mla_chunk, jnp.bfloat16
        blocks = (8, 16, max(1, 512 // ps))
    rng = np.random.default_rng(1)
    P = -(-ctx // ps)
    n_pages = rows * P + 1
    b = jnp.dtype(dt).itemsize
    table = jnp.asarray(rng.permutation(n_pages)[: rows * P].reshape(rows, P), jnp.int32)
    pool = jnp.asarray(rng.standard_normal((2, n_pages, ps, W)), dt)
    print(f"{'kernel':<14} {'T':>6} {'ms':>9} {'MB':>9} {'GFLOP':>9} {'HBM %':>7} {'MXU %':>7}")
    for name, q in (("mla decode", [1] * rows), ("mla prefill", [chunk] + [0] * (rows - 1))):
        q = np.asarray(q, np.int32)
        T = int(q.sum())
        cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        tok_row = np.repeat(np.arange(rows), q).astype(np.int32)
        pos = np.concatenate([ctx - n + np.arange(n) for n in q]).astype(np.int32)
        kv_lens = np.where(q > 0, ctx, 0).astype(np.int32)
        args = [jnp.asarray(x) for x in (rng.standard_normal((T, H, Lat)), rng.standard_normal((T, H, Rr)),
                                         rng.standard_normal((T, W)))]
        args = [x.astype(dt) for x in args]
        meta = [jnp.asarray(x) for x in (tok_row, pos, kv_lens, cu, q)]

        def step(pool, ql, qr, new, meta=meta):
            return mla_ragged_attention_kernel(ql, qr, new, pool, 1, table, meta[0], meta[1], meta[2], meta[3],
                                               meta[4], 0.1, Lat, blocks=blocks, interpret=interpret)

        fn = jax.jit(step, donate_argnums=0)
        pool = jax.block_until_ready(fn(pool, *args))[2]
        ts = []
        for _ in range(2 if interpret is not None else 10):
            t = time.perf_counter()
            pool = jax.block_until_ready(fn(pool, *args))[2]
            ts.append(time.perf_counter() - t)
        sec = statistics.median(ts)
        if name == "mla decode":
            keys, qkeys = rows * P * ps, rows * P * ps
        else:
            QB = min(blocks[1], T)
            ends = [ctx - chunk + min((k + 1) * QB, chunk) for k in range(-(-chunk // QB))]
            keys = sum(-(-e // ps) * ps for e in ends)
            qkeys = QB * keys
        nbytes = keys * W * b + 2 * T * W * b + T * H * (Lat + Rr) * b + 2 * T * H * (Lat + 1) * 4
        flops = 2 * H * (Lat + Rr + Lat) * qkeys
        print(f"{name:<14} {T:>6} {sec * 1e3:>9.3f} {nbytes / 1e6:>9.1f} {flops / 1e9:>9.2f} "
              f"{100 * nbytes / sec / (a.hbm_gbps * 1e9):>6.1f}% {100 * flops / sec / (a.tflops * 1e12):>6.1f}%")



def bench_kda_decode(a, interpret) -> None:
    """KDA decode over batched rows (``kernels/kda_decode_kernel.py``): ``--kda-rows`` live
    rows, none fresh, each updating its own slot in place (the pools donated, so nothing copies
    them), K3's head width 128 and conv width 4, ``--kda-heads`` heads, bf16 token inputs.
    Bytes and FLOPs as the kernel's docstring counts them; the delta step runs on the vector
    unit, so only the HBM ratio is a roofline (the MXU column stays empty)."""
    from k3serve.kernels.kda_decode_kernel import kda_decode

    if interpret is not None:
        H, d, row_counts, blocks, dt = 4, 16, [4], (2, 2), jnp.float32
    else:
        H, d, row_counts, blocks, dt = a.kda_heads, 128, [int(r) for r in a.kda_rows.split(",")], (8, 8), jnp.bfloat16
    W, L = 4, 2
    P = H * d
    rng = np.random.default_rng(2)
    print(f"{'kernel':<14} {'R':>6} {'ms':>9} {'MB':>9} {'GFLOP':>9} {'HBM %':>7} {'MXU %':>7}")
    for R in row_counts:
        S = R + 1
        toks = [jnp.asarray(rng.standard_normal(shape), dt) for shape in ((R, 3 * P), (R, P), (R, H), (R, P))]
        toks[2] = jax.nn.sigmoid(toks[2])
        params = [jnp.asarray(x, jnp.float32) for x in (rng.standard_normal((3 * P, W)) * 0.3,
                                                       rng.standard_normal(H), rng.standard_normal(P), np.ones(d))]
        state = jnp.asarray(rng.standard_normal((L, S, H, d, d)) * 0.1, jnp.float32)
        conv = jnp.asarray(rng.standard_normal((L, S, W - 1, 3 * P)), jnp.float32)
        rows = jnp.arange(R, dtype=jnp.int32)
        meta = (rows, rows + 1, rows + 1, jnp.full((R,), -1, jnp.int32), jnp.zeros((R,), jnp.int32), R)

        def step(state, conv, toks=toks, params=params, meta=meta):
            return kda_decode(*toks, state, conv, 1, *meta, *params, blocks=blocks, interpret=interpret)

        fn = jax.jit(step, donate_argnums=(0, 1))
        _, state, conv = jax.block_until_ready(fn(state, conv))
        ts = []
        for _ in range(2 if interpret is not None else 10):
            t = time.perf_counter()
            _, state, conv = jax.block_until_ready(fn(state, conv))
            ts.append(time.perf_counter() - t)
        sec = statistics.median(ts)
        b = jnp.dtype(dt).itemsize
        nbytes = 4 * H * d * d * 2 * R + 4 * (W - 1) * 3 * P * 2 * R + R * (6 * P + H) * b + 4 * R * H * d
        flops = R * (7 * H * d * d + 2 * 3 * P * W + 30 * P)
        print(f"{'kda decode':<14} {R:>6} {sec * 1e3:>9.3f} {nbytes / 1e6:>9.1f} {flops / 1e9:>9.2f} "
              f"{100 * nbytes / sec / (a.hbm_gbps * 1e9):>6.1f}% {'-':>7}  (VPU: {flops / sec / 1e12:.2f} TFLOP/s)")


def bench_kda_prefill(a, interpret) -> None:
    """KDA ragged chunked prefill (``kernels/kda_prefill_kernel.py``): a step of one 2048-token
    row and a step of eight 256-token rows (starts off the 64-token grid, none fresh, each row
    updating its own slot in place with one mid-step snapshot; the pool donated), K3's head
    width 128, ``--kda-heads`` heads, bf16 token inputs, chunk 64, 8 heads per step. Bytes and
    FLOPs as the kernel's docstring counts them (f32 matmuls, so the MXU ratio is against the
    bf16 peak and understates how close to the f32 bound it runs)."""
    from k3serve.kernels.kda_prefill_kernel import kda_prefill

    if interpret is not None:
        H, d, C, blocks, dt, shapes = 2, 16, 8, (1, 4), jnp.float32, [(1, 24), (3, 8)]
    else:
        H, d, C, blocks, dt, shapes = a.kda_heads, 128, 64, (8,), jnp.bfloat16, [(1, 2048), (8, 256)]
    L = 2
    rng = np.random.default_rng(3)
    print(f"{'kernel':<14} {'T':>6} {'ms':>9} {'MB':>9} {'GFLOP':>9} {'HBM %':>7} {'MXU %':>7}")
    for R, n in shapes:
        T, S = R * n, 2 * R + 1
        q_lens = np.full(R, n, np.int32)
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        start = (np.arange(R) * 37 + 5).astype(np.int32)
        slot = np.arange(R, dtype=np.int32)
        meta = [jnp.asarray(x) for x in (np.repeat(np.arange(R), n).astype(np.int32), cu, q_lens, start, slot, slot,
                                         np.zeros(R, np.int32), slot, np.full(R, n // 2, np.int32), slot + R)]
        x = [jnp.asarray(rng.standard_normal((T, H, d)) / np.sqrt(d), dt) for _ in range(3)]
        g = jnp.asarray(-0.1 * rng.random((T, H, d)), dt)
        beta = jnp.asarray(rng.random((T, H)), dt)
        state = jnp.asarray(rng.standard_normal((L, S, H, d, d)) * 0.1, jnp.float32)

        def step(state, x=x, g=g, beta=beta, meta=meta):
            return kda_prefill(x[0], x[1], x[2], g, beta, state, 1, *meta, chunk_size=C, blocks=blocks,
                               interpret=interpret)

        fn = jax.jit(step, donate_argnums=0)
        _, state = jax.block_until_ready(fn(state))
        ts = []
        for _ in range(2 if interpret is not None else 10):
            t = time.perf_counter()
            _, state = jax.block_until_ready(fn(state))
            ts.append(time.perf_counter() - t)
        sec = statistics.median(ts)
        b = jnp.dtype(dt).itemsize
        first = np.minimum(n, C - start % C)
        n_tiles = int(np.sum(1 + -(-(n - first) // C)))
        W = min(C, T)
        nbytes = n_tiles * W * H * (4 * d + 1) * b + 2 * 4 * T * H * d + 4 * H * d * d * 3 * R
        flops = n_tiles * H * (C * C * 10 * d + 6 * C * d * d) + R * H * 2 * C * d * d
        print(f"{'kda prefill':<14} {T:>6} {sec * 1e3:>9.3f} {nbytes / 1e6:>9.1f} {flops / 1e9:>9.2f} "
              f"{100 * nbytes / sec / (a.hbm_gbps * 1e9):>6.1f}% {100 * flops / sec / (a.tflops * 1e12):>6.1f}%"
              f"  ({n_tiles} tiles)")


if __name__ == "__main__":
    main()
