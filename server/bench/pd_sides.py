"""``bench pd --processes-per-side N``: the P/D pair as ``k3serve serve`` subprocesses, each side
``N`` processes (``--num-processes``, gloo on CPU) over ``--devices-per-side`` virtual devices in
all, so one-process and multi-host pairs of the same recipes are measured the same way. The
handoff figures come from each leader's Prometheus counters (``k3serve_pd_*``), scraped after
the replay."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

from .smg_router import free_port


class Side:
    """One side: ``procs`` processes of ``k3serve serve --role ROLE``; ``port`` is its leader's."""

    def __init__(self, model_dir, role: str, recipe: str, procs: int, devices: int, engine_flags: list[str],
                 boot: int | None = None):
        if devices % procs:
            raise ValueError(f"{devices} devices do not split over {procs} processes")
        self.port, self.metrics_port, coord = free_port(), free_port(), free_port()
        self.boot = boot
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // procs}",
                   JAX_PLATFORMS="cpu")
        extra = ["--bootstrap-port", str(boot)] if boot else []
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(procs)]
        self.procs = []
        for i in range(procs):
            cluster = ["--coordinator", f"127.0.0.1:{coord}", "--num-processes", str(procs), "--process-id", str(i)] \
                if procs > 1 else []
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "k3serve.server.cli", "serve", "--model", str(model_dir), "--role", role,
                 "--recipe", recipe, "--port", str(self.port if i == 0 else free_port()), "--metrics-port",
                 str(self.metrics_port if i == 0 else -1), *cluster, *engine_flags, *extra],
                stdout=self.logs[i], stderr=subprocess.STDOUT, env=env))

    def wait_serving(self, timeout_s: float = 900) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        ch = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                for i, p in enumerate(self.procs):
                    if p.poll() is not None:
                        raise RuntimeError(f"process {i} exited {p.returncode}: {self.log(i)}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        finally:
            ch.close()
        raise TimeoutError(f"never SERVING: {self.log(0)}")

    def log(self, i: int) -> str:
        self.logs[i].seek(0)
        return "".join(ln for ln in self.logs[i] if "[Gloo]" not in ln)[-3000:]

    def counters(self) -> dict[str, float]:
        """The leader's ``k3serve_pd_*`` counters (``name`` without the ``_total`` suffix)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(k3serve_pd_\w+?)(?:_total)? (\S+)$", text, re.M)}

    def stop(self) -> None:
        if self.procs and self.procs[0].poll() is None:
            self.procs[0].terminate()  # the leader stops its followers
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()
