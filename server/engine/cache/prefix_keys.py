"""Prefix identity for prefix caching: chained hashes over prefix-match units, salted per
tenant (``tenant_salt``, ``chain_hashes``, ``PrefixChain``, ``longest_match``). Which keys the
device holds pages and snapshots for is ``prefix_index.PrefixIndex``; the policy on top is
``prefix_cache.PrefixCache``.

Why chained: the key of unit i must name the *whole* prefix up to and including unit i, not
just unit i's tokens; ``h_i = H(h_{i-1} || tokens of unit i)`` gives that in O(unit) per unit,
so a request's keys grow with its tokens (``PrefixChain.extend``) and never need a rehash.

Why a unit finer than the physical page: a hit may end inside a page (a 256-token page and a
shared prompt of 1,000 tokens); with 16-token units the cache can use 992 of them, the page
holding the tail is copied before the new request writes into it. ``page_size`` must be a
multiple of ``unit`` so a unit never straddles two pages.

Why salted: two tenants (different API keys, or different ``cache_salt`` request fields under
one key) must never share a page or a state, even for the same prompt. The tenant goes into the root of the
chain, so every key differs; nothing downstream has to remember to compare tenants.

Hash: BLAKE2b with a 16-byte digest over the parent digest and the unit's token ids as
little-endian int32 — deterministic across processes (unlike Python's ``hash``) and with
collisions negligible at any cache size.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST = 16
_DOMAIN = b"k3serve/prefix/v1"


def tenant_salt(cache_salt: str | None = None, api_key: str | None = None) -> bytes:
    """The salt of a request's tenant: H(API key) ‖ ``cache_salt``, either part absent when not
    given (neither: the shared empty tenant). The key is what the server authenticated; the
    salt is only what the client says, so it narrows a key's tenant and never replaces it:
    naming another client's salt under another key shares nothing. The key is hashed, so it
    is never kept; its digest has a fixed length, so the two parts cannot run into each other."""
    salt = b""
    if api_key:
        salt += b"key:" + hashlib.sha256(api_key.encode("utf-8")).digest()
    if cache_salt:
        salt += b"salt:" + cache_salt.encode("utf-8")
    return salt


def root_hash(salt: bytes = b"") -> bytes:
    return hashlib.blake2b(_DOMAIN + len(salt).to_bytes(4, "little") + salt, digest_size=DIGEST).digest()


def chain_hashes(tokens: Sequence[int], unit: int, salt: bytes = b"", parent: bytes | None = None) -> list[bytes]:
    """One key per *complete* unit of ``tokens`` (a trailing partial unit has none), chained
    from ``parent`` (default: the tenant's root)."""
    if unit < 1:
        raise ValueError(f"unit must be >= 1, got {unit}")
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    raw = ids.astype("<i4").tobytes()
    h = root_hash(salt) if parent is None else parent
    out = []
    step = 4 * unit
    for i in range(len(ids) // unit):
        h = hashlib.blake2b(h + raw[i * step : (i + 1) * step], digest_size=DIGEST).digest()
        out.append(h)
    return out


class PrefixChain:
    """A request's prefix keys, grown as its tokens grow (prompt, then generated tokens)."""

    def __init__(self, unit: int, salt: bytes = b""):
        if unit < 1:
            raise ValueError(f"unit must be >= 1, got {unit}")
        self.unit = unit
        self.salt = salt
        self.hashes: list[bytes] = []
        self._pending: list[int] = []  # tokens of the unit being filled

    @property
    def num_tokens(self) -> int:
        """Tokens covered by complete units (= len(hashes) * unit)."""
        return len(self.hashes) * self.unit

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Add tokens; returns the keys of the units they completed."""
        self._pending.extend(int(t) for t in tokens)
        n = len(self._pending) // self.unit * self.unit
        if n == 0:
            return []
        parent = self.hashes[-1] if self.hashes else None
        new = chain_hashes(self._pending[:n], self.unit, self.salt, parent)
        self._pending = self._pending[n:]
        self.hashes.extend(new)
        return new


def longest_match(hashes: Sequence[bytes], present) -> int:
    """Number of leading keys of ``hashes`` for which ``present(key)`` holds.

    Chained keys make presence monotone along a request's chain as long as the cache keeps
    a unit only while it keeps the units before it (its parents); the scan still stops at the
    first miss, so a cache that evicted a parent can never return a child."""
    n = 0
    for h in hashes:
        if not present(h):
            break
        n += 1
    return n
