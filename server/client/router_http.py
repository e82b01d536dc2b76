"""One streamed request through a router's SGLang-native HTTP route (``POST /generate``), for
the replayer's ``router_url`` mode: what a client of ``smg`` sees, router included.

The body carries the trace's token ids (``input_ids``), so the router sends exactly those to
its workers (``/v1/completions`` rejects token-id prompts in smg 1.13). The answer is a
server-sent-event stream of JSON objects, each with the text so far, ``output_ids`` and
``meta_info`` (cumulative ``completion_tokens``, ``prompt_tokens``, ``cached_tokens``,
``finish_reason``), ended by ``data: [DONE]``. Blocking: the replayer runs it on a thread.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class RouterError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def served_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model the router lists (``/v1/models``): smg routes ``/generate`` by it."""
    try:
        data = json.loads(urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout_s).read())
    except OSError as e:
        raise RouterError("UNAVAILABLE", f"no router at {base_url}: {e}") from None
    if not data.get("data"):
        raise RouterError("UNAVAILABLE", f"the router at {base_url} lists no model")
    return data["data"][0]["id"]


def stream_generate(base_url: str, model: str, rid: str, input_ids: list[int], max_new_tokens: int,
                    timeout_s: float, on_event) -> None:
    """Send one greedy request (eos ignored) and call ``on_event(obj, perf_counter())`` for every
    event of its stream. RouterError with the HTTP status (or ``UNAVAILABLE``) on failure."""
    body = {"model": model, "rid": rid, "input_ids": list(map(int, input_ids)), "stream": True,
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(base_url.rstrip("/") + "/generate", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        raise RouterError(f"HTTP_{e.code}", e.read()[:500].decode("utf-8", "replace")) from None
    except OSError as e:
        raise RouterError("UNAVAILABLE", str(e)) from None
    with resp:
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            obj = json.loads(data)
            if "error" in obj:
                raise RouterError("ROUTER_ERROR", json.dumps(obj["error"])[:500])
            on_event(obj, time.perf_counter())
