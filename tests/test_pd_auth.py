"""The P/D bootstrap service's authentication (issue #32, ``server/pd/auth.py``), host only:
a proof of the cluster secret over each call's own bytes, refused when missing, wrong, for
another message, out of its time window or replayed; an open service only on loopback, and
``serve --role prefill`` on another address without a secret refuses to start before it
loads anything. The servers' side (a wrong secret → UNAUTHENTICATED, the right one works) is
in ``test_pd_server.py``."""
from __future__ import annotations

import time

import pytest

from k3serve.server.pd import bootstrap_pb2 as pb
from k3serve.server.pd.auth import HEADER, BootstrapAuth, check_bind, is_loopback

SECRET = b"s" * 32


def _req(room=1, rid="r"):
    return pb.AwaitHandoffRequest(decode_id="d", bootstrap_room=room, request_id=rid, prompt_len=3, prompt_crc32=7)


def test_a_proof_covers_the_message_and_is_spent_once():
    server, client = BootstrapAuth(SECRET), BootstrapAuth(SECRET)
    req = _req()
    md = client.metadata("AwaitHandoff", req)
    assert server.why_not("AwaitHandoff", _req(room=2), md) is not None  # another room
    assert server.why_not("Release", req, md) is not None  # another method
    assert server.why_not("AwaitHandoff", req, md) is None
    assert "replay" in server.why_not("AwaitHandoff", req, md)  # the same proof again
    assert "requires" in server.why_not("AwaitHandoff", req, ())
    assert "wrong" in server.why_not("AwaitHandoff", req, BootstrapAuth(b"t" * 32).metadata("AwaitHandoff", req))
    assert "malformed" in server.why_not("AwaitHandoff", req, ((HEADER, "junk"),))
    ts, nonce, mac = dict(client.metadata("AwaitHandoff", req))[HEADER].split(":")
    old = str(int(ts) - 1000)
    assert "window" in server.why_not("AwaitHandoff", req, ((HEADER, f"{old}:{nonce}:{mac}"),))
    assert BootstrapAuth(None).metadata("AwaitHandoff", req) == ()
    assert BootstrapAuth(None).why_not("AwaitHandoff", req, ()) is None  # no secret: open


def test_an_open_service_only_on_loopback(capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    check_bind("10.1.2.3", SECRET)
    check_bind("127.0.0.1", None)
    with pytest.raises(ValueError, match="without authentication"):
        check_bind("0.0.0.0", None)


def test_serve_refuses_an_open_bootstrap_before_loading(monkeypatch, tmp_path):
    """``serve --role prefill --host 0.0.0.0`` without a secret exits at once (nothing loaded,
    nothing bound); so does a secret file that is too short."""
    from k3serve.server import cli
    from k3serve.server.api import serve as serve_mod

    monkeypatch.delenv("K3SERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.setattr(serve_mod, "model_or_demo", lambda *a: pytest.fail("loaded before refusing"))
    args = cli.build_parser().parse_args(["serve", "--role", "prefill", "--host", "0.0.0.0", "--port", "0"])
    t = time.monotonic()
    assert serve_mod.serve(args) != 0 and time.monotonic() - t < 5
    short = tmp_path / "secret"
    short.write_text("short")
    args = cli.build_parser().parse_args(["serve", "--role", "decode", "--cluster-secret-file", str(short)])
    assert serve_mod.serve(args) != 0
