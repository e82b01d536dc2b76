"""Decode step time by row count, and batch-1 decode against this machine's memory roofline.

    python -m k3serve.server.bench.step [--model DIR | demo] [--rows 1,8,32] [--context 128]
        [--steps 24] [--json out.json]
    k3serve bench step [same flags]

For each row count r, r greedy requests with ``--context``-token prompts are prefilled, then
``--steps`` decode steps are timed one by one with synchronous scheduling (launch, wait for
the sampled tokens): the median is the step time at r rows (host work included: planning,
packing, dispatch, output handling). All row counts run on one engine, one after the other,
so their ratios are measured side by side.

Roofline (batch 1): a decode token must read every weight it uses once — the non-expert
weights, the LM head, one embedding row and, per MoE layer, the ``k`` routed experts it is
sent to (``k / E`` of the routed weights). That byte count divided by the machine's read
bandwidth is the fastest a step can be; ``roofline_fraction`` = that time / the measured
1-row step. The bandwidth is measured here by a jitted ``sum`` over a 1 GiB float32 array
(median of 5 after one untimed run) — the same XLA CPU backend reading memory the way the
step's matmuls do.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from .report import emit, model_dir as resolve_model


def read_bandwidth(nbytes: int = 1 << 30, runs: int = 5) -> float:
    """Bytes per second a jitted reduction reads from host memory (median of ``runs``)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def active_weight_bytes(model) -> int:
    """Weight bytes one decode token reads (see the module docstring)."""
    import jax

    cfg = model.config
    total = experts = embed = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(model.params):
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        n = leaf.size * leaf.dtype.itemsize
        total += n
        if ".experts" in name.replace("/", ".") and "shared" not in name:
            experts += n
        elif "embed_tokens" in name:
            embed += n
    row = embed // cfg.vocab_size
    return int(total - experts - embed + row + experts * cfg.num_experts_per_token / cfg.num_experts)


def run(model_dir, rows: list[int], context: int, steps: int, seed: int = 0) -> dict:
    from ...checkpoints import load_pretrained
    from ..engine.engine import Engine
    from ..engine.sampling_params import SamplingParams
    from .offline import prompts_for

    m = load_pretrained(model_dir)
    eng = Engine(m, max_num_seqs=max(rows), max_num_batched_tokens=max(256, max(rows)), page_size=16,
                 max_model_len=context + steps + 32, enable_prefix_caching=False, async_scheduling=False)
    rng = np.random.default_rng(seed)
    compiles = eng.stats()["num_compiles"]
    out = []
    for r in rows:
        params = SamplingParams(max_new_tokens=steps + 2, temperature=0, ignore_eos=True)
        for p in prompts_for(rng, r, context, m.config.vocab_size):
            eng.add_request(p, params)
        while any(req.num_computed < len(req.prompt) for req in eng.requests.values()):
            eng.step()  # prefill
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        while eng.has_unfinished():
            eng.step()
        out.append({"rows": r, "step_ms": round(1e3 * statistics.median(times), 2),
                    "step_ms_p90": round(1e3 * sorted(times)[int(0.9 * (len(times) - 1))], 2)})
    base = out[0]["step_ms"]
    for o in out:
        o["ratio_to_first"] = round(o["step_ms"] / base, 2)
    wbytes = active_weight_bytes(m)
    bw = read_bandwidth()
    roof_ms = 1e3 * wbytes / bw
    one = next((o["step_ms"] for o in out if o["rows"] == 1), None)
    return {"model": str(model_dir), "context": context, "steps": steps, "warmup_s": round(eng.warmup_s, 1),
            "compiles_after_warmup": eng.stats()["num_compiles"] - compiles, "results": out,
            "active_weight_bytes_per_token": wbytes, "read_bandwidth_gb_s": round(bw / 1e9, 2),
            "roofline_step_ms": round(roof_ms, 2),
            "roofline_fraction": round(roof_ms / one, 3) if one else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    model_dir = resolve_model(a.model)
    return emit(run(model_dir, [int(r) for r in a.rows.split(",")], a.context, a.steps), a.json)


if __name__ == "__main__":
    sys.exit(main())
