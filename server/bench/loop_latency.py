"""Latency of the serving loop's control path while streams decode, counted in engine steps.

    python -m k3serve.server.bench.loop_latency [--model DIR] [--streams 8] [--probes 20]
    k3serve bench loop [same flags]

``--streams`` requests decode continuously on an ``EngineThread`` (each re-submitted when it
finishes; every stream has a consumer thread, as gRPC handlers do). Meanwhile a prober
submits a short request, waits for its first token, then aborts it, ``--probes`` times.
Reported, as median / p90 / max:

* ``submit_to_admitted_steps``: engine steps between the submit call and the engine taking
  the request in (``Engine.admit``, or ``add_request`` in older code);
* ``abort_to_freed_steps``: steps between the abort call and the engine applying it (pages
  and slot freed at that moment);
* the same in milliseconds, how long ``submit()`` / ``abort()`` / ``stats()`` block the
  caller, and the mean step time.

It uses only the ``EngineThread`` API that all versions share (``submit``, ``outputs``,
``RequestHandle.abort``, ``stats``) and spies on the engine's methods, so the same file
measures an older checkout too (copy it there and run it with that checkout on the path).
Default model: the demo checkpoint; compile time is kept down with ``warmup=False`` (only
the shapes used are compiled) and the usual persistent compile cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time


def _summary(xs):
    if not xs:
        return None
    s = sorted(xs)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "max": s[-1]}


def run(model_dir=None, streams: int = 8, probes: int = 20, prompt_len: int = 16, seed: int = 0,
        max_model_len: int = 256, gap_s: float = 0.05) -> dict:
    import numpy as np

    from ...demo import demo_checkpoint
    from ...compile_cache import enable_compile_cache
    from ...checkpoints import load_pretrained
    from ..api.engine_thread import EngineThread
    from ..engine.engine import Engine
    from ..engine.sampling_params import SamplingParams

    enable_compile_cache()
    path = model_dir or demo_checkpoint()
    m = load_pretrained(path)
    eng = Engine(m, max_num_seqs=streams + 2, max_num_batched_tokens=64, chunk_size=16, page_size=16,
                 max_model_len=max_model_len, warmup=False)
    rng = np.random.default_rng(seed)
    V = m.config.vocab_size
    prompt = lambda g: g.integers(0, min(V, 32000), prompt_len).tolist()

    # spies: when the engine takes a request in / applies an abort (engine steps, time)
    admitted, freed = {}, {}
    entry = "admit" if hasattr(eng, "admit") else "add_request"
    orig_entry, orig_abort = getattr(eng, entry), eng.abort

    def spy_entry(*a, **k):
        rid = orig_entry(*a, **k)
        admitted[rid] = (eng.num_steps, time.perf_counter())
        return rid

    def spy_abort(rid):
        ok = orig_abort(rid)
        if ok:
            freed[rid] = (eng.num_steps, time.perf_counter())
        return ok

    setattr(eng, entry, spy_entry)
    eng.abort = spy_abort
    loop = EngineThread(eng)
    stop = threading.Event()
    long = SamplingParams(max_new_tokens=max_model_len - prompt_len - 1, temperature=0, ignore_eos=True)

    def stream(i):
        g = np.random.default_rng(seed + 1 + i)  # one generator per thread
        try:
            while not stop.is_set():
                h = loop.submit(prompt(g), long, rid=f"s{i}-{time.monotonic_ns()}")
                for _ in h.outputs():
                    if stop.is_set():
                        h.abort()
        except Exception:  # shutting down
            return
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    # warm: every stream decoding (and the shapes compiled) before measuring
    t_end = time.monotonic() + 900
    while time.monotonic() < t_end and loop.stats()["running"] < streams:
        time.sleep(0.05)
    steps0 = eng.num_steps
    for _ in range(20):  # the first decode steps compile
        s = eng.num_steps
        while eng.num_steps == s:
            time.sleep(0.01)
    sub_steps, sub_ms, sub_block, ab_steps, ab_ms, ab_block, stats_block = [], [], [], [], [], [], []
    probe = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
    t_start, s_start = time.perf_counter(), eng.num_steps
    warm = 3  # untimed probes first: the shapes a probe adds (one more row, a prefill chunk) compile
    for k in range(warm + probes):
        if k == warm:
            for xs in (sub_steps, sub_ms, sub_block, ab_steps, ab_ms, ab_block, stats_block):
                xs.clear()
            t_start, s_start = time.perf_counter(), eng.num_steps
        time.sleep(gap_s * rng.random())
        rid = f"probe-{k}"
        s0, t0 = eng.num_steps, time.perf_counter()
        h = loop.submit(prompt(rng), probe, rid=rid)
        sub_block.append((time.perf_counter() - t0) * 1e3)
        outs = h.outputs()
        next(outs)  # running: its first token arrived
        s1, t1 = admitted[rid]
        sub_steps.append(s1 - s0)
        sub_ms.append((t1 - t0) * 1e3)
        time.sleep(gap_s * rng.random())
        s0, t0 = eng.num_steps, time.perf_counter()
        h.abort()
        ab_block.append((time.perf_counter() - t0) * 1e3)
        for _ in outs:
            pass
        s1, t1 = freed[rid]
        ab_steps.append(s1 - s0)
        ab_ms.append((t1 - t0) * 1e3)
        t0 = time.perf_counter()
        loop.stats()
        stats_block.append((time.perf_counter() - t0) * 1e3)
    wall, nsteps = time.perf_counter() - t_start, eng.num_steps - s_start
    stop.set()
    loop.drain(5)
    r = lambda xs: {k: round(v, 3) for k, v in _summary(xs).items()}
    return {"model": str(path), "streams": streams, "probes": probes, "warm_steps": steps0,
            "mean_step_ms": round(wall / max(1, nsteps) * 1e3, 2),
            "submit_to_admitted_steps": r(sub_steps), "abort_to_freed_steps": r(ab_steps),
            "submit_to_admitted_ms": r(sub_ms), "abort_to_freed_ms": r(ab_ms),
            "submit_call_blocks_ms": r(sub_block), "abort_call_blocks_ms": r(ab_block),
            "stats_call_blocks_ms": r(stats_block)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="k3serve bench loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=256)
    a = ap.parse_args(argv)
    res = run(a.model, streams=a.streams, probes=a.probes, prompt_len=a.prompt_len, max_model_len=a.max_model_len)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
