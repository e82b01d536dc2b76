"""Token-exact gRPC replayer of Mooncake-format traces against an ``SglangScheduler`` server.

    python -m k3serve.server.client.replay --server HOST:PORT --trace trace.jsonl [--concurrency N | --time-scale X]
    (also wired as ``k3serve bench --server ... --trace ...``)

Every trace row becomes one streaming ``Generate`` call whose ``tokenized.input_ids`` are the
concatenation of one pseudo-random block of ``block_size`` token ids per ``hash_id`` (the
same hash id always gives the same tokens; the last block is cut to ``input_length``), with
``sampling_params{max_new_tokens=output_length, ignore_eos=true}`` (temperature left at the
proto default 0 = greedy) and ``stream=true``. Shared hash prefixes therefore exercise the
server's prefix cache exactly as the trace intends, with no tokenizer involved.

Requests are sent at the trace timestamps (relative to the first row, multiplied by
``time_scale``; a request whose time has passed is sent at once) or, with ``concurrency=N``,
back to back with at most N in flight (timestamps ignored).

Read from the server's stream: ``GenerateResponse.chunk`` (``token_ids`` incremental;
``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens`` cumulative) and the final
``GenerateResponse.complete`` (counts; ``finish_reason``). A stream that ends without a
``complete`` is counted as failed (``INCOMPLETE``); a gRPC error status is counted as failed
with its code; failures never stop the run.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import sys
import threading
import time
import uuid
from typing import Iterable

import numpy as np

try:  # the generated stubs are a project dependency; import lazily-friendly for --help
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
except ImportError:  # pragma: no cover
    grpc = pb = pb_grpc = None

from .traces import read_jsonl, row_blocks

DEFAULT_TOKEN_CAP = 32768
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


# ----------------------------------------------------------------------------------- tokens

def _hash_key(h) -> int:
    if isinstance(h, (int, np.integer)) and not isinstance(h, bool):
        return int(h) & ((1 << 63) - 1)
    return int.from_bytes(hashlib.blake2b(repr(h).encode(), digest_size=8).digest(), "little") >> 1


class TokenBlocks:
    """Deterministic token ids per hash id.

    Ids are drawn from ``[0, min(vocab_size, token_cap))`` minus ``avoid_ids``. The block of a
    hash depends only on (seed, hash id) except for its first token: blocks that follow the
    same preceding block (siblings in the prefix tree) are given distinct first tokens, in
    order of first use, so two different blocks never extend a common prefix by accident and
    a token-granular prefix cache sees exactly the sharing the hash ids describe (as long as
    the pool has more ids than a block has siblings)."""

    def __init__(self, vocab_size: int, block_size: int, *, seed: int = 0, avoid_ids: Iterable[int] = (),
                 token_cap: int | None = DEFAULT_TOKEN_CAP):
        hi = int(vocab_size) if token_cap is None else min(int(vocab_size), int(token_cap))
        pool = np.arange(max(hi, 0), dtype=np.int32)
        avoid = np.array(sorted({int(a) for a in avoid_ids if 0 <= int(a) < hi}), dtype=np.int32)
        if avoid.size:
            pool = np.setdiff1d(pool, avoid)
        if pool.size == 0:
            raise ValueError(f"no token ids left to draw from (vocab_size={vocab_size}, token_cap={token_cap})")
        self.pool = pool
        self.block_size = int(block_size)
        self.seed = int(seed)
        self._blocks: dict = {}
        self._first: dict = {}  # hash -> first token (after sibling de-collision)
        self._children_first: dict = {}  # parent hash (None = start) -> set of first tokens used

    def _raw(self, h) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _hash_key(h)])
        return self.pool[rng.integers(0, self.pool.size, self.block_size)]

    def block(self, h, parent=None) -> np.ndarray:
        """The full block of ``block_size`` ids for hash ``h`` (``parent``: the hash before it)."""
        blk = self._blocks.get(h)
        if blk is None:
            blk = self._raw(h)
            used = self._children_first.setdefault(parent, set())
            if self.pool.size > len(used):
                idx = int(np.searchsorted(self.pool, blk[0]))
                while int(self.pool[idx]) in used:
                    idx = (idx + 1) % self.pool.size
                blk[0] = self.pool[idx]
            self._blocks[h] = blk
        used = self._children_first.setdefault(parent, set())
        used.add(int(blk[0]))
        return blk

    def input_ids(self, row: dict) -> list[int]:
        parts, parent = [], None
        for h, n in row_blocks(row, self.block_size):
            parts.append(self.block(h, parent)[:n])
            parent = h
        if not parts:
            return []
        return np.concatenate(parts).tolist()


# ---------------------------------------------------------------------------------- metrics

def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``None`` for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values) -> dict:
    vals = [v for v in values if v is not None]
    return {"n": len(vals), "mean": (sum(vals) / len(vals)) if vals else None,
            "p50": percentile(vals, 50), "p90": percentile(vals, 90), "p99": percentile(vals, 99),
            "max": max(vals) if vals else None}


class RequestStats:
    """Per-request accounting from the response stream (times in seconds, perf_counter)."""

    def __init__(self, index: int, request_id: str, input_len: int, output_length: int):
        self.index = index
        self.request_id = request_id
        self.input_len = input_len
        self.output_length = output_length
        self.t_scheduled = None
        self.t_send = None
        self.t_first = None
        self.t_last_tok = None
        self.t_end = None
        self.tokens = 0
        self.itls: list[float] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason = None
        self.complete = False
        self.error: dict | None = None

    def on_response(self, resp, now: float) -> None:
        kind = resp.WhichOneof("response")
        if kind == "chunk":
            c = resp.chunk
            k = len(c.token_ids)
            if k:
                if self.t_first is None:
                    self.t_first = now
                else:
                    gap = (now - self.t_last_tok) / k
                    self.itls.extend([gap] * k)
                self.t_last_tok = now
                self.tokens += k
            self._counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        elif kind == "complete":
            c = resp.complete
            if self.tokens == 0 and len(c.output_ids):  # a server that only sends the final message
                self.t_first = self.t_last_tok = now
                self.tokens = len(c.output_ids)
            self._counts(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
            self.finish_reason = c.finish_reason
            self.complete = True
            self.t_end = now

    def on_event(self, obj: dict, now: float) -> None:
        """One event of a router's ``/generate`` stream (``router_http.py``): counters are
        cumulative, so new tokens are the growth of ``completion_tokens``."""
        meta = obj.get("meta_info") or {}
        k = int(meta.get("completion_tokens", 0)) - self.tokens
        if k > 0:
            if self.t_first is None:
                self.t_first = now
            else:
                self.itls.extend([(now - self.t_last_tok) / k] * k)
            self.t_last_tok = now
            self.tokens += k
        self._counts(meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0), meta.get("cached_tokens", 0))
        if meta.get("finish_reason"):
            fr = meta["finish_reason"]
            self.finish_reason = fr.get("type") if isinstance(fr, dict) else fr
            self.complete = True
            self.t_end = now

    def _counts(self, prompt, completion, cached):
        # cumulative counters: keep the largest seen (robust to a final message leaving one at 0)
        self.prompt_tokens = max(self.prompt_tokens, int(prompt))
        self.completion_tokens = max(self.completion_tokens, int(completion))
        self.cached_tokens = max(self.cached_tokens, int(cached))

    @property
    def ok(self) -> bool:
        return self.error is None

    def record(self) -> dict:
        ms = lambda a, b: None if a is None or b is None else (a - b) * 1e3  # noqa: E731
        comp = self.completion_tokens or self.tokens
        ttft = ms(self.t_first, self.t_send)
        e2e = ms(self.t_end, self.t_send)
        tpot = (e2e - ttft) / (comp - 1) if (ttft is not None and e2e is not None and comp > 1) else None
        return {"index": self.index, "request_id": self.request_id, "ok": self.ok,
                "input_len": self.input_len, "output_length": self.output_length,
                "prompt_tokens": self.prompt_tokens or self.input_len, "completion_tokens": comp,
                "received_tokens": self.tokens, "cached_tokens": self.cached_tokens,
                "ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": e2e,
                "send_lag_ms": ms(self.t_send, self.t_scheduled), "finish_reason": self.finish_reason,
                "error": self.error}


# ----------------------------------------------------------------------------------- replay

class _Progress:
    def __init__(self, total: int, enabled: bool, stream=None):
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.last_line = 0.0

    def show(self, done: int, ok: int, failed: int, in_flight: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not self.tty and not final and now - self.last_line < 5.0:
            return
        self.last_line = now
        width = 30
        frac = done / self.total if self.total else 1.0
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (f"[{bar}] {done}/{self.total} ok={ok} failed={failed} in_flight={in_flight} "
                f"{now - self.t0:6.1f}s")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _metadata(api_key):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


async def _model_info(stub, api_key, timeout_s):
    return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=_metadata(api_key))


async def _wait_healthy(stub, api_key, wait_s: float) -> None:
    """Poll ``HealthCheck`` until ``healthy`` (a server that does not implement it counts as ready)."""
    deadline = time.perf_counter() + wait_s
    msg = ""
    while True:
        try:
            r = await stub.HealthCheck(pb.HealthCheckRequest(), timeout=5.0, metadata=_metadata(api_key))
            if r.healthy:
                return
            msg = r.message
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            msg = e.details() or e.code().name
        if time.perf_counter() >= deadline:
            raise ConnectionError(f"server not ready after {wait_s:g} s: {msg}")
        await asyncio.sleep(0.5)


def _build_request(request_id: str, input_ids: list[int], output_length: int):
    sp = pb.SamplingParams(max_new_tokens=int(output_length), ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=input_ids),
                              sampling_params=sp, stream=True)


async def replay_async(target: str, trace: list[dict], *, block_size: int = 512, concurrency: int | None = None,
                       time_scale: float = 1.0, vocab_size: int | None = None, seed: int = 0,
                       timeout_s: float = 600.0, progress: bool = True, api_key: str | None = None,
                       avoid_ids: Iterable[int] | None = None, token_cap: int | None = DEFAULT_TOKEN_CAP,
                       connect_timeout_s: float = 30.0, wait_ready_s: float = 0.0,
                       request_id_prefix: str | None = None, progress_stream=None,
                       prefill_target: str | None = None, bootstrap_port: int = 8998,
                       router_url: str | None = None) -> dict:
    """See :func:`replay`."""
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if time_scale < 0:
        raise ValueError("time_scale must be >= 0")
    for r in trace:  # fail before sending anything if a row is malformed
        row_blocks(r, block_size)
    prefix = request_id_prefix or f"bench-{uuid.uuid4().hex[:8]}"
    md = _metadata(api_key)
    async with grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectionError(f"no gRPC server reachable at {target} within {connect_timeout_s:g} s") from None
        stub = pb_grpc.SglangSchedulerStub(channel)
        pstub = pchannel = None
        if prefill_target is not None:  # P/D: smg's dual dispatch, the decode leg measured
            pchannel = grpc.aio.insecure_channel(prefill_target, options=_CHANNEL_OPTIONS)
            pstub = pb_grpc.SglangSchedulerStub(pchannel)
        if wait_ready_s > 0:
            await _wait_healthy(stub, api_key, wait_ready_s)
        model = None
        if vocab_size is None:
            info = await _model_info(stub, api_key, min(timeout_s, 60.0))
            vocab_size = int(info.vocab_size)
            model = info.served_model_name or info.model_path or None
            if avoid_ids is None:
                avoid_ids = set(info.eos_token_ids) | {x for x in (info.bos_token_id,) if x > 0}
            if vocab_size <= 0:
                raise ValueError("the server reported vocab_size 0; pass vocab_size explicitly")
        blocks = TokenBlocks(vocab_size, block_size, seed=seed, avoid_ids=avoid_ids or (), token_cap=token_cap)

        n = len(trace)
        if concurrency is None:
            ts = [float(r.get("timestamp", 0)) for r in trace]
            t_min = min(ts) if ts else 0.0
            order = sorted(range(n), key=lambda i: (ts[i], i))
        else:
            order = list(range(n))
        stats: list[RequestStats | None] = [None] * n
        state = {"in_flight": 0, "max_in_flight": 0, "done": 0, "ok": 0, "failed": 0}
        bar = _Progress(n, progress, progress_stream)
        sem = asyncio.Semaphore(concurrency) if concurrency is not None else None
        pool = None
        if router_url is not None:  # one blocking HTTP stream per request in flight
            from concurrent.futures import ThreadPoolExecutor

            from .router_http import served_model

            pool = ThreadPoolExecutor(max_workers=concurrency or 256, thread_name_prefix="replay-http")
            router_model = await asyncio.get_running_loop().run_in_executor(pool, served_model, router_url)

        def begin() -> None:
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])

        def end(st: RequestStats) -> None:
            if st.t_end is None:
                st.t_end = time.perf_counter()
            state["in_flight"] -= 1
            state["done"] += 1
            state["ok" if st.error is None else "failed"] += 1
            if sem is not None:
                sem.release()

        async def run_http(st: RequestStats, ids, output_length):
            from .router_http import RouterError, stream_generate

            begin()
            try:
                st.t_send = time.perf_counter()
                await asyncio.get_running_loop().run_in_executor(
                    pool, stream_generate, router_url, router_model, st.request_id, ids, output_length, timeout_s,
                    st.on_event)
                if not st.complete:
                    st.error = {"code": "INCOMPLETE", "message": "stream ended without a finish reason"}
            except RouterError as e:
                st.error = {"code": e.code, "message": str(e)}
            except Exception as e:  # a client-side bug must not stop the run
                st.error = {"code": "CLIENT_ERROR", "message": f"{type(e).__name__}: {e}"}
            finally:
                end(st)

        async def run_one(st: RequestStats, req):
            begin()
            prefill_leg = None
            try:
                st.t_send = time.perf_counter()
                if pstub is not None:
                    req.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
                        bootstrap_host=prefill_target.rsplit(":", 1)[0], bootstrap_port=bootstrap_port,
                        bootstrap_room=random.getrandbits(31)))
                    prefill_leg = asyncio.create_task(_drain(pstub.Generate(req, timeout=timeout_s, metadata=md)))
                call = stub.Generate(req, timeout=timeout_s, metadata=md)
                async for resp in call:
                    st.on_response(resp, time.perf_counter())
                if prefill_leg is not None:
                    await prefill_leg
                if not st.complete:
                    st.error = {"code": "INCOMPLETE", "message": "stream ended without GenerateComplete"}
            except grpc.aio.AioRpcError as e:
                st.error = {"code": e.code().name, "message": e.details() or ""}
            except asyncio.CancelledError:
                st.error = {"code": "CANCELLED", "message": "cancelled by the client"}
                raise
            except Exception as e:  # a client-side bug must not stop the run
                st.error = {"code": "CLIENT_ERROR", "message": f"{type(e).__name__}: {e}"}
            finally:
                if prefill_leg is not None and not prefill_leg.done():
                    prefill_leg.cancel()
                end(st)

        async def ticker():
            while True:
                bar.show(state["done"], state["ok"], state["failed"], state["in_flight"])
                await asyncio.sleep(0.2)

        tick = asyncio.create_task(ticker()) if progress else None
        tasks = []
        t0 = time.perf_counter()
        try:
            for i in order:
                row = trace[i]
                if sem is not None:
                    await sem.acquire()
                    t_sched = time.perf_counter()
                else:
                    t_sched = t0 + (ts[i] - t_min) / 1000.0 * time_scale
                    delay = t_sched - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                rid = f"{prefix}-{i}"
                ids = blocks.input_ids(row)
                st = RequestStats(i, rid, len(ids), int(row["output_length"]))
                st.t_scheduled = t_sched
                stats[i] = st
                if router_url is not None:
                    tasks.append(asyncio.create_task(run_http(st, ids, row["output_length"])))
                else:
                    tasks.append(asyncio.create_task(run_one(st, _build_request(rid, ids, row["output_length"]))))
                await asyncio.sleep(0)  # let the new call start and running streams be read
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            if tick is not None:
                tick.cancel()
                bar.show(state["done"], state["ok"], state["failed"], state["in_flight"], final=True)
            if pchannel is not None:
                await pchannel.close()
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        t_end = max((s.t_end for s in stats if s is not None and s.t_end is not None), default=time.perf_counter())
    result = _aggregate([s for s in stats if s is not None], t_end - t0)
    result.update({"target": target, "mode": "concurrency" if concurrency is not None else "timestamps",
                   "concurrency": concurrency, "time_scale": time_scale if concurrency is None else None,
                   "block_size": block_size, "vocab_size": vocab_size, "seed": seed, "model": model,
                   "max_in_flight": state["max_in_flight"]})
    return result


async def _drain(call) -> None:
    """Read a P/D prefill leg to its end (as smg does for non-streaming requests); its errors
    show on the decode leg."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError:
        pass


def _aggregate(stats: list[RequestStats], duration_s: float) -> dict:
    recs = [s.record() for s in stats]
    ok = [r for r in recs if r["ok"]]
    itls = [x * 1e3 for s in stats if s.ok for x in s.itls]
    prompt = sum(r["prompt_tokens"] for r in ok)
    out = sum(r["completion_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    err_counts: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            err_counts[r["error"]["code"]] = err_counts.get(r["error"]["code"], 0) + 1
    dur = max(duration_s, 1e-9)
    lags = [r["send_lag_ms"] for r in recs if r["send_lag_ms"] is not None]
    return {
        "num_requests": len(recs), "ok": len(ok), "failed": len(recs) - len(ok),
        "duration_s": duration_s,
        "ttft_ms": summarize(r["ttft_ms"] for r in ok), "tpot_ms": summarize(r["tpot_ms"] for r in ok),
        "itl_ms": summarize(itls), "e2e_ms": summarize(r["e2e_ms"] for r in ok),
        "prompt_tokens": prompt, "completion_tokens": out, "cached_tokens": cached,
        "prefix_cache_hit_rate": (cached / prompt) if prompt else None,
        "output_tokens_per_s": out / dur, "total_tokens_per_s": (prompt + out) / dur,
        "requests_per_s": len(ok) / dur,
        "output_length_mismatches": sum(1 for r in ok if r["completion_tokens"] != r["output_length"]),
        "max_send_lag_ms": max(lags) if lags else None,
        "error_counts": err_counts,
        "errors": [{"index": r["index"], "request_id": r["request_id"], **r["error"]} for r in recs if not r["ok"]][:50],
        "requests": recs,
    }


def replay(target: str, trace: list[dict], *, block_size: int = 512, concurrency: int | None = None,
           time_scale: float = 1.0, vocab_size: int | None = None, seed: int = 0, timeout_s: float = 600.0,
           progress: bool = True, api_key: str | None = None, avoid_ids: Iterable[int] | None = None,
           token_cap: int | None = DEFAULT_TOKEN_CAP, connect_timeout_s: float = 30.0, wait_ready_s: float = 0.0,
           request_id_prefix: str | None = None, progress_stream=None, prefill_target: str | None = None,
           bootstrap_port: int = 8998, router_url: str | None = None) -> dict:
    """Replay ``trace`` (Mooncake rows) against the gRPC server at ``target`` ("host:port").
    With ``prefill_target`` each request also goes to that P/D prefill server, with the same
    ``disaggregated_params`` (smg's dual dispatch; ``target`` is the decode, whose stream is
    measured). With ``router_url`` (e.g. ``http://127.0.0.1:30000``) every request goes through
    that router's ``/generate`` route instead (``router_http.py``: what an smg client sees);
    ``target`` is then asked only for the model's vocabulary and eos ids.

    ``concurrency=N``: at most N requests in flight, trace order, timestamps ignored; otherwise
    each row is sent at ``(timestamp - first timestamp) * time_scale`` ms after the start
    (``time_scale`` 0.5 = twice as fast). ``vocab_size=None`` asks the server (GetModelInfo) and
    then also avoids its eos/bos ids unless ``avoid_ids`` is given. ``timeout_s`` is each
    request's gRPC deadline. ``wait_ready_s`` > 0 first polls ``HealthCheck`` until the server
    says healthy (e.g. still loading the model), at most that long. Request ids are ``f"{request_id_prefix}-{row index}"``.

    Returns a dict: ``num_requests``, ``ok``, ``failed``, ``duration_s``, ``ttft_ms`` /
    ``tpot_ms`` / ``itl_ms`` / ``e2e_ms`` (each ``{n, mean, p50, p90, p99, max}``),
    token totals, ``output_tokens_per_s``, ``total_tokens_per_s``, ``prefix_cache_hit_rate``,
    ``error_counts``, ``errors`` (first 50), ``requests`` (one record per row) and the settings.
    """
    kw = dict(block_size=block_size, concurrency=concurrency, time_scale=time_scale, vocab_size=vocab_size,
              seed=seed, timeout_s=timeout_s, progress=progress, api_key=api_key, avoid_ids=avoid_ids,
              token_cap=token_cap, connect_timeout_s=connect_timeout_s, wait_ready_s=wait_ready_s,
              request_id_prefix=request_id_prefix,
              progress_stream=progress_stream, prefill_target=prefill_target, bootstrap_port=bootstrap_port,
              router_url=router_url)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_async(target, trace, **kw))
    # called from inside an event loop: run on a private loop in a helper thread
    box: dict = {}

    def work():
        try:
            box["r"] = asyncio.run(replay_async(target, trace, **kw))
        except BaseException as e:  # re-raised in the caller's thread
            box["e"] = e

    th = threading.Thread(target=work, name="k3serve-bench", daemon=True)
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box["r"]


# ----------------------------------------------------------------------------------- report

def format_report(result: dict) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = []
    mode = (f"concurrency {result.get('concurrency')}" if result.get("mode") == "concurrency"
            else f"trace timestamps x{result.get('time_scale')}")
    lines.append(f"target {result.get('target')}  model {result.get('model') or '?'}  mode: {mode}  "
                 f"block {result.get('block_size')}  vocab {result.get('vocab_size')}")
    lines.append(f"requests {result['num_requests']}: ok {result['ok']}, failed {result['failed']}"
                 f"  duration {result['duration_s']:.2f} s  max in flight {result.get('max_in_flight', '-')}")
    lines.append(f"{'':10s}{'mean':>10s}{'p50':>10s}{'p90':>10s}{'p99':>10s}{'max':>10s}")
    for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms")):
        s = result[key]
        lines.append(f"{name:10s}" + "".join(f"{f(s[k]):>10s}" for k in ("mean", "p50", "p90", "p99", "max")))
    hr = result.get("prefix_cache_hit_rate")
    lines.append(f"tokens: prompt {result['prompt_tokens']} (cached {result['cached_tokens']}, hit rate "
                 f"{'-' if hr is None else f'{hr:.1%}'}), output {result['completion_tokens']}")
    lines.append(f"throughput: {result['output_tokens_per_s']:.1f} output tok/s, {result['total_tokens_per_s']:.1f} "
                 f"total tok/s, {result['requests_per_s']:.2f} req/s")
    if result.get("max_send_lag_ms") is not None and result.get("mode") == "timestamps":
        lines.append(f"max send lag behind schedule: {result['max_send_lag_ms']:.1f} ms")
    if result.get("output_length_mismatches"):
        lines.append(f"WARNING: {result['output_length_mismatches']} requests returned a token count "
                     f"different from output_length")
    if result["failed"]:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(result["error_counts"].items())))
        for e in result["errors"][:5]:
            lines.append(f"  #{e['index']} {e['code']}: {e['message'][:200]}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve bench",
                                description="Replay a Mooncake-format JSONL trace token-exactly over gRPC "
                                            "(sglang.grpc.scheduler.SglangScheduler) and report latency, "
                                            "throughput and prefix-cache hit rate.")
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of the gRPC server")
    p.add_argument("--trace", required=True, help="Mooncake JSONL trace (timestamp ms, input_length, "
                                                  "output_length, hash_ids)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash id (512 Mooncake, 16 tiny traces)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="fixed concurrency N (ignores timestamps); default: follow the trace timestamps")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace time by this (0.5 = replay twice as fast)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: ask the server (GetModelInfo)")
    p.add_argument("--token-cap", type=int, default=DEFAULT_TOKEN_CAP,
                   help="draw prompt token ids below min(vocab_size, this)")
    p.add_argument("--avoid-ids", default=None, help="comma-separated token ids never put in prompts "
                                                     "(default with a server-reported vocab: its eos/bos ids)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hash-block token contents")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N rows")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in seconds")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for the server")
    p.add_argument("--wait-ready", type=float, default=0.0, metavar="S",
                   help="first wait up to S seconds for HealthCheck to report healthy (model loading)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' metadata")
    p.add_argument("--out", default=None, help="save the full result (incl. per-request records) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def bench_main(argv=None) -> int:
    """CLI entry. Exit status: 0 run done (some requests may have failed; see the report),
    1 every request failed, 2 bad input / no server."""
    args = build_parser().parse_args(argv)
    try:
        trace = read_jsonl(args.trace)
    except (OSError, ValueError) as e:
        print(f"error: cannot read trace {args.trace}: {e}", file=sys.stderr)
        return 2
    if args.max_requests is not None:
        trace = trace[: max(0, args.max_requests)]
    avoid = None
    if args.avoid_ids:
        avoid = {int(x) for x in args.avoid_ids.replace(" ", "").split(",") if x}
    try:
        result = replay(args.server, trace, block_size=args.block_size, concurrency=args.concurrency,
                        time_scale=args.time_scale, vocab_size=args.vocab_size, seed=args.seed,
                        timeout_s=args.timeout, progress=not args.no_progress, api_key=args.api_key,
                        avoid_ids=avoid, token_cap=args.token_cap,
                        connect_timeout_s=args.connect_timeout, wait_ready_s=args.wait_ready)
    except (ConnectionError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:  # GetModelInfo / HealthCheck failed
        hint = " (try --wait-ready 600)" if e.code() == grpc.StatusCode.UNAVAILABLE else ""
        print(f"error: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["num_requests"] and result["ok"] == 0 else 0


if __name__ == "__main__":
    raise SystemExit(bench_main())
