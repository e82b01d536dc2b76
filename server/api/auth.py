"""API-key authentication for the gRPC server, and where the keys come from.

Every RPC but health and reflection must carry ``authorization: Bearer KEY`` (or the bare
key) when the server has an API key. The comparison is constant-time
(``hmac.compare_digest``), so response timing does not reveal how much of a guessed key was
right.

``SubscribeKvEvents`` streams the token ids of every tenant's cached prefixes (smg's
cache-aware routing hashes them, see docs/grpc.md), so the API key that every client holds
is not enough for it: it needs the admin key, which the router holds. A server with an API
key and no admin key refuses it (PERMISSION_DENIED); a server with neither is open to
whoever reaches its port, as everything else on it.

Keys come from a file (``--api-key-file``, ``--admin-key-file``) or the environment
(``$K3SERVE_API_KEY``, ``$K3SERVE_ADMIN_KEY``): a key on the command line is visible to
every user of the machine (``ps``), so ``--api-key`` stays only for compatibility.
"""
from __future__ import annotations

import hmac
import os

import grpc

API_KEY_ENV = "K3SERVE_API_KEY"
ADMIN_KEY_ENV = "K3SERVE_ADMIN_KEY"
ADMIN_METHODS = ("/sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents",)


def load_key(value: str | None = None, path: str | None = None, env: str = API_KEY_ENV,
             environ: dict | None = None) -> str | None:
    """A key from ``value`` (a command-line flag), else the file ``path`` (surrounding
    whitespace stripped), else ``$env``; None when none is given. Both a value and a file,
    an unreadable file or an empty key raise ``ValueError``."""
    environ = os.environ if environ is None else environ
    if value and path:
        raise ValueError("give the key on the command line or in a file, not both")
    if value:
        return value
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the key file {path!r}: {e.strerror}") from None
        if not key:
            raise ValueError(f"the key file {path!r} is empty")
        return key
    return environ.get(env, "").strip() or None


def key_matches(got: str, key: str) -> bool:
    """Whether ``got`` (the authorization metadata) is ``key`` or ``Bearer key``, compared in
    constant time (both forms are always compared)."""
    want = key.encode("utf-8")
    raw = got.encode("utf-8")
    bearer = raw[7:] if raw[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(raw, want) | hmac.compare_digest(bearer, want)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Deny every method but health and reflection without the API key (UNAUTHENTICATED; the
    admin key opens them too), and :data:`ADMIN_METHODS` without the admin key."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, key: str | None, admin_key: str | None = None):
        if key == "" or admin_key == "" or (key is None and admin_key is None):
            raise ValueError("empty API key")
        self.key = key
        self.admin_key = admin_key

    def _matches(self, got: str, key: str | None) -> bool:
        return key is not None and key_matches(got, key)

    def intercept_service(self, continuation, details):
        if details.method.startswith(self.OPEN):
            return continuation(details)
        got = dict(details.invocation_metadata).get("authorization", "")
        if details.method in ADMIN_METHODS:
            if self._matches(got, self.admin_key):
                return continuation(details)
            if self.admin_key is None:
                return _deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED,
                             "this RPC streams every tenant's cached token ids: it needs the admin key, and this "
                             "server has none (--admin-key-file or $K3SERVE_ADMIN_KEY)")
            return _deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED,
                         "this RPC needs the admin key (authorization metadata)")
        if self.key is None or self._matches(got, self.key) or self._matches(got, self.admin_key):
            return continuation(details)
        return _deny(continuation(details), grpc.StatusCode.UNAUTHENTICATED,
                     "missing or wrong API key (authorization metadata)")


def _deny(handler, code: grpc.StatusCode, message: str):
    def deny(request, context):
        context.abort(code, message)

    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)
