"""API-key authentication for the gRPC server.

Every RPC but health and reflection must carry ``authorization: Bearer KEY`` (or the bare
key). The comparison is constant-time (``hmac.compare_digest``), so response timing does not
reveal how much of a guessed key was right.
"""
from __future__ import annotations

import hmac

import grpc


def key_matches(got: str, key: str) -> bool:
    """Whether ``got`` (the authorization metadata) is ``key`` or ``Bearer key``, compared in
    constant time (both forms are always compared)."""
    want = key.encode("utf-8")
    raw = got.encode("utf-8")
    bearer = raw[7:] if raw[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(raw, want) | hmac.compare_digest(bearer, want)


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Deny every method but health and reflection without the right key (UNAUTHENTICATED)."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, key: str):
        if not key:
            raise ValueError("empty API key")
        self.key = key

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (authorization metadata)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith(self.OPEN):
            return continuation(details)
        got = dict(details.invocation_metadata).get("authorization", "")
        if key_matches(got, self.key):
            return continuation(details)
        handler = continuation(details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny
