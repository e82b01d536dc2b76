"""The deployment's shared secret: who may speak to the P/D bootstrap service and to the
multi-host control channel.

Those two surfaces carry requests' token ids and decide which peer receives a request's
cache, so a peer must prove it belongs to the deployment. Every process of a deployment
(both sides of a P/D pair, every process of a multi-host engine) is given the same secret,
from a file (``--cluster-secret-file``) or from the environment (``K3SERVE_CLUSTER_SECRET``),
never from the command line, where ``ps`` would show it.

Proof is an HMAC-SHA256 over the message's own fields (and a fresh nonce where a reply could
be replayed); the secret itself never crosses the network. Comparison is constant-time.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets

ENV = "K3SERVE_CLUSTER_SECRET"
MIN_BYTES = 16


class SecretError(ValueError):
    """The secret could not be read, or is too short to be one."""


def load_secret(path: str | None = None, environ: dict | None = None) -> bytes | None:
    """The secret from ``path`` (surrounding whitespace stripped) or else from ``$K3SERVE_CLUSTER_SECRET``;
    ``None`` when neither is given. A secret shorter than 16 bytes is refused."""
    environ = os.environ if environ is None else environ
    if path:
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError as e:
            raise SecretError(f"cannot read the cluster secret file {path!r}: {e.strerror}") from None
        where = f"file {path!r}"
    elif environ.get(ENV):
        value = environ[ENV].strip().encode("utf-8")
        where = f"${ENV}"
    else:
        return None
    if len(value) < MIN_BYTES:
        raise SecretError(f"the cluster secret from {where} has {len(value)} bytes; at least {MIN_BYTES} are needed")
    return value


def new_nonce() -> str:
    """A fresh random challenge (128 bits, hex)."""
    return secrets.token_hex(16)


def _message(parts) -> bytes:
    # length-prefixed, so that ("ab", "c") and ("a", "bc") sign differently
    out = bytearray()
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode("utf-8")
        out += len(b).to_bytes(8, "big") + b
    return bytes(out)


def sign(secret: bytes, *parts) -> str:
    """HMAC-SHA256 (hex) of ``parts`` (str, int or bytes) under ``secret``."""
    return hmac.new(secret, _message(parts), hashlib.sha256).hexdigest()


def verify(secret: bytes, mac: str | None, *parts) -> bool:
    """Whether ``mac`` is ``sign(secret, *parts)``, compared in constant time."""
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(mac.encode("ascii", "replace"), sign(secret, *parts).encode("ascii"))
