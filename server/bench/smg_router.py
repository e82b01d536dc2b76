"""An ``smg`` router process in front of in-process servers, for ``k3serve bench pd --via smg``.

smg (PyPI ``smg``, a dev dependency of k3serve) is started on free loopback ports, its log in a
temporary file, and stopped on exit; ``router`` yields once it lists the model.
:func:`post_json` is the client side: a 503 from smg ("no available workers": a worker it
briefly could not reach, say on a loaded machine) is retried for a bounded time, as clients of a
router do, and any other HTTP error is raised with the router's own message.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_binary() -> str:
    path = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError("smg is not installed (pip install 'k3serve[dev]' or pip install smg)")
    return path


def post_json(url: str, body: dict, *, timeout: float = 300.0, unavailable_s: float = 60.0) -> dict:
    """POST ``body`` as JSON and return the parsed answer (:func:`open_post`'s retries)."""
    with open_post(url, body, timeout=timeout, unavailable_s=unavailable_s) as r:
        return json.loads(r.read())


def open_post(url: str, body: dict, *, timeout: float = 300.0, unavailable_s: float = 60.0):
    """POST ``body`` as JSON; the open response (a streaming one can be read line by line). A
    503 is retried (after its ``Retry-After``, at most 2 s apart) until ``unavailable_s`` has
    passed; an HTTP error is raised as ``RuntimeError`` carrying the status and the body the
    router sent."""
    data = json.dumps(body).encode()
    deadline = time.monotonic() + unavailable_s
    while True:
        req = urllib.request.Request(url, data, {"content-type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code != 503 or time.monotonic() > deadline:
                raise RuntimeError(f"POST {url}: HTTP {e.code}: {detail}") from None
            try:
                wait = float(e.headers.get("Retry-After") or 0.5)
            except ValueError:
                wait = 0.5
            time.sleep(min(max(wait, 0.1), 2.0))


@contextlib.contextmanager
def router(model_dir, *, worker: int | None = None, prefill: tuple[int, int] | None = None,
           decode: int | None = None, timeout_s: float = 120.0):
    """Yield the base URL of an smg router over the gRPC server on port ``worker``, or in P/D
    mode over ``prefill`` = (port, bootstrap port) and ``decode``."""
    http, prom = free_port(), free_port()
    if worker is not None:
        workers = ["--worker-urls", f"grpc://127.0.0.1:{worker}"]
    else:
        workers = ["--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{prefill[0]}", str(prefill[1]),
                   "--decode", f"grpc://127.0.0.1:{decode}"]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([smg_binary(), "launch", *workers, "--model-path", str(model_dir), "--host", "127.0.0.1",
                             "--port", str(http), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"smg did not come up: {log.read()[-2000:]}")
            try:
                if json.loads(urllib.request.urlopen(base + "/v1/models", timeout=2).read()).get("data"):
                    break
            except OSError:
                pass
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
