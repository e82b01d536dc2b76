"""Test helpers: golden cases and loaded models (one load per case per session)."""
from __future__ import annotations

import pathlib

import numpy as np

DATA = pathlib.Path(__file__).parent / "data"
K3_CASES = ["k3-tiny-a", "k3-tiny-b"]
# kimi-linear-tiny-dense: saved by transformers 5 (a dense layer 0 as block_sparse_moe.*_proj)
ALL_CASES = K3_CASES + ["kimi-linear-tiny", "kimi-linear-tiny-dense"]

_models: dict = {}

# XLA flags of every test process (set by conftest.py, kept by children): LLVM at -O0 on XLA:CPU.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a child process: this process's flags (``TEST_XLA_FLAGS``), without any
    virtual device count, then ``devices`` virtual CPU devices if given."""
    import os

    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def load_case(case: str, dtype: str = "float32"):
    from k3serve.checkpoints import load_pretrained

    key = (case, dtype)
    if key not in _models:
        _models[key] = load_pretrained(DATA / case, dtype=dtype)
    return _models[key]


_golden: dict = {}


def golden(case: str) -> dict:
    if case not in _golden:
        _golden[case] = dict(np.load(DATA / case / "golden.npz"))
    return _golden[case]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def prefill_padded(m, ids, bucket: int = 64, pages: int = 4, capture: bool = False):
    """``m._prefill(ids, ...)`` with the prompt padded to ``bucket`` tokens and a private pool of
    ``pages`` pages, whatever its length: ``((logits, cache[, rec]), page_table)``. Prompts of
    different lengths then share one compiled prefill program (``m.logits`` / ``m.greedy``
    compile one per power-of-two token bucket and page count, 5-10 s each on XLA:CPU)."""
    from k3serve.model import make_batch

    T = len(ids)
    assert 0 < T <= bucket, (T, bucket)
    tok = np.zeros((1, bucket), np.int32)
    tok[0, :T] = np.asarray(ids, np.int32)
    batch = make_batch(tok, [0], [T], [0], np.arange(pages, dtype=np.int32)[None])
    return m.step(m.new_cache(1, pages), batch, capture=capture), batch.page_table


def greedy_padded(m, ids, max_new_tokens: int, bucket: int = 64, pages: int = 4, return_logits: bool = False):
    """``m.greedy(ids, max_new_tokens)`` in one prefill shape (``prefill_padded``) and the decode
    step of that page table: the same ``make_batch``/``step`` calls, so every prompt with
    ``len(ids) + max_new_tokens <= pages * m.page_size`` shares one prefill and one decode
    program. Returns the new token ids (and the decode steps' logits rows)."""
    from k3serve.model import make_batch

    T = len(ids)
    assert T + max_new_tokens <= pages * m.page_size, (T, max_new_tokens, pages, m.page_size)
    (logits, cache), table = prefill_padded(m, ids, bucket, pages)
    last, out, rows = np.asarray(logits[0, T - 1], np.float32), [], []
    for pos in range(T, T + max_new_tokens):
        out.append(int(np.argmax(last)))
        if len(out) == max_new_tokens:
            break
        logits, cache = m.step(cache, make_batch([[out[-1]]], [pos], [1], [0], table))
        last = np.asarray(logits[0, 0], np.float32)
        rows.append(last)
    return (out, rows) if return_logits else out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_text_checkpoint(root) -> pathlib.Path:
    """A 4-layer K3 (vocab 4096) with the demo tokenizer: the smallest model that speaks text.

    Built once under ``root`` (about 3 s); weights are random, so text is gibberish, but every
    token id, stop and chat marker is real."""
    from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
    from k3serve.server.text.demo_tokenizer import write_demo_tokenizer

    out = pathlib.Path(root) / "k3-tiny-text"
    if (out / "tokenizer.json").is_file():
        return out
    cfg = k3_config(vocab_size=4096, hidden_size=64, num_hidden_layers=4, full_attn_layers=[4], kda_num_heads=2,
                    kda_head_dim=32, mla_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2,
                    num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    intermediate_size=128, attn_res_block_size=2)
    tmp = out.with_name(out.name + ".tmp")
    generate_checkpoint(tmp, cfg, seed=3)
    write_demo_tokenizer(tmp)
    tmp.rename(out)
    return out


def tool_path(name: str) -> str | None:
    """An executable of the running venv (its bin/ may not be on PATH), else from PATH."""
    import shutil
    import sys

    here = pathlib.Path(sys.executable).parent / name
    return str(here) if here.is_file() else shutil.which(name)


def run_to_end(engine, rids, max_steps: int = 2000, after_step=None) -> list:
    """Step ``engine`` until it has no work left; the final output of each of ``rids``, in order.
    ``after_step()``, if given, runs after every step (a check of the engine's state)."""
    done, steps = {}, 0
    while engine.has_unfinished() or engine.has_owed_outputs():
        for out in engine.step():
            if out.finished:
                done[out.rid] = out
        if after_step is not None:
            after_step()
        steps += 1
        assert steps < max_steps, f"engine still busy after {max_steps} steps"
    return [done[r] for r in rids]


def assert_all_free(engine) -> None:
    """No request holds anything, checked before the prefix cache is flushed (so a page or
    snapshot leaked into the index shows): every page is free or held once by the index and by
    nothing else, every snapshot slot is registered in the index, every request slot is free.
    Then a flush returns everything to the pools."""
    engine.check_invariants()
    mgr, plan, pc = engine.cache_mgr, engine.capacity_plan, engine.prefix_cache
    assert not engine.requests and not mgr.live_requests(), (list(engine.requests), mgr.live_requests())
    refs = pc.page_refs() if pc is not None else {}
    for p in range(plan.num_pages):
        assert mgr.pages.refcount(p) == refs.get(p, 0), \
            f"page {p}: refcount {mgr.pages.refcount(p)}, the prefix index holds {refs.get(p, 0)}"
    assert mgr.num_free_pages + len(refs) == plan.num_pages
    assert mgr.num_free_slots == plan.max_concurrent_slots  # scratch and snapshot slots apart
    if pc is not None:
        assert pc.held_snapshots() == 0, "snapshots held for requests that are gone"
        assert mgr.slots.num_snapshots_used == pc.index.num_snapshots
        assert pc.index.num_pages == len(refs)
    engine.flush_prefix_cache()
    engine.check_invariants()
    assert mgr.num_free_pages == plan.num_pages
    assert mgr.slots.num_free_snapshots == plan.snapshot_slots
    assert engine.stats()["free_slots"] == plan.max_concurrent_slots


def post_json(url: str, body: dict, stream: bool = False, timeout: float = 120):
    """POST ``body`` as JSON; the parsed answer, or with ``stream`` the list of SSE events. A 503
    from the router (a worker it briefly could not reach on a loaded machine) is retried for up
    to a minute (``k3serve.server.bench.smg_router.open_post``)."""
    import json

    from k3serve.server.bench.smg_router import open_post

    r = open_post(url, body, timeout=timeout)
    with r:
        if not stream:
            return json.loads(r.read())
        events = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
        return events


def log_tail(log, n: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-n:]


def stop_process(proc, timeout: float = 20) -> None:
    """SIGTERM ``proc`` (a ``subprocess.Popen``), then SIGKILL if it is still there after
    ``timeout`` seconds."""
    import subprocess

    if proc is None:
        return
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def wait_scheduler_healthy(stub, procs, logs=lambda i: "", timeout: float = 300, interval: float = 0.2) -> None:
    """Until the scheduler service behind ``stub`` answers HealthCheck healthy; fails at once
    when one of ``procs`` (the server's processes) has exited (``logs(i)``: what to show)."""
    import time

    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    t = time.monotonic() + timeout
    while time.monotonic() < t:
        for i, p in enumerate(procs):
            assert p.poll() is None, f"process {i} exited {p.returncode}:\n{logs(i)}"
        try:
            if stub.HealthCheck(pb.HealthCheckRequest(), timeout=2).healthy:
                return
        except grpc.RpcError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"never healthy:\n{logs(0)}")


def pd_idle(stub) -> bool:
    """A server (``SglangSchedulerStub``) runs and waits for nothing, holds no page for a
    request and has no P/D queue entry (its GetLoads)."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    ld = stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]
    d = ld.disaggregation
    return (ld.num_running_reqs == ld.num_waiting_reqs == ld.num_used_tokens == 0
            and d.prefill_prealloc_queue_reqs == d.prefill_inflight_queue_reqs == 0
            and d.decode_prealloc_queue_reqs == d.decode_transfer_queue_reqs == 0)


# smg flags for a router started before its workers (as a deployment that starts everything at
# once): it registers a worker while the worker still loads (health NOT_SERVING) and marks it
# healthy only after periodic probes see SERVING -- by default every 60 s, two in a row, so a
# worker that warmed up for 2 minutes stayed unroutable for up to 2 more (test_pd_multihost
# failed so on a loaded box: "All workers ... are unavailable"). A probe a second, one success.
ROUTER_HEALTH = ("--health-check-interval-secs", "1", "--health-success-threshold", "1")


def wait_for_router(base: str, router, log, timeout: float = 120) -> str:
    """Wait until the router at ``base`` lists a model; returns its id."""
    import json
    import time
    import urllib.request

    t = time.monotonic() + timeout
    while True:
        assert router.poll() is None, log_tail(log)
        try:
            models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=2).read())
            if models.get("data"):
                return models["data"][0]["id"]
        except OSError:
            pass
        assert time.monotonic() < t, log_tail(log)
        time.sleep(0.3)


def collect_generate(stub, req, timeout: float = 120):
    """``(chunks, complete)`` of one Generate call."""
    chunks, complete = [], None
    for r in stub.Generate(req, timeout=timeout):
        if r.HasField("chunk"):
            chunks.append(r.chunk)
        else:
            complete = r.complete
    return chunks, complete


def run_children(script: str, args: list, specs: list, devices: int, timeout: float) -> dict:
    """Run ``python script *args json(spec)`` once per spec, all at once, each with ``devices``
    virtual CPU devices, and merge the JSON dicts their last stdout lines print. Such children
    spend most of their time in XLA compiles, which are single-threaded: two of them on two
    cores take about half the time of one doing both halves."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    env = dict(os.environ)
    env["XLA_FLAGS"] = child_xla_flags(devices)
    procs = []
    try:
        for spec in specs:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill up
            procs.append((subprocess.Popen([sys.executable, script, *map(str, args), json.dumps(spec)],
                                           stdout=out, stderr=err, text=True, env=env), out, err))
        merged = {}
        for p, out, err in procs:
            rc = p.wait(timeout=timeout)
            out.seek(0), err.seek(0)
            assert rc == 0, err.read()[-4000:]
            merged.update(json.loads(out.read().strip().splitlines()[-1]))
        return merged
    finally:
        for p, out, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close(), err.close()
