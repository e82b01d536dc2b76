"""The gRPC bench client (server/bench.py) against a mock SglangScheduler, and the agentic
trace generator (k3serve.server.client.traces)."""
from __future__ import annotations

import json
import threading
import time
from concurrent import futures

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from k3serve.server.client import replay as bench
from k3serve.server.client import traces as gen

VOCAB = 500


def _lcp(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class MockScheduler(pb_grpc.SglangSchedulerServicer):
    """Streams one chunk per ``tokens_per_chunk`` tokens every ``token_delay`` s and a final
    GenerateComplete; reports cached_tokens from a toy prefix cache (longest common prefix with
    any earlier input). ``fail``: row index -> (StatusCode, chunks sent before the error);
    ``hang``: indices that never answer; ``no_complete``: indices whose stream ends without
    GenerateComplete."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self, *, token_delay=0.002, tokens_per_chunk=1, fail=None, hang=(), no_complete=(), healthy_after=0):
        with self.lock:
            self.healthy_after = healthy_after
            self.health_calls = 0
            self.token_delay = token_delay
            self.tokens_per_chunk = tokens_per_chunk
            self.fail = dict(fail or {})
            self.hang = set(hang)
            self.no_complete = set(no_complete)
            self.received: dict[int, dict] = {}
            self.history: list[list[int]] = []
            self.in_flight = 0
            self.max_in_flight = 0
            self.metadata: list[dict] = []

    def Generate(self, request, context):
        t = time.perf_counter()
        idx = int(request.request_id.rsplit("-", 1)[1])
        ids = list(request.tokenized.input_ids)
        with self.lock:
            cached = max((_lcp(ids, h) for h in self.history), default=0)
            self.history.append(ids)
            self.received[idx] = {"t": t, "request_id": request.request_id, "input_ids": ids, "cached": cached,
                                  "sp": request.sampling_params, "stream": request.stream}
            self.metadata.append(dict(context.invocation_metadata()))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if idx in self.hang:
                t_end = time.time() + 5
                while context.is_active() and time.time() < t_end:
                    time.sleep(0.01)
                return
            code, fail_after = self.fail.get(idx, (None, -1))
            if fail_after == 0:
                context.abort(code, f"mock failure for request {idx}")
            n = request.sampling_params.max_new_tokens
            sent, out, chunks = 0, [], 0
            while sent < n and context.is_active():
                time.sleep(self.token_delay)
                k = min(self.tokens_per_chunk, n - sent)
                toks = [(idx + sent + j) % VOCAB for j in range(k)]
                sent += k
                out += toks
                yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
                    token_ids=toks, prompt_tokens=len(ids), completion_tokens=sent, cached_tokens=cached))
                chunks += 1
                if chunks == fail_after:
                    context.abort(code, f"mock failure for request {idx} mid-stream")
            if idx in self.no_complete:
                return
            yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
                output_ids=out, finish_reason="length", prompt_tokens=len(ids), completion_tokens=sent,
                cached_tokens=cached))
        finally:
            with self.lock:
                self.in_flight -= 1

    def HealthCheck(self, request, context):
        self.health_calls += 1
        ok = self.health_calls > self.healthy_after
        return pb.HealthCheckResponse(healthy=ok, message="ok" if ok else "loading")

    def GetModelInfo(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return pb.GetModelInfoResponse(model_path="mock", served_model_name="mock-model", vocab_size=VOCAB,
                                       eos_token_ids=[3, 7], bos_token_id=1, is_generation=True)


@pytest.fixture(scope="module")
def mock_server():
    mock = MockScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    pb_grpc.add_SglangSchedulerServicer_to_server(mock, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield mock, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=0).wait(5)


def tiny_trace(seed=0, sessions=3, **kw):
    return gen.generate_trace(seed, sessions, block_size=16, preset="tiny", **kw)


def _rows(n, input_length=20, output_length=4, dt=0, hashes_per_row=None):
    rows = []
    for i in range(n):
        nb = -(-input_length // 16)
        hs = hashes_per_row(i) if hashes_per_row else [1000 + i * 10 + j for j in range(nb)]
        rows.append({"timestamp": i * dt, "input_length": input_length, "output_length": output_length,
                     "hash_ids": hs})
    return rows


def _check_summary(s):
    assert s["n"] > 0
    assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]


# ------------------------------------------------------------------------------- generator

def test_generator_deterministic_and_block_invariant():
    a = tiny_trace(seed=5, sessions=6, annotate=True)
    assert a == tiny_trace(seed=5, sessions=6, annotate=True)
    assert a != tiny_trace(seed=6, sessions=6, annotate=True)
    bs = 16
    length: dict = {}
    prefix: dict = {}
    for r in a:
        n = len(r["hash_ids"])
        assert (n - 1) * bs < r["input_length"] <= n * bs
        assert r["output_length"] >= 1
        assert r["input_length"] + r["output_length"] <= 512
        for i, (h, ln) in enumerate(gen.row_blocks(r, bs)):
            assert length.setdefault(h, ln) == ln, "a hash id used with two lengths"
            assert ln == bs or i == n - 1, "only the last block may be partial"
            assert prefix.setdefault(h, tuple(r["hash_ids"][:i])) == tuple(r["hash_ids"][:i]), "hash ids not chained"
    ts = [r["timestamp"] for r in a]
    assert ts == sorted(ts)
    # every request starts with the shared system prompt's full blocks (40 tokens = 2 blocks of 16)
    assert all(r["hash_ids"][:2] == [0, 1] for r in a)
    assert len({r["session"] for r in a}) == 6
    # multi-turn: a later turn extends the previous turn's full blocks
    s0 = [r for r in a if r["session"] == 0 and r["kind"] == "turn"]
    assert len(s0) >= 2
    for p, q in zip(s0, s0[1:]):
        full = p["hash_ids"][: p["input_length"] // bs]
        assert q["hash_ids"][: len(full)] == full and q["input_length"] > p["input_length"] + p["output_length"] - bs
    # subagent bursts: several forks at the same timestamp sharing the parent's prefix
    subs = [r for r in a if r["kind"] == "subagent" and r["subturn"] == 0]
    bursts: dict = {}
    for r in subs:
        bursts.setdefault((r["session"], r["turn"]), []).append(r)
    assert bursts and all(len(b) >= 2 for b in bursts.values())
    for b in bursts.values():
        assert len({r["timestamp"] for r in b}) == 1
    # plain Mooncake rows unless annotated
    assert set(tiny_trace(seed=5, sessions=2)[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}


def test_generator_agentic_defaults_and_cli(tmp_path):
    t = gen.generate_trace(1, 3)
    assert t and max(r["input_length"] + r["output_length"] for r in t) <= 131072
    assert all((len(r["hash_ids"]) - 1) * 512 < r["input_length"] <= len(r["hash_ids"]) * 512 for r in t)
    out = tmp_path / "t.jsonl"
    assert gen.main(["--out", str(out), "--sessions", "4", "--seed", "3", "--preset", "tiny", "--block-size", "16",
                     "--turns", "2,3", "--quiet"]) == 0
    rows = gen.read_jsonl(str(out))
    assert rows == gen.generate_trace(3, 4, block_size=16, preset="tiny", turns=(2, 3))
    s = gen.trace_summary(rows, 16)
    assert 0 < s["min_prompt_tokens"] < s["input_tokens"]


def test_min_prompt_tokens_hand_made():
    bs = 4
    trace = [
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},  # 4 + 4 + 2
        {"timestamp": 1, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 4]},  # + 4 (hash 4)
        {"timestamp": 2, "input_length": 6, "output_length": 1, "hash_ids": [1, 5]},  # + 2 (hash 5)
        {"timestamp": 3, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},  # nothing new
        {"timestamp": 4, "input_length": 5, "output_length": 1, "hash_ids": [1, 5, 9]},  # hash 5 now 1 -> keep 2; 9 unused
    ]
    assert gen.min_prompt_tokens(trace, bs) == 4 + 4 + 2 + 4 + 2
    with pytest.raises(ValueError):
        gen.min_prompt_tokens([{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]}], bs)


# ---------------------------------------------------------------------------------- client

def test_token_blocks_deterministic_and_in_range():
    tb = bench.TokenBlocks(VOCAB, 16, seed=0, avoid_ids={0, 5, 9})
    row = {"input_length": 40, "hash_ids": [1, 2, 3]}
    ids = tb.input_ids(row)
    assert len(ids) == 40 and ids == bench.TokenBlocks(VOCAB, 16, seed=0, avoid_ids={0, 5, 9}).input_ids(row)
    assert all(0 <= x < VOCAB and x not in (0, 5, 9) for x in ids)
    assert ids != bench.TokenBlocks(VOCAB, 16, seed=1).input_ids(row)
    # siblings after a common prefix differ from their first token on
    many = [tb.input_ids({"input_length": 17, "hash_ids": [1, 100 + k]})[16] for k in range(200)]
    assert len(set(many)) == 200
    assert max(bench.TokenBlocks(10 ** 6, 64, token_cap=1000).block(7)) < 1000


def test_itl_split_per_token():
    st = bench.RequestStats(0, "r-0", 10, 5)
    st.t_send = 0.0
    chunk = lambda toks, n: pb.GenerateResponse(chunk=pb.GenerateStreamChunk(  # noqa: E731
        token_ids=toks, prompt_tokens=10, completion_tokens=n, cached_tokens=4))
    st.on_response(chunk([1], 1), 0.100)
    st.on_response(chunk([2, 3], 3), 0.140)
    st.on_response(chunk([], 3), 0.150)  # counters only: not a token arrival
    st.on_response(chunk([4, 5], 5), 0.200)
    st.on_response(pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="length", prompt_tokens=10,
                                                                     completion_tokens=5)), 0.210)
    assert st.itls == pytest.approx([0.02, 0.02, 0.03, 0.03])
    rec = st.record()
    assert rec["ttft_ms"] == pytest.approx(100) and rec["e2e_ms"] == pytest.approx(210)
    assert rec["tpot_ms"] == pytest.approx((210 - 100) / 4)
    assert rec["cached_tokens"] == 4 and rec["completion_tokens"] == 5 and rec["ok"]


def test_token_exact_replay_metrics_and_hit_rate(mock_server):
    mock, target = mock_server
    mock.reset(token_delay=0.001)
    trace = tiny_trace(seed=2, sessions=3)
    res = bench.replay(target, trace, block_size=16, concurrency=1, vocab_size=VOCAB, progress=False,
                       request_id_prefix="t")
    assert res["num_requests"] == len(trace) == res["ok"] and res["failed"] == 0
    assert len(mock.received) == len(trace)
    # token-exact: lengths, and every hash id maps to the same tokens in every request
    content: dict = {}
    for i, row in enumerate(trace):
        got = mock.received[i]
        ids = got["input_ids"]
        assert len(ids) == row["input_length"]
        assert all(0 <= x < VOCAB for x in ids)
        for b, (h, n) in enumerate(gen.row_blocks(row, 16)):
            blk = tuple(ids[b * 16: b * 16 + n])
            prev = content.setdefault(h, blk)
            assert prev[:n] == blk[: len(prev)] and len(prev) == n
        sp = got["sp"]
        assert sp.max_new_tokens == row["output_length"] and sp.ignore_eos and sp.temperature == 0
        assert got["stream"] and got["request_id"] == f"t-{i}"
    # the replayer's ids are reproducible from the trace alone
    tb = bench.TokenBlocks(VOCAB, 16)
    assert all(tb.input_ids(row) == mock.received[i]["input_ids"] for i, row in enumerate(trace))
    # metrics
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        _check_summary(res[key])
    assert res["ttft_ms"]["n"] == len(trace)
    assert res["itl_ms"]["n"] == sum(r["output_length"] - 1 for r in trace)
    assert res["completion_tokens"] == sum(r["output_length"] for r in trace)
    assert res["prompt_tokens"] == sum(r["input_length"] for r in trace)
    assert res["output_length_mismatches"] == 0 and res["max_in_flight"] == 1
    assert all(r["e2e_ms"] >= r["ttft_ms"] > 0 for r in res["requests"])
    cached = sum(v["cached"] for v in mock.received.values())
    assert res["cached_tokens"] == cached
    assert res["prefix_cache_hit_rate"] == pytest.approx(cached / res["prompt_tokens"])
    # serial replay + an ideal token-granular cache computes exactly the trace's minimum
    assert res["prompt_tokens"] - cached == gen.min_prompt_tokens(trace, 16)
    assert res["output_tokens_per_s"] > 0 and res["total_tokens_per_s"] > res["output_tokens_per_s"]
    text = bench.format_report(res)
    assert "TTFT" in text and "hit rate" in text
    json.dumps(res)  # JSON-serialisable


def test_fixed_concurrency_bound(mock_server):
    mock, target = mock_server
    mock.reset(token_delay=0.004, tokens_per_chunk=2)
    trace = _rows(18, input_length=20, output_length=6)
    res = bench.replay(target, trace, block_size=16, concurrency=3, vocab_size=VOCAB, progress=False)
    assert res["ok"] == 18 and res["mode"] == "concurrency"
    assert 2 <= mock.max_in_flight <= 3 and res["max_in_flight"] <= 3
    assert res["itl_ms"]["n"] == 18 * 4  # 3 chunks of 2 tokens: the first chunk's extra token has no gap
    assert res["completion_tokens"] == 18 * 6


def test_timestamp_mode_order_and_timing(mock_server):
    mock, target = mock_server
    mock.reset(token_delay=0.001)
    trace = _rows(4, output_length=2, dt=200)
    trace = trace[::-1]  # file order differs from time order
    res = bench.replay(target, trace, block_size=16, time_scale=0.5, vocab_size=VOCAB, progress=False)
    assert res["ok"] == 4 and res["mode"] == "timestamps"
    t = {i: mock.received[i]["t"] for i in range(4)}
    by_time = sorted(t, key=t.get)
    assert [trace[i]["timestamp"] for i in by_time] == [0, 200, 400, 600]
    t0 = t[by_time[0]]
    for i in by_time:
        want = trace[i]["timestamp"] / 1000 * 0.5
        assert want - 0.01 <= t[i] - t0 <= want + 0.08
    # a burst at one timestamp is sent at once (no concurrency limit in this mode)
    mock.reset(token_delay=0.01)
    res = bench.replay(target, _rows(5, output_length=5, dt=0), block_size=16, vocab_size=VOCAB, progress=False)
    assert res["ok"] == 5 and mock.max_in_flight == 5


def test_errors_counted_rest_complete(mock_server):
    mock, target = mock_server
    mock.reset(fail={2: (grpc.StatusCode.RESOURCE_EXHAUSTED, 0), 5: (grpc.StatusCode.INTERNAL, 2)},
               hang={7}, no_complete={9})
    trace = _rows(12, output_length=4)
    t = time.perf_counter()
    res = bench.replay(target, trace, block_size=16, concurrency=4, vocab_size=VOCAB, progress=False,
                       timeout_s=0.5)
    assert time.perf_counter() - t < 3
    assert res["num_requests"] == 12 and res["ok"] == 8 and res["failed"] == 4
    assert res["error_counts"] == {"RESOURCE_EXHAUSTED": 1, "INTERNAL": 1, "DEADLINE_EXCEEDED": 1, "INCOMPLETE": 1}
    assert sorted(e["index"] for e in res["errors"]) == [2, 5, 7, 9]
    assert "mock failure" in next(e["message"] for e in res["errors"] if e["index"] == 2)
    assert res["completion_tokens"] == 8 * 4  # failed requests are not in the totals
    assert "RESOURCE_EXHAUSTED x1" in bench.format_report(res)


def test_bench_main_cli(mock_server, tmp_path, capsys):
    mock, target = mock_server
    mock.reset(healthy_after=2)
    trace_file = tmp_path / "trace.jsonl"
    gen.write_jsonl(tiny_trace(seed=4, sessions=2), str(trace_file))
    out = tmp_path / "res.json"
    rc = bench.bench_main(["--server", target, "--trace", str(trace_file), "--block-size", "16",
                           "--max-requests", "5", "--concurrency", "2", "--api-key", "sekrit",
                           "--out", str(out), "--wait-ready", "10"])
    assert rc == 0 and mock.health_calls == 3
    assert len(mock.received) == 5
    assert all(m.get("authorization") == "Bearer sekrit" for m in mock.metadata)
    # vocab from GetModelInfo; its eos/bos ids are kept out of the prompts
    ids = [x for v in mock.received.values() for x in v["input_ids"]]
    assert max(ids) < VOCAB and not {1, 3, 7} & set(ids)
    saved = json.loads(out.read_text())
    assert saved["ok"] == 5 and saved["vocab_size"] == VOCAB and saved["model"] == "mock-model"
    assert len(saved["requests"]) == 5
    cap = capsys.readouterr()
    assert "TTFT" in cap.out and "5/5" in cap.err  # report on stdout, progress on stderr
    # no server: a clear error, exit 2
    rc = bench.bench_main(["--server", "127.0.0.1:1", "--trace", str(trace_file), "--block-size", "16",
                           "--vocab-size", "100", "--connect-timeout", "0.5", "--no-progress"])
    assert rc == 2
    # a trace whose hash ids do not cover input_length: rejected before sending
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}) + "\n")
    assert bench.bench_main(["--server", target, "--trace", str(bad), "--block-size", "16",
                             "--vocab-size", "100", "--no-progress"]) == 2


def test_progress_bar_written(mock_server):
    import io

    mock, target = mock_server
    mock.reset()
    buf = io.StringIO()
    res = bench.replay(target, _rows(3, output_length=2), block_size=16, concurrency=2, vocab_size=VOCAB,
                       progress=True, progress_stream=buf)
    assert res["ok"] == 3 and "3/3 ok=3 failed=0" in buf.getvalue()
