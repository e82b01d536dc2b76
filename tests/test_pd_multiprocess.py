"""The P/D data plane between engines that span processes (issue #36): two processes x 4
virtual CPU devices (gloo), a prefill and a decode engine on meshes over both processes, each
process staging the pieces cut on its own devices and pulling those its own devices need
(body: ``_pd_multiprocess_check.py``). Tokens and logprobs equal one device's; nothing leaks;
every process stages and pulls only part of each handoff."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _util import child_xla_flags, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = {"lengths": [3, 8, 21], "pairs": ["dp2>dcp4"]}  # the servers' test (test_pd_multihost) runs another pair
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root, port = tmp_path_factory.mktemp("pdmp"), free_port()
    env = dict(os.environ, XLA_FLAGS=child_xla_flags())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_pd_multiprocess_check.py"), str(root), str(port),
                               str(i), json.dumps(SPEC)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for i in (0, 1)]
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=900)
            assert p.returncode == 0, e[-4000:]
            out.append(json.loads(o.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(out)
    return out


@pytest.mark.parametrize("pair", SPEC["pairs"])
def test_multi_process_handoff_equals_one_device(runs, pair):
    for r in runs:
        assert r[pair]["gap"] < 1e-4, r


@pytest.mark.parametrize("pair", SPEC["pairs"])
def test_each_process_moves_only_its_part(runs, pair):
    staged = [r[pair]["staged"] for r in runs]
    pulled = [r[pair]["pulled"] for r in runs]
    for i in range(len(SPEC["lengths"])):  # every handoff: both processes took part, neither alone moved it all
        total_staged, total_pulled = sum(s[i] for s in staged), sum(p[i] for p in pulled)
        assert total_staged == total_pulled > 0, (staged, pulled)
        assert all(0 < s[i] < total_staged for s in staged), staged
        assert all(0 < p[i] < total_pulled for p in pulled), pulled
