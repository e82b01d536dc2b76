"""Prefix caching on agentic traffic: the same synthetic trace replayed over gRPC against the
same checkpoint with prefix caching on and then off, in one run.

    k3serve bench prefix [--model DIR|demo] [--sessions 8] [--seed 0] [--time-scale 1.0]
                         [--prefix-unit U] [--prefix-interval N] [--json out.json]
    (= python -m k3serve.server.bench.prefix ...)

Each pass starts an in-process gRPC server (warm-up compiled before the clock starts),
replays the trace with ``server/bench.py`` (token-exact, streaming, at the trace's
timestamps) and reads the engine's own counters. Reported per pass: prompt tokens the model
computed (recomputes after preemption included) against the minimum any prefix cache must
compute for this trace (``gen_agentic_trace.min_prompt_tokens``: every distinct block once,
token-granular), TTFT and end-to-end percentiles, hit counters and the bytes of KDA snapshots
and cached pages (at the end and at peak). Ratios on/off are of the two passes of this run.
"""
from __future__ import annotations

import argparse
import sys
import time

from .report import add_trace_flags, emit, model_dir as resolve_model


def _serve_and_replay(model, trace, *, block_size: int, time_scale: float, engine_kw: dict) -> dict:
    from k3serve.server.client.replay import replay
    from k3serve.server.engine.engine import Engine
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer

    t = time.perf_counter()
    eng = Engine(model, **engine_kw)
    warm = time.perf_counter() - t
    compiles_warm = eng.stats()["num_compiles"]
    loop = EngineThread(eng)
    server = GrpcServer(Servicer(served_model_name="bench"), host="127.0.0.1", port=0)
    server.set_ready(loop)
    try:
        res = replay(f"127.0.0.1:{server.port}", trace, block_size=block_size, time_scale=time_scale,
                     progress=False, avoid_ids=[], vocab_size=model.config.vocab_size)
        st = loop.stats()
    finally:
        server.shutdown(grace_s=5)
    keep = ("prompt_tokens_computed", "tokens_computed", "num_preemptions", "num_steps", "prefix_hits",
            "prefix_hit_tokens", "prefix_kv_hit_tokens", "prefix_waits", "prefix_cow_pages", "snapshots_registered",
            "snapshots_evicted", "snapshots_held", "prefix_pages_held", "snapshot_bytes", "prefix_device_bytes",
            "prefix_bytes_peak")
    return {"warmup_s": round(warm, 1), "ok": res["ok"], "failed": res["failed"], "duration_s": round(res["duration_s"], 2),
            "ttft_ms": res["ttft_ms"], "e2e_ms": res["e2e_ms"], "prompt_tokens": res["prompt_tokens"],
            "cached_tokens_reported": res["cached_tokens"],
            "compiles_after_warmup": st["num_compiles"] - compiles_warm, **{k: st[k] for k in keep if k in st}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_flags(ap)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--prefix-unit", type=int, default=None)
    ap.add_argument("--prefix-interval", type=int, default=0)
    ap.add_argument("--json", help="also write the report to this file")
    a = ap.parse_args(argv)

    from k3serve.checkpoints import load_pretrained
    from k3serve.compile_cache import enable_compile_cache
    from k3serve.server.client.traces import generate_trace, trace_summary

    enable_compile_cache()  # the serve command's persistent XLA cache: a second run starts warm

    model_dir = resolve_model(a.model)
    model = load_pretrained(model_dir, dtype="float32")
    trace = generate_trace(a.seed, a.sessions, block_size=a.block_size, preset="tiny",
                           max_context_tokens=a.max_model_len)
    summary = trace_summary(trace, a.block_size)
    base = dict(max_num_seqs=a.max_num_seqs, chunk_size=a.chunk_size, page_size=a.page_size,
                max_model_len=a.max_model_len, max_num_batched_tokens=max(256, a.chunk_size))
    if a.num_pages:
        base["num_pages"] = a.num_pages
    report = {"model": str(model_dir), "trace": summary, "engine": base}
    passes = {}
    for name, kw in (("on", dict(enable_prefix_caching=True, prefix_unit=a.prefix_unit,
                                 prefix_interval=a.prefix_interval)),
                     ("off", dict(enable_prefix_caching=False))):
        print(f"bench prefix: pass '{name}' ({len(trace)} requests)...", file=sys.stderr, flush=True)
        passes[name] = _serve_and_replay(model, trace, block_size=a.block_size, time_scale=a.time_scale,
                                         engine_kw={**base, **kw})
    report["passes"] = passes
    mpt = summary["min_prompt_tokens"]
    on, off = passes["on"], passes["off"]
    p50 = lambda p: (p["ttft_ms"] or {}).get("p50")
    report["figures"] = {
        "min_prompt_tokens": mpt,
        "computed_over_min_on": round(on["prompt_tokens_computed"] / mpt, 3),
        "computed_over_min_off": round(off["prompt_tokens_computed"] / mpt, 3),
        "ttft_p50_ms_on": p50(on), "ttft_p50_ms_off": p50(off),
        "ttft_p50_ratio_on_over_off": round(p50(on) / p50(off), 3) if p50(on) and p50(off) else None,
        "snapshot_bytes_held_end": on.get("snapshot_bytes"), "prefix_bytes_peak": on.get("prefix_bytes_peak"),
        "compiles_after_warmup_on": on["compiles_after_warmup"], "compiles_after_warmup_off": off["compiles_after_warmup"],
    }
    return emit(report, a.json)


if __name__ == "__main__":
    sys.exit(main())
