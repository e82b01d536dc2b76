"""An ``smg`` router process in front of in-process servers, for ``k3serve bench pd --via smg``.

smg (PyPI ``smg``, a dev dependency of k3serve) is started on free loopback ports, its log in a
temporary file, and stopped on exit; ``start`` returns once it lists the model.
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
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_binary() -> str:
    path = shutil.which("smg") or os.path.join(os.path.dirname(sys.executable), "smg")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError("smg is not installed (pip install 'k3serve[dev]' or pip install smg)")
    return path


@contextlib.contextmanager
def router(model_dir, *, worker: int | None = None, prefill: tuple[int, int] | None = None,
           decode: int | None = None, timeout_s: float = 120.0):
    """Yield the base URL of an smg router over the gRPC server on port ``worker``, or in P/D
    mode over ``prefill`` = (port, bootstrap port) and ``decode``."""
    http, prom = _free_port(), _free_port()
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
