"""The one error type of P/D: a handoff failed, with the gRPC status the caller gets. Its own
module so that every part of ``server/pd`` (rooms, budget, auth, both sides) can raise it."""
from __future__ import annotations

from ..engine.request import RequestError


class HandoffError(RequestError):
    """A P/D handoff failed: ``code`` is the gRPC status the caller gets."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
