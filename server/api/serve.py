"""``k3serve serve``: the process around an engine — gRPC, metrics, signals, load, drain.

The gRPC server starts first: health NOT_SERVING, ``GetModelInfo`` / ``GetServerInfo``
answered from config.json and the flags (a router started beside it registers it from them),
everything else UNAVAILABLE. The model loads and warms up on a worker thread so the main
thread stays in Python and handles SIGTERM/SIGINT at once, even while XLA compiles. Once
loaded, the engine thread runs the steps and the gRPC servicer talks to it; SIGTERM drains
in-flight requests for the grace period, then stops.
"""
from __future__ import annotations

import os
import sys

from ...demo import model_or_demo
from ...compile_cache import enable_compile_cache
from .auth import ADMIN_KEY_ENV, API_KEY_ENV, load_key
from .engine_args import build_engine, pd_handoff_bytes
from .engine_thread import EngineThread
from .grpc_service import GrpcServer, Servicer
from .metrics import Metrics
from .worker_info import EnginePlan


def serve(args) -> int:
    """Serve a checkpoint over gRPC until SIGTERM/SIGINT (then drain and exit 0). With
    ``--num-processes N`` (or ``--distributed auto``), join the cluster first: process 0 goes
    on here as the leader, the others run the follower loop and bind nothing."""
    import signal
    import threading

    enable_compile_cache()
    # before anything is loaded or joined, by every process alike (the same flags): an open
    # bootstrap service off loopback, an unreadable secret
    pd_secret = _pd_secret(args)
    if isinstance(pd_secret, int):
        return pd_secret
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
    try:  # what a router reads at registration, known before the load (worker_info.py); the keys
        plan = EnginePlan.from_serve_args(args, num_processes=cluster.num_processes if cluster is not None else 1)
        api_key = load_key(args.api_key, getattr(args, "api_key_file", None), API_KEY_ENV)
        admin_key = load_key(None, getattr(args, "admin_key_file", None), ADMIN_KEY_ENV)
    except ValueError as e:
        print(f"k3serve: {e}", file=sys.stderr, flush=True)
        return 1
    servicer = Servicer(model_dir=path, served_model_name=args.served_model_name or path.name, metrics=metrics,
                        plan=plan, role=getattr(args, "role", "unified"),
                        bootstrap_port=getattr(args, "bootstrap_port", None))
    server = GrpcServer(servicer, host=args.host, port=args.port, api_key=api_key, admin_key=admin_key,
                        tls_cert=args.tls_cert,
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
            pd = metrics.pd = attach_pd(servicer, loop.engine, args, secret=pd_secret)
        except (OSError, ValueError) as e:
            print(f"k3serve: cannot serve as {args.role}: {e}", file=sys.stderr, flush=True)
            server.server.stop(0)
            metrics.close()
            if cluster is not None:  # the followers see the channel close and exit 1 too
                sys.stdout.flush()
                os._exit(1)
            loop.stop()
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


def _pd_secret(args):
    """The cluster secret for the P/D bootstrap (None: none given), or an exit status when the
    server must not start: an unreadable secret, or a prefill whose bootstrap service would
    bind a non-loopback address without one, or a wildcard ``--transfer-host``."""
    if getattr(args, "role", "unified") == "unified":
        return None
    from ..pd.auth import check_bind
    from ..pd.transfer import transfer_host
    from ..shared_secret import SecretError, load_secret

    try:
        secret = load_secret(getattr(args, "cluster_secret_file", None))
        if args.role == "prefill":
            check_bind(args.host, secret)
        transfer_host(args.host, getattr(args, "transfer_host", None), toward="127.0.0.1")
    except (SecretError, ValueError) as e:
        print(f"k3serve: cannot serve as {args.role}: {e}", file=sys.stderr, flush=True)
        return 2
    return secret


def attach_pd(servicer, engine, args, secret: bytes | None = None):
    """Make the servicer a P/D prefill (bootstrap service on ``--bootstrap-port``) or decode
    server (``--role``); returns the side, to stop at exit."""
    handoff = pd_handoff_bytes(args) or None
    from ..pd.budget import bound_warning
    from ..pd.transfer import transfer_host

    xfer = transfer_host(args.host, getattr(args, "transfer_host", None))

    why = bound_warning(engine, handoff)
    if why is not None:
        print(f"k3serve: warning: {why}", file=sys.stderr, flush=True)
    if args.role == "prefill":
        from ..pd.prefill import PrefillSide

        side = servicer.pd_prefill = PrefillSide(engine, host=args.host, bootstrap_port=args.bootstrap_port,
                                                 wait_s=args.pd_wait, stage_s=args.pd_transfer_timeout,
                                                 secret=secret, handoff_bytes=handoff, transfer_host=xfer)
        print(f"k3serve: P/D prefill: bootstrap on {args.host}:{side.port}, transfer {side.transfer.address}", flush=True)
    else:
        from ..pd.decode import DecodeSide

        side = servicer.pd_decode = DecodeSide(engine, host=args.host, transfer_s=args.pd_transfer_timeout,
                                               secret=secret, handoff_bytes=handoff, transfer_host=xfer)
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
