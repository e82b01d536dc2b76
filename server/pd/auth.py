"""Who may call the P/D bootstrap service: peers that hold the deployment's shared secret.

The bootstrap service decides who receives a request's cache (``AwaitHandoff`` registers a
destination and is answered with the transfer id) and who may end a room (``Release``), so an
unauthenticated caller could take another tenant's prompt state or cancel its handoff. Every
call therefore carries, in its gRPC metadata (``x-k3-bootstrap-proof``), a proof
``TIMESTAMP:NONCE:HMAC`` where the HMAC-SHA256 (``server/shared_secret.py``) covers the
method, the timestamp, the nonce and the request message's own bytes (room, request id,
prompt CRC, destination, ...). The service accepts a proof only within ``WINDOW_S`` of its
clock and only once (nonces seen within the window are kept), so a captured call cannot be
replayed. A missing or wrong proof is UNAUTHENTICATED and changes nothing.

Without a secret the service is open, which is allowed only on a loopback address (a warning
is printed once); ``check_bind`` refuses any other address before the model is loaded.
"""
from __future__ import annotations

import ipaddress
import sys
import threading
import time

import grpc

from ..shared_secret import new_nonce, sign, verify

HEADER = "x-k3-bootstrap-proof"
WINDOW_S = 120.0  # a proof older or newer than this (clock skew included) is refused
SERVICE = "k3serve.pd.v1.Bootstrap"
_warned = threading.Event()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, secret: bytes | None) -> None:
    """Refuse (ValueError) to serve the bootstrap service on a non-loopback ``host`` without a
    secret; warn once when it runs open on loopback."""
    if secret is not None:
        return
    if not is_loopback(host):
        raise ValueError(f"the P/D bootstrap service would bind {host} without authentication: give every server "
                         "of the deployment the same --cluster-secret-file (or $K3SERVE_CLUSTER_SECRET), or bind "
                         "--host to a loopback address")
    if not _warned.is_set():
        _warned.set()
        print(f"k3serve: warning: the P/D bootstrap service on {host} is unauthenticated (no cluster secret); "
              "any local process may register for a room", file=sys.stderr, flush=True)


class BootstrapAuth:
    """Signs calls (the decode) and checks them (the prefill) under ``secret``; with no
    secret, signs nothing and accepts everything."""

    def __init__(self, secret: bytes | None, window_s: float = WINDOW_S):
        self.secret, self.window_s = secret, window_s
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # nonce -> when accepted

    def metadata(self, method: str, request) -> tuple:
        if self.secret is None:
            return ()
        ts, nonce = str(int(time.time())), new_nonce()
        mac = sign(self.secret, SERVICE, method, ts, nonce, request.SerializeToString(deterministic=True))
        return ((HEADER, f"{ts}:{nonce}:{mac}"),)

    def why_not(self, method: str, request, metadata) -> str | None:
        """None if the call's proof is good (its nonce is then spent), else why not."""
        if self.secret is None:
            return None
        proof = dict(metadata or ()).get(HEADER)
        if not proof:
            return f"this bootstrap service requires a proof of the cluster secret ({HEADER} metadata)"
        try:
            ts, nonce, mac = proof.split(":")
            age = time.time() - int(ts)
        except ValueError:
            return "malformed bootstrap proof"
        if abs(age) > self.window_s:
            return f"bootstrap proof outside the {self.window_s:.0f} s window (clocks differ, or a replay)"
        if not verify(self.secret, mac, SERVICE, method, ts, nonce, request.SerializeToString(deterministic=True)):
            return "wrong bootstrap proof (the servers do not share the cluster secret)"
        now = time.monotonic()
        with self._lock:
            if len(self._seen) > 4096:
                self._seen = {n: t for n, t in self._seen.items() if now - t <= 2 * self.window_s}
            if nonce in self._seen:
                return "bootstrap proof already used (a replay)"
            self._seen[nonce] = now
        return None

    def check(self, method: str, request, context) -> None:
        """Abort the call UNAUTHENTICATED unless its proof is good."""
        why = self.why_not(method, request, context.invocation_metadata())
        if why is not None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
