"""The checked-in stubs of k3serve's own protocol (``proto/``) are what the ``.proto`` files
generate (``tools/gen_proto.py``, with the pinned grpcio-tools of the dev extra)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    made = sorted(tmp_path.glob("*.py"))
    assert [p.name for p in made] == ["bootstrap_pb2.py", "bootstrap_pb2_grpc.py"]
    for p in made:
        assert p.read_bytes() == (ROOT / "server" / "pd" / p.name).read_bytes(), (
            f"server/pd/{p.name} is stale: run python tools/gen_proto.py")


def test_package_and_service_names():
    from k3serve.server.pd import bootstrap_pb2 as pb

    svc = pb.DESCRIPTOR.services_by_name["Bootstrap"]
    assert svc.full_name == "k3serve.pd.v1.Bootstrap"
    assert [m.name for m in svc.methods] == ["Register", "AwaitHandoff", "Release"]
