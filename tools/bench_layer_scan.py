"""The layer scan against an unrolled stack, side by side: compile time and step time.

    PYTHONPATH=<dir holding k3serve> python tools/bench_layer_scan.py --model DIR [--rows 1] [--tokens 1]

Runs the jitted ``KimiModel`` step twice: as the scan over layers (``model.layer_plan``) and
unrolled (``KimiLM.step(..., unroll=True)``: the same layer code, one traced body per layer),
each on ``--rows`` rows of ``--tokens`` tokens at position 100, timing the first call (which
compiles) and the median of 20 after it. Same weights, so the logits must agree; the largest
difference is printed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3serve.checkpoints import load_pretrained
from k3serve.model.cache import make_batch
from k3serve.model.layer_plan import plan_layers


def measure(m, rows: int, tokens: int, unrolled: bool, steps: int = 20) -> dict:
    cache = m.new_cache(rows + 1, 32 * rows)
    table = np.arange(32 * rows, dtype=np.int32).reshape(rows, 32)
    ids = np.arange(rows * tokens, dtype=np.int32).reshape(rows, tokens) % m.config.vocab_size
    b = make_batch(ids, [100] * rows, [tokens] * rows, list(range(rows)), table)
    at = jnp.full((rows,), tokens - 1, jnp.int32)
    f = jax.jit(lambda p, c, b: nnx.merge(m.graphdef, p)(b, c, logits_at=at, unroll=unrolled), donate_argnums=(1,))
    t = time.perf_counter()
    logits, cache = f(m.params, cache, b)
    logits.block_until_ready()
    first = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out, cache = f(m.params, cache, b)
        out.block_until_ready()
        times.append(time.perf_counter() - t)
    return {"compile_and_first_s": round(first, 2), "step_ms": round(1e3 * statistics.median(times), 2),
            "logits": np.asarray(logits)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1)
    a = ap.parse_args(argv)
    m = load_pretrained(a.model)
    res = {}
    for name, unrolled in (("scan", False), ("unrolled", True)):
        res[name] = measure(m, a.rows, a.tokens, unrolled)
        jax.clear_caches()
    diff = float(np.max(np.abs(res["scan"]["logits"] - res["unrolled"]["logits"])))
    plan = plan_layers(m.config)
    print(f"plan: attention types {plan.attn_types}, FFN types (MoE?) {plan.ffn_types} -> {plan.traced_bodies} "
          f"traced sublayer bodies (unrolled: {plan.num_layers} layers)")
    for name in ("scan", "unrolled"):
        r = res[name]
        print(f"{name:9s} compile+first {r['compile_and_first_s']:7.2f} s   step {r['step_ms']:8.2f} ms")
    print(f"max |logits(scan) - logits(unrolled)| = {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
