"""A router nobody here wrote in front of k3serve: PyPI `smg` (Shepherd Model Gateway) on
loopback routes OpenAI HTTP requests to our gRPC server. Its completions and chat completions,
streaming and not, must be token-identical to asking our server directly over gRPC. The router
starts first and registers the server while it still loads (issue #32): what it read then
must be what the loaded server answers, and it must route to the server once it serves."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from _util import (ROUTER_HEALTH, free_port, log_tail, post_json as _post, stop_process, tiny_text_checkpoint,
                   tool_path, wait_for_router)

SMG = tool_path("smg")
pytestmark = [pytest.mark.skipif(SMG is None, reason="smg (dev extra) is not installed"),
              pytest.mark.slow]  # a k3serve server and the smg router, each its own process


FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--chunk-size", "32", "--page-size", "16",
         "--max-model-len", "256"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer
    from k3serve.server.api.worker_info import EnginePlan
    from k3serve.server.cli import build_parser
    from k3serve.server.engine.engine import Engine
    from k3serve.server.text.tokenizer import load_tokenizer

    ckpt = tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    tok = load_tokenizer(ckpt)
    args = build_parser().parse_args(["serve", *FLAGS])
    port, http, prom = free_port(), free_port(), free_port()
    log = open(tmp_path_factory.mktemp("smg") / "smg.log", "w+")
    # the router first, as a deployment that starts both at once (issue #32): it registers the
    # worker while the model still loads, and must route to it once it serves
    router = subprocess.Popen([SMG, "launch", "--worker-urls", f"grpc://127.0.0.1:{port}",
                               "--model-path", str(ckpt), "--host", "127.0.0.1", "--port", str(http),
                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                               "--worker-startup-check-interval", "1", *ROUTER_HEALTH],
                              stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    server = None
    try:
        server = GrpcServer(Servicer(model_dir=ckpt, served_model_name="k3-tiny-text",
                                     plan=EnginePlan.from_serve_args(args)), host="127.0.0.1", port=port)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.SglangSchedulerStub(channel)
        wait_for_worker(base, router, log)  # registered while loading
        loading = _info(stub)
        eng = Engine(load_pretrained(ckpt), max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size,
                     page_size=args.page_size, max_model_len=args.max_model_len, detokenizer=tok.detokenizer)
        loop = EngineThread(eng)
        server.set_ready(loop)
        model = wait_for_router(base, router, log)
        assert model == "k3-tiny-text", log_tail(log)
        yield {"base": base, "tok": tok, "stub": stub, "model": model, "loop": loop, "log": log,
               "loading": loading}
        channel.close()
    finally:
        stop_process(router)
        if server is not None:
            server.shutdown(grace_s=5)
        log.close()


def wait_for_worker(base, router, log, timeout: float = 60) -> None:
    """Until smg's ``/workers`` lists a worker (registered, whatever it answered)."""
    t = time.monotonic() + timeout
    while True:
        assert router.poll() is None, log_tail(log)
        try:
            if json.loads(urllib.request.urlopen(base + "/workers", timeout=2).read()).get("workers"):
                return
        except OSError:
            pass
        assert time.monotonic() < t, log_tail(log)
        time.sleep(0.2)


def _info(stub) -> tuple:
    return (stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10),
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10))


def test_what_smg_reads_is_known_before_the_load(stack):
    """smg reads GetModelInfo and GetServerInfo once, when it registers the worker, which was
    while it loaded: every field it reads then must be what the loaded server answers."""
    (m0, s0), (m1, s1) = stack["loading"], _info(stack["stub"])
    assert m0 == m1
    a0, a1 = dict(s0.server_args.items()), dict(s1.server_args.items())
    live = {"max_total_num_tokens", "num_devices", "mesh_shape"}  # known once the KV cache is allocated
    assert live.isdisjoint(a0) and a0 == {k: v for k, v in a1.items() if k not in live}
    assert m0.served_model_name == "k3-tiny-text" and m0.max_context_length == 256 and m0.tokenizer_path


def _direct(stack, ids, max_new):
    req = pb.GenerateRequest(request_id=f"direct-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=ids),
                             stream=False, sampling_params=pb.SamplingParams(max_new_tokens=max_new))
    done = [r.complete for r in stack["stub"].Generate(req, timeout=120)][-1]
    return list(done.output_ids), done.finish_reason


def test_completions_through_smg_match_direct_grpc(stack):
    tok = stack["tok"]
    prompt = "import os\ndef main():\n    path = os.path."
    ids = tok.encode(prompt)
    want, reason = _direct(stack, ids, 12)
    want_text = tok.decode(want, skip_special_tokens=True)
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = _post(stack["base"] + "/v1/completions", body)
    assert r["choices"][0]["text"] == want_text
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == len(want)
    ev = _post(stack["base"] + "/v1/completions", {**body, "stream": True}, stream=True)
    assert "".join(e["choices"][0].get("text", "") for e in ev if e.get("choices")) == want_text


def test_chat_completions_through_smg_match_direct_grpc(stack):
    from k3serve.server.text.chat import encode_chat

    tok = stack["tok"]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    ids = encode_chat(tok, messages, thinking=False)
    want, reason = _direct(stack, ids, 10)
    want_text = tok.decode(want, skip_special_tokens=True)
    body = {"model": stack["model"], "messages": messages, "max_tokens": 10, "temperature": 0}
    r = _post(stack["base"] + "/v1/chat/completions", body)
    assert r["usage"]["prompt_tokens"] == len(ids), "smg rendered the chat differently from encode_chat"
    assert r["usage"]["completion_tokens"] == len(want)
    assert (r["choices"][0]["message"]["content"] or "") == want_text
    ev = _post(stack["base"] + "/v1/chat/completions", {**body, "stream": True}, stream=True)
    streamed = "".join((e["choices"][0].get("delta", {}).get("content") or "") for e in ev if e.get("choices"))
    assert streamed == want_text
    # everything the router sent has finished and freed its pages and slot
    st = stack["loop"].stats()
    assert st["free_pages"] + st["prefix_pages_held"] == stack["loop"].engine.capacity_plan.num_pages
