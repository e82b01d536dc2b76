"""API keys: matching (the bare key or ``Bearer KEY``, nothing else), where they come from
(flag, file, environment), and the admin key that SubscribeKvEvents needs."""
import pytest

from k3serve.server.api.auth import ApiKeyInterceptor, key_matches


@pytest.mark.parametrize("got", ["s3cret", "Bearer s3cret", "bearer s3cret"])
def test_accepts_the_key(got):
    assert key_matches(got, "s3cret")


@pytest.mark.parametrize("got", ["", "s3cre", "s3crett", "Bearer ", "Bearer s3cre", "Basic s3cret", " s3cret", "Bearers3cret"])
def test_refuses_anything_else(got):
    assert not key_matches(got, "s3cret")


def test_empty_key_is_refused():
    with pytest.raises(ValueError):
        ApiKeyInterceptor("")


def test_key_from_flag_file_or_environment(tmp_path):
    from k3serve.server.api.auth import load_key

    f = tmp_path / "key"
    f.write_text("  from-file\n")
    env = {"K3SERVE_API_KEY": "from-env"}
    assert load_key("from-flag", None, environ=env) == "from-flag"
    assert load_key(None, str(f), environ=env) == "from-file"
    assert load_key(None, None, environ=env) == "from-env"
    assert load_key(None, None, environ={}) is None
    with pytest.raises(ValueError, match="not both"):
        load_key("x", str(f), environ={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_key(None, str(tmp_path / "empty"), environ={})
    with pytest.raises(ValueError, match="cannot read"):
        load_key(None, str(tmp_path / "missing"), environ={})


def test_serve_takes_the_key_from_a_file_not_argv():
    from k3serve.server.cli import build_parser

    a = build_parser().parse_args(["serve", "--api-key-file", "/run/k", "--admin-key-file", "/run/a"])
    assert a.api_key_file == "/run/k" and a.admin_key_file == "/run/a" and a.api_key is None
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "visible to other users" in " ".join(help_text.split())


class _Details:
    def __init__(self, method, auth=None):
        self.method = method
        self.invocation_metadata = (("authorization", auth),) if auth else ()


def _answer(icpt, method, auth=None):
    """What the interceptor does with a call: "ok" or the status code it aborts with."""
    import grpc

    real = grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter(()))
    h = icpt.intercept_service(lambda d: real, _Details(method, auth))
    if h is real:
        return "ok"

    class Ctx:
        def abort(self, code, msg):
            raise RuntimeError(code)

    with pytest.raises(RuntimeError) as e:
        h.unary_stream(None, Ctx())
    return e.value.args[0].name


def test_kv_events_need_the_admin_key():
    """SubscribeKvEvents carries every tenant's token ids: the API key is not enough."""
    gen = "/sglang.grpc.scheduler.SglangScheduler/Generate"
    kv = "/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents"
    both = ApiKeyInterceptor("user", admin_key="admin")
    assert [_answer(both, gen, a) for a in (None, "Bearer user", "Bearer admin", "Bearer x")] == [
        "UNAUTHENTICATED", "ok", "ok", "UNAUTHENTICATED"]
    assert [_answer(both, kv, a) for a in (None, "Bearer user", "Bearer admin")] == [
        "PERMISSION_DENIED", "PERMISSION_DENIED", "ok"]
    user_only = ApiKeyInterceptor("user")
    assert _answer(user_only, kv, "Bearer user") == "PERMISSION_DENIED" and _answer(user_only, gen, "user") == "ok"
    admin_only = ApiKeyInterceptor(None, admin_key="admin")
    assert _answer(admin_only, gen) == "ok" and _answer(admin_only, kv) == "PERMISSION_DENIED"
    assert _answer(admin_only, kv, "admin") == "ok"
    assert _answer(both, "/grpc.health.v1.Health/Check") == "ok"
