"""A router nobody here wrote in front of k3serve: PyPI `smg` (Shepherd Model Gateway) on
loopback routes OpenAI HTTP requests to our gRPC server. Its completions and chat completions,
streaming and not, must be token-identical to asking our server directly over gRPC."""
from __future__ import annotations

import subprocess
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from _util import free_port, post_json as _post, tiny_text_checkpoint, tool_path, wait_for_router

SMG = tool_path("smg")
pytestmark = [pytest.mark.skipif(SMG is None, reason="smg (dev extra) is not installed"),
              pytest.mark.slow]  # a k3serve server and the smg router, each its own process


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.engine.engine import Engine
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer
    from k3serve.server.text.tokenizer import load_tokenizer

    ckpt = tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    tok = load_tokenizer(ckpt)
    eng = Engine(load_pretrained(ckpt), max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, page_size=16,
                 max_model_len=256, detokenizer=tok.detokenizer)
    loop = EngineThread(eng)
    server = GrpcServer(Servicer(model_dir=ckpt, served_model_name="k3-tiny-text"), host="127.0.0.1", port=0)
    server.set_ready(loop)
    http, prom = free_port(), free_port()
    log = open(tmp_path_factory.mktemp("smg") / "smg.log", "w+")
    router = subprocess.Popen([SMG, "launch", "--worker-urls", f"grpc://127.0.0.1:{server.port}",
                               "--model-path", str(ckpt), "--host", "127.0.0.1", "--port", str(http),
                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)],
                              stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    try:
        model = wait_for_router(base, router, log)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

        yield {"base": base, "tok": tok, "stub": pb_grpc.SglangSchedulerStub(channel), "model": model,
               "loop": loop, "log": log}
        channel.close()
    finally:
        router.terminate()
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()
        server.shutdown(grace_s=5)
        log.close()


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
