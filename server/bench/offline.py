"""Offline generation throughput of the engine, optionally side by side with transformers.

    python -m k3serve.server.bench.offline [--model DIR | demo] [--concurrency 1,8,32]
        [--prompt-len 32] [--gen-len 32] [--peer-python /path/to/venv/bin/python]

For each concurrency c, c greedy requests (random prompts of equal length, ids drawn from
``numpy.random.default_rng(0).integers(2, 4000)``, eos ignored) are submitted at once and run
to completion, twice: the first run is a warm-up and is not timed (``--untimed-runs``);
throughput = generated tokens / wall time of the second.
Also reported: warm-up time (all shape buckets compiled before timing), the share of step
wall time the host is not blocked waiting for the device (``host_fraction``: planning,
input packing, dispatch, output handling), and the compile count after warm-up (must not
grow). Each concurrency is run with async scheduling (step N+1 planned and launched before
step N's results are read) and, with ``--modes async,sync``, also synchronously on the same
engine, so the gain of the overlap is a ratio measured in one run. With ``--peer-python`` (a venv with torch + transformers, never a
project dependency), the same checkpoint is run through transformers'
``KimiLinearForCausalLM.generate`` in that interpreter (tools/peer_transformers.py) in the
same invocation, and the ratio k3serve / transformers is printed per concurrency.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

from .report import emit, model_dir as resolve_model


def prompts_for(rng, c: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The workload's prompts (``../shared/bench/README.md``): ids in ``[2, 4000)``."""
    return [rng.integers(2, min(vocab, 4000), prompt_len).tolist() for _ in range(c)]


def run_k3serve(model_dir, conc, prompt_len, gen_len, seed=0, modes=("async",), untimed_runs=1, **engine_kw):
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.engine.engine import Engine
    from k3serve.server.engine.sampling_params import SamplingParams

    m = load_pretrained(model_dir)
    max_seqs = max(conc)
    eng = Engine(m, max_num_seqs=max_seqs, max_num_batched_tokens=max(256, max_seqs), page_size=16,
                 max_model_len=prompt_len + gen_len + 16, **engine_kw)
    compiles = eng.stats()["num_compiles"]
    rng = np.random.default_rng(seed)
    V = m.config.vocab_size
    results = []
    params = SamplingParams(max_new_tokens=gen_len, temperature=0, ignore_eos=True)
    for c in conc:
        prompts = prompts_for(rng, c, prompt_len, V)
        for mode in [m_ for m_ in modes for _ in range(untimed_runs)] + list(modes):
            eng.async_scheduling = mode == "async"
            eng.flush_prefix_cache()  # every run computes its prompts (the same ones) from scratch
            step0, wait0, steps0 = eng.step_s, eng.runner.wait_s, eng.num_steps
            t = time.perf_counter()
            for p in prompts:
                eng.add_request(p, params)
            n = 0
            while eng.has_unfinished():
                for o in eng.step():
                    n += len(o.new_token_ids)
            wall = time.perf_counter() - t
            step, wait = eng.step_s - step0, eng.runner.wait_s - wait0
            results.append({"concurrency": c, "mode": mode, "tokens": n, "steps": eng.num_steps - steps0,
                            "wall_s": round(wall, 3), "tok_per_s": round(n / wall, 1),
                            "host_fraction": round(1 - wait / step, 3)})
        # the untimed warm-up runs come first: keep only the last run of each mode
        keep = results[:len(results) - len(modes) * (untimed_runs + 1)] + results[len(results) - len(modes):]
        results[:] = keep
    return {"warmup_s": round(eng.warmup_s, 1), "compiles_after_warmup": eng.stats()["num_compiles"] - compiles,
            "results": results, "prompts_seed": seed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--peer-python", help="python of a venv with torch+transformers (side-by-side run)")
    ap.add_argument("--compilation-cache-dir", default=None)
    ap.add_argument("--modes", default="async", help="comma list of async,sync (same engine, same prompts)")
    ap.add_argument("--untimed-runs", type=int, default=1, help="warm-up runs of each concurrency before the timed one")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    conc = [int(c) for c in a.concurrency.split(",")]
    model_dir = resolve_model(a.model)
    report = {"model": str(model_dir), "prompt_len": a.prompt_len, "gen_len": a.gen_len}
    modes = tuple(a.modes.split(","))
    report["k3serve"] = run_k3serve(model_dir, conc, a.prompt_len, a.gen_len, modes=modes,
                                    untimed_runs=a.untimed_runs, compilation_cache_dir=a.compilation_cache_dir)
    res = report["k3serve"]["results"]
    if "async" in modes and "sync" in modes:
        tps = {(r["concurrency"], r["mode"]): r["tok_per_s"] for r in res}
        report["ratio_async_over_sync"] = {c: round(tps[c, "async"] / tps[c, "sync"], 2) for c in conc}
    if a.peer_python:
        peer = pathlib.Path(__file__).resolve().parents[2] / "tools" / "peer_transformers.py"  # a script of the source tree
        cmd = [a.peer_python, str(peer), "--model", str(model_dir), "--concurrency", a.concurrency,
               "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len), "--untimed-runs", str(a.untimed_runs)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        report["transformers"] = json.loads(out.stdout.strip().splitlines()[-1])
        ours = {r["concurrency"]: r["tok_per_s"] for r in res if r["mode"] == modes[0]}
        theirs = {r["concurrency"]: r["tok_per_s"] for r in report["transformers"]["results"]}
        report["ratio_k3serve_over_transformers"] = {c: round(ours[c] / theirs[c], 2) for c in theirs if c in ours}
    return emit(report, a.json)


if __name__ == "__main__":
    sys.exit(main())
