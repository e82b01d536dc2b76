"""P/D between two multi-host sides (issue #36), as deployed: PyPI ``smg`` in
``--pd-disaggregation`` mode, started first, in front of a prefill of two processes
(``--role prefill --recipe ep=4``) and a decode of two processes (``--role decode --recipe
ep=2,tp=2,dcp=4``), each process with 2 virtual CPU devices, gloo. Every process of a side
stages or pulls its own part of each handoff (``server/engine/cache/handoff_plane.py``).
Completions through smg equal a unified one-device server's for prompts of 3 to 40 tokens
(pages of 8; the longest spans 3 prefill chunks), and for a second turn over the longest,
whose first pages the decode maps from its own prefix cache; afterwards neither side holds a
request, page, P/D queue entry or handoff byte, and every process of both sides held a share
of the handoffs (the handoff memory gauges, per process). Then a decode follower is killed
mid-request: the client gets UNAVAILABLE within seconds, the decode side exits non-zero, and
the prefill side frees everything and serves on. Last, a one-process decode started beside
the surviving prefill: a handoff from the two-process prefill to it equals the reference,
then a prefill follower is killed while the pieces of the next handoff are staged (the
decode held stopped until then): the client gets UNAVAILABLE within seconds, the prefill
side exits non-zero, and the decode frees everything and serves on."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from _util import (ROUTER_HEALTH, child_xla_flags, free_port, log_tail, pd_idle, post_json as _post, stop_process,
                   tool_path, wait_for_router, wait_scheduler_healthy)

SMG = tool_path("smg")
pytestmark = [pytest.mark.skipif(SMG is None, reason="smg (dev extra) is not installed"), pytest.mark.slow]

FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--chunk-size", "16", "--page-size", "8",
         "--max-model-len", "128", "--heartbeat-timeout", "10"]
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, chunk_size=16, page_size=8, max_model_len=128)
SECRET = b"pd-multihost-cluster-secret-0123"


def text_checkpoint(root):
    """A 4-layer K3 with 4 KDA and 4 MLA heads (split over 4 devices) and the demo tokenizer."""
    from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
    from k3serve.server.text.demo_tokenizer import write_demo_tokenizer

    out = root / "k3-h4-text"
    cfg = k3_config(vocab_size=4096, hidden_size=64, num_hidden_layers=4, full_attn_layers=[4], kda_num_heads=4,
                    kda_head_dim=16, mla_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                    qk_rope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2,
                    num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    intermediate_size=128, attn_res_block_size=2)
    generate_checkpoint(out, cfg, seed=3)
    write_demo_tokenizer(out)
    return out


class Side:
    """One P/D side: ``k3serve serve --role ROLE`` as ``processes`` processes of 2 devices."""

    def __init__(self, ckpt, role, recipe, tmp, env, port, boot=None, processes=2):
        self.port, coord, self.metrics_port = port, free_port(), free_port()
        extra = ["--bootstrap-port", str(boot), "--pd-wait", "10", "--pd-transfer-timeout", "10"] if boot else \
            ["--pd-transfer-timeout", "10"]
        env = dict(env, XLA_FLAGS=child_xla_flags(2))
        self.logs = [open(tmp / f"{role}{i}-{port}.log", "w+") for i in range(processes)]
        cluster = lambda i: ["--coordinator", f"127.0.0.1:{coord}", "--num-processes", str(processes),  # noqa: E731
                             "--process-id", str(i)] if processes > 1 else []
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "k3serve.server.cli", "serve", "--model", str(ckpt), "--role", role,
             "--recipe", recipe, *cluster(i), "--port", str(port if i == 0 else free_port()), "--metrics-port",
             str(self.metrics_port if i == 0 else -1), *FLAGS, *extra],
            stdout=self.logs[i], stderr=subprocess.STDOUT, env=env) for i in range(processes)]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def log(self, i: int) -> str:
        self.logs[i].flush()
        self.logs[i].seek(0)
        return "".join(ln for ln in self.logs[i] if "[Gloo]" not in ln)[-4000:]

    def wait_healthy(self, timeout=600):
        wait_scheduler_healthy(self.stub, self.procs, self.log, timeout, interval=0.5)

    def _metrics(self) -> str:
        import urllib.request

        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()

    def counters(self) -> dict:
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r"^(k3serve_\w+?)_total (\S+)$", self._metrics(), re.M)}

    def handoff_memory(self) -> dict:
        """``{(gauge, process): bytes}`` of the handoff memory gauges."""
        return {(m.group(1), int(m.group(2))): float(m.group(3)) for m in re.finditer(
            r'^k3serve_pd_handoff_memory_(bytes|peak_bytes)\{process="(\d+)"\} (\S+)$', self._metrics(), re.M)}

    def idle(self) -> bool:
        return pd_idle(self.stub)

    def close(self):
        self.channel.close()
        for p in self.procs[:1]:  # SIGTERM to the leader stops its follower too
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for f in self.logs:
            f.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, cache_home):
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer
    from k3serve.server.engine.engine import Engine
    from k3serve.server.text.tokenizer import load_tokenizer

    tmp = tmp_path_factory.mktemp("pdmh")
    ckpt = text_checkpoint(tmp)
    tok = load_tokenizer(ckpt)
    env = dict(os.environ, K3SERVE_CACHE=cache_home, K3SERVE_CLUSTER_SECRET=SECRET.decode())
    made, router, log = [], None, open(tmp / "smg.log", "w+")
    loop = server = None
    try:
        pre_port, boot, dec_port, http, prom = (free_port() for _ in range(5))
        router = subprocess.Popen([SMG, "launch", "--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{pre_port}",
                                   str(boot), "--decode", f"grpc://127.0.0.1:{dec_port}", "--model-path", str(ckpt),
                                   "--host", "127.0.0.1", "--port", str(http), "--prometheus-host", "127.0.0.1",
                                   "--prometheus-port", str(prom), "--worker-startup-check-interval", "1",
                                   *ROUTER_HEALTH],
                                  stdout=log, stderr=subprocess.STDOUT)
        pre = Side(ckpt, "prefill", "ep=4", tmp, env, pre_port, boot=boot)
        made.append(pre)
        dec = Side(ckpt, "decode", "ep=2,tp=2,dcp=4", tmp, env, dec_port)
        made.append(dec)
        loop = EngineThread(Engine(load_pretrained(ckpt), detokenizer=tok.detokenizer, **ENGINE))
        server = GrpcServer(Servicer(model_dir=ckpt), host="127.0.0.1", port=0)
        server.set_ready(loop)
        uni = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        pre.wait_healthy()
        dec.wait_healthy()
        base = f"http://127.0.0.1:{http}"
        model = wait_for_router(base, router, log)
        yield {"base": base, "tok": tok, "model": model, "uni": pb_grpc.SglangSchedulerStub(uni), "pre": pre,
               "dec": dec, "log": log, "boot": boot, "ckpt": ckpt, "env": env}
        uni.close()
    finally:
        stop_process(router)
        if server is not None:
            server.shutdown(grace_s=5)
        for s in made:
            s.close()
        log.close()


def _unified(stack, ids, max_new):
    req = pb.GenerateRequest(request_id=f"u-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=ids),
                             sampling_params=pb.SamplingParams(max_new_tokens=max_new, temperature=0))
    return list([r.complete for r in stack["uni"].Generate(req, timeout=120)][-1].output_ids)


def _until(cond, timeout, what=""):
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, f"timed out: {what}"
        time.sleep(0.1)


PROMPTS = ["def f(x):", "import os\nimport sys\n\nclass Loader:\n    def __init__(self, path):",
           "import os\ndef main():\n    path = os.path.join(os.getcwd(), 'data')\n    for name in os.listdir(path):\n"
           "        print(name, os.path.getsize(os.path.join(path, name)))"]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_completions_through_smg_equal_unified(stack, i):
    tok, prompt = stack["tok"], PROMPTS[i]
    ids = tok.encode(prompt)
    want = _unified(stack, ids, 10)
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 10, "temperature": 0}
    r = _post(stack["base"] + "/v1/completions", body)
    assert r["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True), \
        (len(ids), log_tail(stack["log"]), stack["dec"].log(0), stack["pre"].log(0))
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == len(want)
    if i == len(PROMPTS) - 1:  # a second turn over the first: the decode maps the first's cached pages
        assert len(ids) > 32  # several prefill chunks of 16
        prompt2 = prompt + r["choices"][0]["text"] + "\n    return 0"
        want2 = _unified(stack, tok.encode(prompt2), 6)
        hit = stack["dec"].counters().get("k3serve_prefix_kv_hit_tokens", 0)
        r2 = _post(stack["base"] + "/v1/completions", {**body, "prompt": prompt2, "max_tokens": 6})
        assert r2["choices"][0]["text"] == tok.decode(want2, skip_special_tokens=True)
        assert stack["dec"].counters()["k3serve_prefix_kv_hit_tokens"] - hit >= 32  # whole pages of the first turn
    for side in (stack["pre"], stack["dec"]):
        _until(side.idle, 30, "a side still holds requests")
    # the leaders count what went through them (Prometheus): one handoff more on each side
    pre, dec = stack["pre"].counters(), stack["dec"].counters()
    assert pre["k3serve_pd_handoffs_staged"] == dec["k3serve_pd_handoffs_received"] >= i + 1, (pre, dec)
    assert dec["k3serve_pd_received_bytes"] > 0 and dec["k3serve_pd_pull_seconds"] > 0, dec
    # handoff memory, per process: every process of each side held a share, none holds any now
    for side in (stack["pre"], stack["dec"]):
        mem = side.handoff_memory()
        assert {mem[("bytes", p)] for p in (0, 1)} == {0.0} and min(mem[("peak_bytes", p)] for p in (0, 1)) > 0, mem


class Legs:
    """The two legs of one P/D request sent straight to the servers (smg's way: the same
    request with bootstrap parameters to both), each in a thread."""

    def __init__(self, boot: int, ids, room: int, max_new: int, ignore_eos: bool = True):
        self.req = pb.GenerateRequest(request_id=f"legs-{room}", tokenized=pb.TokenizedInput(input_ids=ids),
                                      stream=True, sampling_params=pb.SamplingParams(
                                          max_new_tokens=max_new, temperature=0, ignore_eos=ignore_eos))
        self.req.disaggregated_params.CopyFrom(pb.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=boot, bootstrap_room=room))
        self.got, self.box, self.threads = [], {}, {}

    def start(self, name: str, stub) -> None:
        self.threads[name] = threading.Thread(target=self._run, args=(name, stub))
        self.threads[name].start()

    def _run(self, name, stub):
        try:
            for r in stub.Generate(self.req, timeout=120):
                if name == "d" and r.HasField("chunk"):
                    self.got.extend(r.chunk.token_ids)
            self.box[name] = "ok"
        except grpc.RpcError as e:
            self.box[name] = e

    def join(self, timeout: float = 60) -> None:
        for t in self.threads.values():
            t.join(timeout)


def test_decode_follower_killed_mid_request(stack):
    """SIGKILL to a decode follower while its request decodes: the client's stream ends with
    UNAVAILABLE within seconds, the decode's leader exits non-zero (a multi-host engine that
    lost a process stops as a whole), and the prefill side frees everything and serves on
    (a unified request on it equals the reference). Last: the decode side is gone after it."""
    pre, dec, tok = stack["pre"], stack["dec"], stack["tok"]
    ids = tok.encode(PROMPTS[1])
    legs = Legs(stack["boot"], ids, 77, 100)
    legs.start("d", dec.stub)
    legs.start("p", pre.stub)
    _until(lambda: len(legs.got) >= 3, 60, "the decode never streamed")
    dec.procs[1].kill()
    killed = time.monotonic()
    legs.threads["d"].join(30)
    box = legs.box
    assert isinstance(box.get("d"), grpc.RpcError) and box["d"].code() == grpc.StatusCode.UNAVAILABLE, box
    assert time.monotonic() - killed < 15
    assert len(legs.got) < 100
    assert dec.procs[0].wait(30) != 0  # the leader stopped too, non-zero
    legs.join(30)
    _until(pre.idle, 30, "the prefill kept the room or the request")
    want = _unified(stack, ids, 6)
    unified = pb.GenerateRequest(request_id="after-kill", tokenized=pb.TokenizedInput(input_ids=ids),
                                 sampling_params=pb.SamplingParams(max_new_tokens=6, temperature=0))
    assert list([r.complete for r in pre.stub.Generate(unified, timeout=120)][-1].output_ids) == want


def test_prefill_follower_killed_while_its_pieces_are_staged(stack, tmp_path):
    """A one-process decode (2 devices, ``ep=2``) beside the surviving two-process prefill:
    first a handoff between them equals the reference (a multi-host prefill to a one-process
    decode). Then the next request's decode leg is sent first; once it has registered with
    the prefill, the decode is stopped (SIGSTOP), the prefill leg computes and stages its
    pieces on both prefill processes, and the prefill follower is SIGKILLed. The decode,
    continued, finds a piece that never comes: its client gets UNAVAILABLE within seconds,
    and it frees the reservation and its handoff memory and serves on (a unified request
    equals the reference); the prefill's leader exits non-zero."""
    pre, tok = stack["pre"], stack["tok"]
    dec = Side(stack["ckpt"], "decode", "ep=2", tmp_path, stack["env"], free_port(), processes=1)
    try:
        dec.wait_healthy()
        ids = tok.encode(PROMPTS[2])
        want = _unified(stack, ids, 6)
        legs = Legs(stack["boot"], ids, 90, 6, ignore_eos=False)
        legs.start("d", dec.stub)
        legs.start("p", pre.stub)
        legs.join(120)
        assert legs.box == {"d": "ok", "p": "ok"} and legs.got == want, (legs.box, legs.got, want)

        ids = tok.encode(PROMPTS[1])
        legs = Legs(stack["boot"], ids, 91, 20)
        legs.start("d", dec.stub)
        inflight = lambda: pre.stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0] \
            .disaggregation.prefill_inflight_queue_reqs  # noqa: E731
        _until(lambda: inflight() == 1, 60, "the decode never registered with the prefill")
        os.kill(dec.procs[0].pid, signal.SIGSTOP)
        try:
            staged = pre.counters()["k3serve_pd_handoffs_staged"]
            legs.start("p", pre.stub)
            _until(lambda: pre.counters()["k3serve_pd_handoffs_staged"] > staged, 60, "the prefill never staged")
            pre.procs[1].kill()
        finally:
            os.kill(dec.procs[0].pid, signal.SIGCONT)
        killed = time.monotonic()
        legs.threads["d"].join(40)
        box = legs.box
        assert isinstance(box.get("d"), grpc.RpcError) and box["d"].code() == grpc.StatusCode.UNAVAILABLE, \
            (box, dec.log(0))
        assert time.monotonic() - killed < 20  # the pull's deadline (--pd-transfer-timeout 10) and the release
        assert legs.got == []
        assert pre.procs[0].wait(30) != 0  # the prefill's leader stopped too, non-zero
        legs.join(30)
        _until(dec.idle, 30, "the decode kept the reservation")
        assert dec.handoff_memory()[("bytes", 0)] == 0
        assert _unified_on(dec, ids, 6) == _unified(stack, ids, 6)
    finally:
        dec.close()


def _unified_on(side, ids, max_new):
    req = pb.GenerateRequest(request_id=f"u-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=ids),
                             sampling_params=pb.SamplingParams(max_new_tokens=max_new, temperature=0))
    return list([r.complete for r in side.stub.Generate(req, timeout=120)][-1].output_ids)
