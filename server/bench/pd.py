"""Prefill/decode disaggregation against one unified server, on the same agentic trace.

    k3serve bench pd [--model DIR|demo] [--sessions 8] [--seed 0] [--time-scale 1.0] [--via direct|smg]
        [--processes-per-side N --devices-per-side 4 --prefill-recipe R --decode-recipe R] [--json out.json]
    (= python -m k3serve.server.bench.pd ...)

Pass ``unified``: one in-process gRPC server. Pass ``pd``: a ``--role prefill`` and a ``--role
decode`` server in this process, and the replayer doing smg's dual dispatch (each request to
both, same ``disaggregated_params``; the decode's stream is measured). The same checkpoint, the
same engine settings and the same trace; every engine is warmed up before the clock starts.
Reported per pass: TTFT, TPOT and end-to-end percentiles; for ``pd`` also the bytes moved per
request, the pull time per handoff (decode: pull start to arrays ready) and the prefill's
staging time. All servers share this machine's cores, so on a CPU box the P/D pass shows the
protocol's cost, not the gain of separate accelerators.

``--via smg`` puts PyPI ``smg`` in front of each pass (a plain router over the unified server, a
``--pd-disaggregation`` router over the pair) and replays through its ``/generate`` route:
smg does the dual dispatch, and the times are what an smg client sees.
"""
from __future__ import annotations

import argparse
import sys
import time

from .report import add_trace_flags, emit, model_dir as resolve_model


def _server(model, engine_kw, role=None):
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer
    from k3serve.server.engine.engine import Engine
    from k3serve.server.pd.decode import DecodeSide
    from k3serve.server.pd.prefill import PrefillSide

    eng = Engine(model, **engine_kw)
    loop = EngineThread(eng)
    servicer = Servicer(served_model_name="bench")
    server = GrpcServer(servicer, host="127.0.0.1", port=0)
    side = None
    if role == "prefill":
        side = servicer.pd_prefill = PrefillSide(eng, host="127.0.0.1", bootstrap_port=0)
    elif role == "decode":
        side = servicer.pd_decode = DecodeSide(eng)
    server.set_ready(loop)
    return server, loop, side


def _figures(res) -> dict:
    return {"ok": res["ok"], "failed": res["failed"], "duration_s": round(res["duration_s"], 2),
            "ttft_ms": res["ttft_ms"], "tpot_ms": res["tpot_ms"], "e2e_ms": res["e2e_ms"],
            "output_tokens_per_s": res["output_tokens_per_s"], "error_counts": res.get("error_counts"),
            "errors": res.get("errors", [])[:3]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_trace_flags(ap)
    ap.add_argument("--via", choices=("direct", "smg"), default="direct",
                    help="replay to the servers directly (the replayer dispatches both P/D legs) or through smg")
    ap.add_argument("--processes-per-side", type=int, default=0,
                    help="0: both sides in this process, one device each; N >= 1: each side as N `k3serve serve` "
                         "processes (multi-host when N > 1) over --devices-per-side CPU devices")
    ap.add_argument("--devices-per-side", type=int, default=4)
    ap.add_argument("--prefill-recipe", default="ep=4")
    ap.add_argument("--decode-recipe", default="ep=2,tp=2,dcp=4")
    ap.add_argument("--json", help="also write the report to this file")
    a = ap.parse_args(argv)

    from k3serve.compile_cache import enable_compile_cache
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.client.replay import replay
    from k3serve.server.client.traces import generate_trace, trace_summary

    from .smg_router import router

    enable_compile_cache()
    model_dir = resolve_model(a.model)
    model = load_pretrained(model_dir, dtype="float32")
    trace = generate_trace(a.seed, a.sessions, block_size=a.block_size, preset="tiny", max_context_tokens=a.max_model_len)
    kw = dict(max_num_seqs=a.max_num_seqs, chunk_size=a.chunk_size, page_size=a.page_size, max_model_len=a.max_model_len,
              max_num_batched_tokens=max(256, a.chunk_size))
    report = {"model": str(model_dir), "trace": trace_summary(trace, a.block_size), "engine": kw, "via": a.via}
    rkw = dict(block_size=a.block_size, time_scale=a.time_scale, progress=False, avoid_ids=[],
               vocab_size=model.config.vocab_size)

    print(f"bench pd: pass 'unified' ({len(trace)} requests)...", file=sys.stderr, flush=True)
    server, loop, _ = _server(model, kw)
    try:
        if a.via == "smg":
            with router(model_dir, worker=server.port) as url:
                res = replay(f"127.0.0.1:{server.port}", trace, router_url=url, **rkw)
        else:
            res = replay(f"127.0.0.1:{server.port}", trace, **rkw)
        report["unified"] = _figures(res)
    finally:
        server.shutdown(grace_s=5)

    if a.processes_per_side:
        report["pd"] = _subprocess_pass(a, model_dir, kw, trace, rkw)
        return _finish(report, a.json)
    print(f"bench pd: pass 'pd' ({len(trace)} requests)...", file=sys.stderr, flush=True)
    pre = _server(model, kw, "prefill")
    dec = _server(model, kw, "decode")
    try:
        if a.via == "smg":
            with router(model_dir, prefill=(pre[0].port, pre[2].port), decode=dec[0].port) as url:
                t = time.perf_counter()
                res = replay(f"127.0.0.1:{dec[0].port}", trace, router_url=url, **rkw)
        else:
            t = time.perf_counter()
            res = replay(f"127.0.0.1:{dec[0].port}", trace, prefill_target=f"127.0.0.1:{pre[0].port}",
                         bootstrap_port=pre[2].port, **rkw)
        rooms, d = pre[2].rooms, dec[2]
        report["pd"] = {**_figures(res), "handoffs": d.handoffs,
                        "bytes_per_request": round(d.bytes_received / max(1, d.handoffs)),
                        "pull_ms_mean": round(1e3 * d.transfer_time_s / max(1, d.handoffs), 3),
                        "pull_gb_s": round(d.bytes_received / max(d.transfer_time_s, 1e-9) / 1e9, 3),
                        "stage_ms_mean": round(1e3 * rooms.stage_s / max(1, rooms.handoffs), 3),
                        "decode_prompt_tokens_computed": dec[1].stats()["prompt_tokens_computed"],
                        "wall_s": round(time.perf_counter() - t, 2)}
    finally:
        for server, _, side in (pre, dec):
            server.shutdown(grace_s=5)
            side.stop()
    return _finish(report, a.json)


def _finish(report: dict, json_path) -> int:
    p = lambda name, key, q: (report[name][key] or {}).get(q)  # noqa: E731
    report["figures"] = {f"{k}_{q}_ratio_pd_over_unified": round(p("pd", k, q) / p("unified", k, q), 3)
                         for k in ("ttft_ms", "tpot_ms") for q in ("p50", "p90")
                         if p("pd", k, q) and p("unified", k, q)}
    return emit(report, json_path)


def _subprocess_pass(a, model_dir, kw, trace, rkw) -> dict:
    """The pd pass with each side as ``k3serve serve`` subprocesses (``pd_sides.py``)."""
    from k3serve.server.client.replay import replay

    from .pd_sides import Side
    from .smg_router import free_port

    n, dev = a.processes_per_side, a.devices_per_side
    print(f"bench pd: pass 'pd', {n} process(es) per side, {dev} devices per side ({len(trace)} requests)...",
          file=sys.stderr, flush=True)
    flags = ["--max-num-seqs", str(kw["max_num_seqs"]), "--chunk-size", str(kw["chunk_size"]), "--page-size",
             str(kw["page_size"]), "--max-model-len", str(kw["max_model_len"]), "--max-num-batched-tokens",
             str(kw["max_num_batched_tokens"])]
    # a prefill waits for its decode's reservation as long as the trace may take: a CPU
    # multi-host decode is slow (gloo collectives every step), and the bench measures handoffs
    pre = Side(model_dir, "prefill", a.prefill_recipe, n, dev, flags + ["--pd-wait", "600"], boot=free_port())
    dec = Side(model_dir, "decode", a.decode_recipe, n, dev, flags)
    try:
        pre.wait_serving()
        dec.wait_serving()
        t = time.perf_counter()
        res = replay(f"127.0.0.1:{dec.port}", trace, prefill_target=f"127.0.0.1:{pre.port}", bootstrap_port=pre.boot,
                     **rkw)
        wall = time.perf_counter() - t
        cp, cd = pre.counters(), dec.counters()
    finally:
        pre.stop()
        dec.stop()
    h = max(1.0, cd.get("k3serve_pd_handoffs_received", 0.0))
    return {**_figures(res), "processes_per_side": n, "devices_per_side": dev, "prefill_recipe": a.prefill_recipe,
            "decode_recipe": a.decode_recipe, "handoffs": int(cd.get("k3serve_pd_handoffs_received", 0)),
            "bytes_per_request": round(cd.get("k3serve_pd_received_bytes", 0.0) / h),
            "pull_ms_mean": round(1e3 * cd.get("k3serve_pd_pull_seconds", 0.0) / h, 3),
            "stage_ms_mean": round(1e3 * cp.get("k3serve_pd_stage_seconds", 0.0)
                                   / max(1.0, cp.get("k3serve_pd_handoffs_staged", 0.0)), 3),
            "wall_s": round(wall, 2)}


if __name__ == "__main__":
    sys.exit(main())
