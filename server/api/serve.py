"""``k3serve serve``: the process around an engine — gRPC, metrics, signals, load, drain.

The model loads and warms up on a worker thread so the main thread stays in Python and
handles SIGTERM/SIGINT at once, even while XLA compiles. Once loaded, the engine thread runs
the steps and the gRPC servicer talks to it; SIGTERM drains in-flight requests for the grace
period, then stops.
"""
from __future__ import annotations

import os
import sys
import time

from ...checkpoints.synthetic import model_or_demo
from ...compile_cache import enable_compile_cache
from ..cli import prefix_kwargs
from .engine_thread import EngineThread
from .grpc_service import GrpcServer, Servicer
from .metrics import Metrics


def serve(args) -> int:
    """Serve a checkpoint over gRPC until SIGTERM/SIGINT (then drain and exit 0). With
    ``--num-processes N`` (or ``--distributed auto``), join the cluster first: process 0 goes
    on here as the leader, the others run the follower loop and bind nothing."""
    import signal
    import threading

    enable_compile_cache()
    path = model_or_demo(args.model)
    cluster = None
    if getattr(args, "num_processes", None) or getattr(args, "distributed", None):
        from .multihost import join

        cluster = join(args)
        if cluster.num_processes == 1:
            cluster = None
        elif not cluster.is_leader:
            from .multihost import serve_follower

            return serve_follower(args, path, cluster)
    metrics = Metrics()
    servicer = Servicer(model_dir=path, served_model_name=args.served_model_name or path.name, metrics=metrics)
    server = GrpcServer(servicer, host=args.host, port=args.port, api_key=args.api_key, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, max_message_bytes=args.max_message_mb << 20,
                        max_workers=args.max_concurrent_rpcs + 8)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"k3serve: gRPC on {args.host}:{server.port} (NOT_SERVING while loading {path})", flush=True)
    if args.metrics_port >= 0:
        mport = metrics.serve_http(args.metrics_host, args.metrics_port)
        print(f"k3serve: Prometheus metrics on http://{args.metrics_host}:{mport}/metrics", flush=True)
    # load + warm up on a worker thread: the main thread stays in Python, so SIGTERM/SIGINT
    # are handled at once even while XLA compiles
    box: dict = {}
    lost = threading.Event()  # multi-host: a follower was lost

    def load():
        try:
            dispatch = None
            if cluster is not None:
                from .multihost import leader_dispatch

                dispatch = leader_dispatch(args, cluster)
                box["dispatch"] = dispatch
                # while loading, a loss stops the process; once serving, on_follower_lost fails the engine
                dispatch.on_lost.append(lambda why: None if "loop" in box else (lost.set(), stop.set()))
            box["loop"] = _start_engine(args, path, metrics, dispatch)
        except BaseException as e:  # reported by the main thread
            box["error"] = e

    loader = threading.Thread(target=load, name="k3serve-load", daemon=True)
    loader.start()
    while loader.is_alive() and not stop.wait(0.2):
        pass
    if stop.is_set() and loader.is_alive():
        print("k3serve: stopped while loading", flush=True)
        server.server.stop(0)
        metrics.close()
        os._exit(1 if lost.is_set() else 0)  # the loader thread cannot be interrupted inside XLA
    if "error" in box:
        server.server.stop(0)
        metrics.close()
        print(f"k3serve: failed to load {path}: {box['error']!r}", file=sys.stderr, flush=True)
        if cluster is not None:
            os._exit(1)  # the followers see the channel close and exit too
        return 1
    loop = box["loop"]
    if cluster is not None:
        from .multihost import on_follower_lost

        on_follower_lost(box["dispatch"], loop)
    pd = None
    if not stop.is_set() and getattr(args, "role", "unified") != "unified":
        try:
            pd = attach_pd(servicer, loop.engine, args)
        except (OSError, ValueError) as e:
            print(f"k3serve: cannot serve as {args.role}: {e}", file=sys.stderr, flush=True)
            server.server.stop(0)
            loop.stop()
            metrics.close()
            return 1
    if not stop.is_set():
        server.set_ready(loop)
        st = loop.stats()
        print(f"k3serve: SERVING {path.name}: max_num_seqs {args.max_num_seqs}, KV {st['max_tokens_in_kv']} tokens "
              f"({st['max_concurrent_slots']} KDA slots), warm-up {st['warmup_s']:.1f}s, "
              f"{st['num_compiles']} programs", flush=True)
    code = run_until_stopped(server, loop, stop, args.grace_period, metrics)
    if pd is not None:
        pd.stop()
    if cluster is not None:
        from .multihost import stop_followers

        return stop_followers(box["dispatch"], code)
    return code


def attach_pd(servicer, engine, args):
    """Make the servicer a P/D prefill (bootstrap service on ``--bootstrap-port``) or decode
    server (``--role``); returns the side, to stop at exit."""
    if engine.dispatch.num_processes > 1:
        raise ValueError("P/D roles need a one-process engine for now (a --recipe over this process's devices)")
    if args.role == "prefill":
        from ..pd.prefill import PrefillSide

        side = servicer.pd_prefill = PrefillSide(engine, host=args.host, bootstrap_port=args.bootstrap_port,
                                                 wait_s=args.pd_wait, stage_s=args.pd_transfer_timeout)
        print(f"k3serve: P/D prefill: bootstrap on {args.host}:{side.port}, transfer {side.transfer.address}", flush=True)
    else:
        from ..pd.decode import DecodeSide

        side = servicer.pd_decode = DecodeSide(engine, host=args.host, transfer_s=args.pd_transfer_timeout)
        print(f"k3serve: P/D decode: transfer {side.transfer.address}", flush=True)
    return side


def run_until_stopped(server, loop, stop, grace_s: float, metrics=None) -> int:
    """Serve until ``stop`` is set (SIGTERM/SIGINT: drain for ``grace_s``, return 0) or the
    engine fails (every caller already has INTERNAL; stop at once, return 1)."""
    loop.on_error.append(lambda e: stop.set())
    if loop.error is not None:
        stop.set()
    while not stop.wait(1.0):  # a timeout keeps the main thread responsive to signals
        pass
    if loop.error is not None:
        print(f"k3serve: engine failed: {loop.error!r}", file=sys.stderr, flush=True)
        server.shutdown(0)
        if metrics is not None:
            metrics.close()
        return 1
    print("k3serve: shutting down (draining in-flight requests)", flush=True)
    aborted = server.shutdown(grace_s)
    if metrics is not None:
        metrics.close()
    print(f"k3serve: stopped ({aborted} requests aborted at the deadline)", flush=True)
    return 0


def _start_engine(args, path, metrics, dispatch=None):
    eng = build_engine(args, path, dispatch)
    loop = EngineThread(eng, on_output=metrics.observe_output)
    metrics.loop = loop
    return loop


def build_engine(args, path, dispatch=None):
    """The engine ``k3serve serve``'s flags describe (every process of a deployment builds
    the same one; ``dispatch``: the leader's, which replays device calls on the followers)."""
    from ...model import load_pretrained
    from ..engine.engine import Engine
    from ..engine.llm import recipe_placement

    # with a recipe: mesh first, then every parameter loaded straight into its shards
    t = time.perf_counter()
    m = load_pretrained(path, dtype=args.dtype, dequantize_experts=args.dequantize_experts,
                        placement=recipe_placement(path, args.recipe), kernels=getattr(args, "kernels", None))
    st = m.load_stats
    print(f"k3serve: loaded {path.name} in {time.perf_counter() - t:.1f}s: read {st['bytes_read']} of "
          f"{st['checkpoint_bytes']} checkpoint bytes ({100 * st['bytes_read'] / max(1, st['checkpoint_bytes']):.0f}%), "
          f"peak RSS {_peak_rss_mib():.0f} MiB", flush=True)
    detok = None
    try:
        from ..text.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
        if tok is not None:
            detok = lambda: tok.detokenizer(keep_text=False)  # stop strings: one per request
    except ImportError:
        pass
    kv = dict(kv_memory_bytes=int(args.kv_memory_gb * (1 << 30))) if args.kv_memory_gb else (
        dict(num_pages=args.num_pages) if args.num_pages else {})
    eng = Engine(m, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 chunk_size=args.chunk_size, page_size=args.page_size, max_model_len=args.max_model_len,
                 bucket_growth=args.bucket_growth,
                 detokenizer=detok, async_scheduling=not args.sync, recipe=args.recipe,
                 dispatch=dispatch, pd_role=getattr(args, "role", None), **prefix_kwargs(args), **kv)
    return eng


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
