"""What OpenAI clients send, through the real `smg` router in front of k3serve (issue #35):
``response_format`` JSON schemas, SGLang's ``regex`` / ``ebnf`` extensions, tool calls with
``tool_choice`` required / named (smg turns them into an xgrammar structural tag in the K3
tool-call format and parses the output with ``--tool-call-parser kimi_k3``), streaming and
not, ``logit_bias``, and bad grammars refused with a 400 while the server keeps serving.

The demo chat template thinks only when asked; smg's kimi_k3 reasoning parser assumes K3's
thinking default, so requests say ``chat_template_kwargs: {"thinking": false}`` to get the
answer as ``content`` (docs/structured-outputs.md)."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from _json_schema_check import problems
from _util import (ROUTER_HEALTH, free_port, log_tail, post_json, stop_process, tiny_text_checkpoint, tool_path,
                   wait_for_router)

from k3serve.server.structured.xgrammar_native import available

SMG = tool_path("smg")
pytestmark = [pytest.mark.skipif(SMG is None, reason="smg (dev extra) is not installed"),
              pytest.mark.skipif(not available(), reason="xgrammar is not installed (make install does it)"),
              pytest.mark.slow]  # a k3serve server and the smg router

NO_THINK = {"thinking": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "days", "unit"]}}}
OTHER = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                          "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                                         "required": ["zone"]}}}


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
    flags = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--chunk-size", "32", "--page-size", "16",
             "--max-model-len", "512"]
    args = build_parser().parse_args(["serve", *flags])
    port, http, prom = free_port(), free_port(), free_port()
    log = open(tmp_path_factory.mktemp("smg") / "smg.log", "w+")
    router = subprocess.Popen([SMG, "launch", "--worker-urls", f"grpc://127.0.0.1:{port}", "--model-path", str(ckpt),
                               "--host", "127.0.0.1", "--port", str(http), "--prometheus-host", "127.0.0.1",
                               "--prometheus-port", str(prom), "--worker-startup-check-interval", "1", *ROUTER_HEALTH,
                               "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3"],
                              stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        server = GrpcServer(Servicer(model_dir=ckpt, served_model_name="k3-tiny-text",
                                     plan=EnginePlan.from_serve_args(args)), host="127.0.0.1", port=port)
        eng = Engine(load_pretrained(ckpt), max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size,
                     page_size=args.page_size, max_model_len=args.max_model_len, tokenizer=tok)
        server.set_ready(EngineThread(eng))
        base = f"http://127.0.0.1:{http}"
        model = wait_for_router(base, router, log)
        yield {"base": base, "model": model, "log": log, "engine": eng, "tok": tok, "port": port}
    finally:
        stop_process(router)
        if server is not None:
            server.shutdown(grace_s=5)
        log.close()


def _chat(stack, stream=False, **body):
    body = {"model": stack["model"], "messages": [{"role": "user", "content": "Tell me about the weather."}],
            "temperature": 0, "chat_template_kwargs": NO_THINK, **body}
    if stream:
        body["stream"] = True
    return post_json(stack["base"] + "/v1/chat/completions", body, stream=stream)


def test_response_format_json_schema(stack):
    from test_structured import SCHEMAS

    for i, schema in enumerate(SCHEMAS[:6]):
        for t in (0.0, 1.0):
            r = _chat(stack, max_tokens=160, temperature=t, seed=i,
                      response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
            c = r["choices"][0]
            assert c["finish_reason"] == "stop", (i, c)
            value = json.loads(c["message"]["content"])
            assert not problems(value, schema), (i, c["message"]["content"])
    r = _chat(stack, max_tokens=40, response_format={"type": "json_object"})["choices"][0]
    assert r["message"]["content"].startswith("{"), r
    if r["finish_reason"] == "stop":
        assert isinstance(json.loads(r["message"]["content"]), dict)


def test_regex_and_ebnf_extensions(stack):
    r = _chat(stack, max_tokens=30, regex=r"[0-9]{3}-[a-z]{2}")["choices"][0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r["message"]["content"]), r
    r = _chat(stack, max_tokens=30, ebnf='root ::= ("yes" | "no") ", " [a-c]')["choices"][0]
    assert re.fullmatch(r"(yes|no), [a-c]", r["message"]["content"]), r


def _check_calls(calls, names=("get_weather",)):
    assert calls, "no tool call"
    params = {TOOL["function"]["name"]: TOOL["function"]["parameters"],
              OTHER["function"]["name"]: OTHER["function"]["parameters"]}
    for call in calls:
        fn = call["function"]
        assert fn["name"] in names
        args = json.loads(fn["arguments"])
        assert not problems(args, params[fn["name"]]), (fn, problems(args, params[fn["name"]]))


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls(stack, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    names = ("get_weather", "get_time") if choice == "required" else ("get_time",)
    r = _chat(stack, max_tokens=400, tools=[TOOL, OTHER], tool_choice=tool_choice)
    assert r["choices"][0]["message"].get("tool_calls"), r
    _check_calls(r["choices"][0]["message"].get("tool_calls"), names)
    events = _chat(stack, stream=True, max_tokens=400, tools=[TOOL, OTHER], tool_choice=tool_choice)
    calls = {}
    for e in events:
        for d in e["choices"][0]["delta"].get("tool_calls") or []:
            c = calls.setdefault(d["index"], {"function": {"name": "", "arguments": ""}})
            c["function"]["name"] += d.get("function", {}).get("name") or ""
            c["function"]["arguments"] += d.get("function", {}).get("arguments") or ""
    _check_calls(list(calls.values()), names)


def test_tool_choice_auto_is_served(stack):
    r = _chat(stack, max_tokens=16, tools=[TOOL], tool_choice="auto")["choices"][0]
    assert r["finish_reason"] in ("stop", "length")


def test_logit_bias_over_grpc(stack):
    """smg 1.13.0 sends an empty ``logit_bias`` map to the worker whatever the client sent
    (chat and completions; docs/structured-outputs.md), so this asks the worker directly, with
    the SGLang proto's field, as a router that forwards it would."""
    import grpc
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    ok, no = 1038, 795  # 'ok' and ' no' in the demo vocabulary
    ids = stack["tok"].encode("Tell me about the weather.")
    with grpc.insecure_channel(f"127.0.0.1:{stack['port']}") as ch:
        stub = pb_grpc.SglangSchedulerStub(ch)

        def run(bias, ask=()):
            req = pb.GenerateRequest(request_id=f"bias-{len(bias)}-{sorted(bias.items())}",
                                     tokenized=pb.TokenizedInput(input_ids=ids), stream=False,
                                     token_ids_logprob=list(ask),
                                     sampling_params=pb.SamplingParams(max_new_tokens=4, logit_bias=bias))
            return [r.complete for r in stub.Generate(req, timeout=120)][-1]

        plain = run({})
        assert list(run({str(plain.output_ids[0]): -100.0}).output_ids)[0] != plain.output_ids[0]
        assert list(run({str(ok): 100.0}).output_ids) == [ok] * 4
        # token_ids_logprob: a row per output position with the asked ids' raw log-probs
        done = run({str(no): 100.0}, ask=(ok, no))
        rows = done.output_logprobs.token_ids_logprobs
        assert list(done.output_ids) == [no] * 4 and len(rows) == 4
        assert all(list(r.token_ids) == [ok, no] and all(v < 0 for v in r.values) for r in rows)


def test_bad_grammars_get_400_and_the_server_keeps_serving(stack):
    for body in (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
                 dict(regex="a("), dict(ebnf="root ::= missing")):
        with pytest.raises(RuntimeError) as e:
            _chat(stack, max_tokens=8, **body)
        assert "400" in str(e.value) and "does not compile" in str(e.value), (e.value, log_tail(stack["log"]))
    r = _chat(stack, max_tokens=8, regex="fine|ok")["choices"][0]
    assert r["message"]["content"] in ("fine", "ok")
    assert not stack["engine"].requests


def test_n_samples(stack):
    """n = 4: four choices; greedy ones equal; the prompt computed once (the other samples'
    cached tokens cover it but the last prefix unit); seeded sampling gives each its own stream."""
    eng = stack["engine"]
    before = eng.prompt_tokens_computed
    r = _chat(stack, max_tokens=8, n=4, messages=[{"role": "user", "content": "Count from one to ten, slowly: " * 3}])
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert len({c["message"]["content"] or c["message"].get("reasoning_content") for c in choices}) == 1
    prompt = r["usage"]["prompt_tokens"]
    computed = eng.prompt_tokens_computed - before
    assert computed <= prompt + 3 * eng.prefix_cache.unit, (computed, r["usage"])
    r = _chat(stack, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert len(r["choices"]) == 3 and len({c["message"]["content"] for c in r["choices"]}) > 1, r["choices"]
    events = _chat(stack, stream=True, max_tokens=6, n=2)
    assert {e["choices"][0]["index"] for e in events if e["choices"]} == {0, 1}
    with pytest.raises(RuntimeError) as e:
        _chat(stack, max_tokens=4, n=9)
    assert "400" in str(e.value) and "n=9" in str(e.value)
    assert not eng.requests
