"""``k3serve serve`` across processes: the leader's and the followers' parts of the process.

The leader (process 0) is the usual serving process (``serve.py``) whose engine dispatches
through ``cluster.leader.LeaderDispatch``; a follower loads its shards, builds the same
engine, and runs ``cluster.follower.run_follower`` until the leader says stop. What every
process must agree on — the engine's flags and the model's weights — is checked when a
follower says hello: a follower started with other flags would build other programs and
hang the first collective, one started on another checkpoint (or another copy at the same
path) would serve wrong logits, so the leader refuses to start instead, saying which of the
two differs (the weights by ``checkpoints.fingerprint``: config, weight files and samples
of their bytes, or a pre-shard's array hashes).

Exits: SIGTERM to the leader drains, stops every follower (they answer "bye" and exit 0),
and exits 0. A lost follower fails every request with UNAVAILABLE, turns health
NOT_SERVING, and the leader exits 1 without waiting for its engine (which may be blocked in
a collective with the dead process); the other followers see the leader's channel close
and exit 1. SIGTERM to a follower ends it (exit 0) — and the leader with it (exit 1): a
deployment restarts as a whole.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

# the flags that shape the engine: every process must have the same
ENGINE_FLAGS = ("recipe", "role", "dtype", "dequantize_experts", "kernels", "max_num_seqs", "max_num_batched_tokens", "chunk_size",
                "bucket_growth", "page_size", "max_model_len", "kv_memory_gb", "num_pages", "sync",
                "no_prefix_caching", "prefix_unit", "prefix_interval", "no_prefix_second_hit",
                "no_prefix_output_end", "prefix_snapshots", "prefix_cache_gb")


def engine_digest(args, path=None) -> str:
    """What every process must share, as ``"flags=<hash> model=<hash>"``: a short hash of the
    engine-shaping flags (:data:`ENGINE_FLAGS`) and of the model's weights at ``path``
    (default ``--model``, or the embedded demo; ``checkpoints.fingerprint.model_digest``)."""
    from ...checkpoints.fingerprint import model_digest
    from ...demo import model_or_demo

    d = {k: getattr(args, k, None) for k in ENGINE_FLAGS}
    flags = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    model = model_digest(path if path is not None else model_or_demo(getattr(args, "model", None)))
    return f"flags={flags} model={model}"


def check_digest(pid: int, op: str, got, mine: str) -> None:
    """A follower's hello digest (``op``, ``got``) must equal the leader's (``mine``), else a
    ValueError that says what differs: the model (another checkpoint) or the flags."""
    if op == "digest" and got == [mine]:
        return
    if op != "digest" or len(got) != 1:
        raise ValueError(f"process {pid} sent {op!r} {str(got)[:200]} instead of its engine digest")
    theirs = dict(x.split("=", 1) for x in str(got[0]).split() if "=" in x)
    ours = dict(x.split("=", 1) for x in mine.split())
    what = []
    if theirs.get("model") != ours["model"]:
        what.append("another model (its config or weights differ from the leader's: every process must load "
                    "the same checkpoint)")
    if theirs.get("flags") != ours["flags"]:
        what.append(f"other engine flags (every process needs the same {', '.join(ENGINE_FLAGS)})")
    raise ValueError(f"process {pid} was started with {' and '.join(what)}; digest {got} != {[mine]}")


def join(args):
    """Join the deployment (``jax.distributed``) before anything asks JAX for devices."""
    from ..cluster.runtime import init_distributed

    cluster = init_distributed(args.coordinator, args.num_processes, args.process_id,
                               auto=args.distributed == "auto")
    import jax

    print(f"k3serve: process {cluster.process_id} of {cluster.num_processes}: {jax.local_device_count()} local "
          f"of {jax.device_count()} devices (coordinator {cluster.coordinator})", flush=True)
    return cluster


def leader_dispatch(args, cluster):
    """Wait for every follower's hello (with a matching engine digest); the dispatch that
    replays the engine's device calls on them."""
    from ..cluster import wire
    from ..cluster.leader import LeaderDispatch
    from ..cluster.runtime import accept_followers

    followers = accept_followers(cluster, args.control_host, secret_file=getattr(args, "cluster_secret_file", None))
    mine = engine_digest(args)
    for pid, sock in followers.items():
        op, got = wire.recv(sock)
        try:
            check_digest(pid, op, got, mine)
        except ValueError:
            for s in followers.values():
                s.close()
            raise
        sock.settimeout(None)
    print(f"k3serve: {len(followers)} follower(s) connected", flush=True)
    return LeaderDispatch(followers, timeout_s=args.heartbeat_timeout)


def on_follower_lost(dispatch, loop) -> None:
    """From now on a lost follower fails the engine thread (every open request gets
    UNAVAILABLE; health turns NOT_SERVING through ``on_error``)."""
    from .engine_thread import EngineLost

    def lost(why: str) -> None:
        loop.fail(EngineLost(f"the deployment lost a process ({why}); restart all processes"))

    def explain(e: BaseException):
        # a step that fails because a peer died (a collective's connection reset) fails
        # with the loss, which the watcher reports within moments of the same death
        deadline = time.monotonic() + 2.0
        while dispatch.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if dispatch.lost is not None:
            return EngineLost(f"the deployment lost a process ({dispatch.lost}); restart all processes")
        return None

    loop.explain_failure = explain
    dispatch.on_lost.append(lost)
    if dispatch.lost is not None:
        lost(dispatch.lost)


def stop_followers(dispatch, code: int) -> int:
    """After serving: an orderly stop (``code`` 0) tells the followers to exit and returns
    0; otherwise the process ends now with ``code`` (its engine may be stuck in a
    collective; the followers see the channel close)."""
    if code == 0 and dispatch.lost is None:
        if dispatch.stop(30.0):
            print("k3serve: every follower stopped", flush=True)
            return 0
        print(f"k3serve: followers did not all stop: {dispatch.lost or 'timeout'}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 1)


def serve_follower(args, path, cluster) -> int:
    """A follower: connect, load this process's shards, build the engine, run the leader's
    operations until it says stop."""
    from ..cluster import wire
    from ..cluster.follower import FollowerChannel, run_follower
    from ..cluster.runtime import connect_to_leader
    from .engine_args import build_engine

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))  # the leader notices and stops the deployment
    sock = connect_to_leader(cluster, secret_file=getattr(args, "cluster_secret_file", None))
    wire.send(sock, "digest", [engine_digest(args)])
    channel = FollowerChannel(sock)
    t = time.perf_counter()
    try:
        eng = build_engine(args, path)
    except BaseException as e:
        print(f"k3serve: process {cluster.process_id} failed to load {path}: {e!r}", file=sys.stderr, flush=True)
        try:
            channel.send("error", [f"loading failed: {e!r}"])
        except OSError:
            pass
        os._exit(1)
    print(f"k3serve: follower {cluster.process_id} ready in {time.perf_counter() - t:.1f}s "
          f"({eng.runner.num_compiles} programs)", flush=True)
    code = run_follower(eng, channel)
    print(f"k3serve: follower {cluster.process_id} stopped ({eng.runner.num_steps} steps)", flush=True)
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0
