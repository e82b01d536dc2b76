"""The console script on the embedded demo checkpoint and on a golden checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _util import DATA, golden


def _run(args, cache):
    env = dict(os.environ, K3SERVE_CACHE=str(cache))
    cmd = [sys.executable, "-m", "k3serve.server.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_generate_golden_matches_reference_and_rejects_bad_ids(tmp_path):
    g = golden("kimi-linear-tiny")
    ids = ",".join(str(int(t)) for t in g["input_ids_1"])
    r = _run(["generate", "--model", str(DATA / "kimi-linear-tiny"), "--prompt-ids", ids,
              "--max-new-tokens", "3", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["output_ids"] == [int(t) for t in g["gen_tokens_1"][:3]]
    r = _run(["generate", "--model", str(DATA / "kimi-linear-tiny"), "--prompt-ids", "1,99999"], tmp_path)
    assert r.returncode == 2 and "99999" in r.stderr
    r = _run(["info", "--model", str(DATA / "k3-tiny-a")], tmp_path)
    assert r.returncode == 0 and "MLA at [3, 7, 9]" in r.stdout


def test_bench_offline_reports_throughput_modes_and_no_recompiles(tmp_path):
    out_json = tmp_path / "bench.json"
    r = _run(["bench", "offline", "--model", str(DATA / "kimi-linear-tiny"), "--concurrency", "1,2",
              "--prompt-len", "6", "--gen-len", "3", "--modes", "async,sync", "--json", str(out_json)], tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out_json.read_text())
    res = rep["k3serve"]["results"]
    assert [(x["concurrency"], x["mode"]) for x in res] == [(1, "async"), (1, "sync"), (2, "async"), (2, "sync")]
    for x in res:
        # every row generates 3 tokens in 3 steps (a 6-token prompt is one prefill chunk), either mode
        assert x["tokens"] == 3 * x["concurrency"] and x["steps"] == 3, x
        lo, hi = x["tokens"] / (x["wall_s"] + 5e-4) - 0.05, x["tokens"] / max(x["wall_s"] - 5e-4, 1e-9) + 0.05
        assert lo <= x["tok_per_s"] <= hi and 0 <= x["host_fraction"] <= 1, x  # tokens / wall (both rounded)
    assert rep["k3serve"]["compiles_after_warmup"] == 0 and rep["k3serve"]["warmup_s"] > 0
    tps = {(x["concurrency"], x["mode"]): x["tok_per_s"] for x in res}
    assert rep["ratio_async_over_sync"] == {str(c): round(tps[c, "async"] / tps[c, "sync"], 2) for c in (1, 2)}
