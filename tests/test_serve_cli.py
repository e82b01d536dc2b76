"""`k3serve serve` as a user runs it: a subprocess on 127.0.0.1, probed with the standard
health service, driven by `k3serve generate --server` (ids and text), scraped for
Prometheus metrics, then stopped with SIGTERM (drains, exits 0)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from _util import free_port, tiny_text_checkpoint
from k3serve.checkpoints import load_pretrained
from k3serve.server.text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    return tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "k3serve.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _wait_serving(port, proc, timeout=600):
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(ch)
    seen_not_serving = False
    t = time.monotonic() + timeout
    try:
        while time.monotonic() < t:
            assert proc.poll() is None, proc.stdout.read()
            try:
                st = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if st == health_pb2.HealthCheckResponse.SERVING:
                    return seen_not_serving
                seen_not_serving = True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    finally:
        ch.close()
    raise TimeoutError("server never became SERVING")


@pytest.mark.slow  # `k3serve serve` in a subprocess: load, warm-up compile, drain
def test_serve_generate_metrics_and_sigterm(text_ckpt, tmp_path, cache_home):
    port, mport = free_port(), free_port()
    # the engine of test_smg_router.py / test_pd_smg.py: its programs come from the session's cache
    env = dict(os.environ, K3SERVE_CACHE=cache_home)
    proc = subprocess.Popen([sys.executable, "-m", "k3serve.server.cli", "serve", "--model", str(text_ckpt),
                             "--port", str(port), "--metrics-port", str(mport), "--max-num-seqs", "2",
                             "--max-num-batched-tokens", "64", "--max-model-len", "256", "--chunk-size", "32",
                             "--page-size", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert _wait_serving(port, proc)  # NOT_SERVING while loading, then SERVING
        r = _cli("generate", "--server", f"127.0.0.1:{port}", "--ids", "5,6,7,8", "--max-new-tokens", "6",
                 "--ignore-eos")
        assert r.returncode == 0, r.stderr
        model, tok = load_pretrained(text_ckpt, dtype="float32"), load_tokenizer(text_ckpt)
        # the served greedy tokens are the model's own greedy continuation
        assert [int(t) for t in r.stdout.split()] == model.greedy([5, 6, 7, 8], 6)
        assert "length; 4 prompt + 6 generated" in r.stderr
        # text in, text out through the server's own tokenizer bundle; a chat turn too
        r = _cli("generate", "--server", f"127.0.0.1:{port}", "def main():", "--max-new-tokens", "8",
                 "--ignore-eos")
        assert r.returncode == 0 and "8 generated" in r.stderr, r.stderr
        ids = tok.encode("def main():")
        assert f"{len(ids)} prompt + 8 generated" in r.stderr
        want = tok.decode(model.greedy(ids, 8), skip_special_tokens=True)
        assert r.stdout.strip() == want.strip(), (r.stdout, want)
        r = _cli("generate", "--server", f"127.0.0.1:{port}", "hello", "--chat", "--max-new-tokens", "4",
                 "--ignore-eos")
        assert r.returncode == 0 and "4 generated" in r.stderr, r.stderr
        bad = _cli("generate", "--server", f"127.0.0.1:{port}", "--ids", "5,99999", "--max-new-tokens", "2")
        assert bad.returncode == 2 and "OUT_OF_RANGE" in bad.stderr
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        assert re.search(r"k3serve_time_to_first_token_seconds_count 3\.0", text), text
        assert "k3serve_requests_rejected_total{code=\"OUT_OF_RANGE\"} 1.0" in text
        assert "k3serve_kv_pages_used 0.0" in text
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "stopped (0 requests aborted" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_refused_multi_host_prefill_exits_on_every_process_before_loading(tmp_path):
    """Issue #36: a configuration the flags alone refuse (here a prefill whose bootstrap
    service would listen off loopback without a cluster secret) is refused by every process
    of a multi-host deployment, exit 2 within seconds: none joins the cluster, loads or waits
    for another, whatever order they start in."""
    port, missing = free_port(), tmp_path / "never-read"  # a model path that does not exist: never opened
    env = {k: v for k, v in os.environ.items() if k != "K3SERVE_CLUSTER_SECRET"}
    procs = [subprocess.Popen([sys.executable, "-m", "k3serve.server.cli", "serve", "--role", "prefill", "--model",
                               str(missing), "--host", "0.0.0.0", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), "--port", "0", "--metrics-port", "-1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in (1, 0)]
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 2, (out, err)
            assert "cannot serve as prefill" in err and "secret" in err, err
            assert "process " not in out and "loading" not in out, out  # never joined, never loaded
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_wildcard_transfer_host_is_refused_before_loading(tmp_path):
    """``--transfer-host`` is what the other side dials: a wildcard is refused from the flags,
    exit 2, before the (missing) model is opened."""
    r = subprocess.run([sys.executable, "-m", "k3serve.server.cli", "serve", "--role", "decode", "--model",
                        str(tmp_path / "never-read"), "--transfer-host", "0.0.0.0", "--port", "0", "--metrics-port",
                        "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot serve as decode" in r.stderr and "not a wildcard" in r.stderr, r.stderr
    assert "loading" not in r.stdout, r.stdout
