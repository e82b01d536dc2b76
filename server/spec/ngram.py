"""Prompt lookup ("n-gram") drafting: propose the tokens that followed the latest earlier
occurrence of the sequence's own tail.

The rule: among the suffixes of ``tokens`` of length ``n`` in ``[min_ngram, max_ngram]``, take
the longest that also occurs earlier in ``tokens`` (an occurrence may overlap the suffix, but
must end before the last token); of its earlier occurrences take the most recent; propose what
followed it, at most ``max_tokens`` tokens (fewer when it lies near the end). The proposal may
run into the suffix itself: it is just ``tokens[end + 1 : end + 1 + max_tokens]``. No match
gives ``[]`` — the normal, cheap case.

Two implementations of the same rule, on purpose:

* :meth:`NgramDrafter.propose` scans the whole sequence on each call, O(len * max_ngram). It
  keeps no state and is simple enough to be checked by eye: the tests use it as the oracle.
* :class:`NgramIndex` is what an engine keeps per request: it is fed the accepted tokens as
  they are appended and answers from a dict ``n-gram -> start of its latest occurrence``.
  Appending costs O(max_ngram**2) per token and a proposal O(max_ngram**2), whatever the
  length. Memory: at most ``max_ngram - min_ngram + 1`` dict entries per token (one per
  distinct n-gram), each keyed by a tuple of at most ``max_ngram`` ints, plus the tokens
  (about 450 bytes and 3 us per token with the defaults on CPython 3.11).

The index lags the sequence by one token (the n-grams ending at the last token are added only
when the next one arrives), so a lookup of the sequence's own suffix finds only occurrences
that end before the last token — exactly the "earlier occurrence" of the rule. Only accepted
tokens are appended, so the index never needs to forget any.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def _check_args(max_ngram: int, min_ngram: int, max_tokens: int) -> None:
    if min_ngram < 1:
        raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
    if max_ngram < min_ngram:
        raise ValueError(f"max_ngram must be >= min_ngram ({min_ngram}), got {max_ngram}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")


def _limit(default: int, max_tokens: int | None) -> int:
    """The proposal length cap of one call: ``max_tokens`` if given, else ``default``."""
    if max_tokens is None:
        return default
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    return max_tokens


class NgramDrafter:
    """The drafter's settings and the stateless (scanning) proposal; :meth:`new_index` makes
    the incremental per-request :class:`NgramIndex` with the same settings."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_tokens: int = 7) -> None:
        _check_args(max_ngram, min_ngram, max_tokens)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_tokens = max_tokens

    def new_index(self) -> NgramIndex:
        """An empty per-request index with this drafter's settings."""
        return NgramIndex(self.max_ngram, self.min_ngram, self.max_tokens)

    def propose(self, tokens: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The draft for a request whose whole sequence (prompt + generated) is ``tokens``:
        one backward scan, O(len(tokens) * max_ngram)."""
        limit = _limit(self.max_tokens, max_tokens)
        last = len(tokens) - 1
        if limit == 0 or last < self.min_ngram:
            return []
        best_len, best_end = 0, -1
        # every earlier end position, most recent first; `matched` = how many tokens ending
        # there equal the sequence's tail (capped at max_ngram). A strictly longer match
        # replaces the best, so ties keep the most recent end.
        for end in range(last - 1, -1, -1):
            matched, most = 0, min(self.max_ngram, end + 1)
            while matched < most and tokens[end - matched] == tokens[last - matched]:
                matched += 1
            if matched > best_len:
                best_len, best_end = matched, end
                if matched == self.max_ngram:
                    break
        if best_len < self.min_ngram:
            return []
        return [int(t) for t in tokens[best_end + 1 : best_end + 1 + limit]]


class NgramIndex:
    """One request's incremental n-gram index: :meth:`extend` with accepted tokens,
    :meth:`propose` for the next draft (the same answer as :meth:`NgramDrafter.propose` on the
    whole sequence)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_tokens: int = 7) -> None:
        _check_args(max_ngram, min_ngram, max_tokens)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_tokens = max_tokens
        self._tokens: list[int] = []
        # n-gram (a tuple of min_ngram..max_ngram tokens) -> start of its latest occurrence
        # among those ending before the last token
        self._latest_start: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        """How many tokens were appended."""
        return len(self._tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append tokens to the sequence (the prompt first, then each step's accepted ones)."""
        tokens, latest_start = self._tokens, self._latest_start
        for token in new_tokens:
            end = len(tokens) - 1  # the n-grams ending at the current last token become "earlier"
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                latest_start[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
            tokens.append(int(token))

    def propose(self, max_tokens: int | None = None, after: Sequence[int] = ()) -> list[int]:
        """The draft for the sequence so far: at most ``max_ngram - min_ngram + 1`` lookups
        (shortest first; a missing n-gram means no longer one can occur), one on a miss.
        ``after``: tokens not appended yet (an in-flight step's drafts): the draft for the
        sequence followed by them, as if they were appended — they are, for the call, and
        taken out again (``O(len(after) * max_ngram)``)."""
        if after:
            return self._propose_after(max_tokens, after)
        limit = _limit(self.max_tokens, max_tokens)
        tokens = self._tokens
        size = len(tokens)
        follow = -1  # where the continuation of the longest matched suffix starts
        if limit:
            for n in range(self.min_ngram, min(self.max_ngram, size - 1) + 1):
                start = self._latest_start.get(tuple(tokens[size - n :]))
                if start is None:
                    break
                follow = start + n
        return tokens[follow : follow + limit] if follow >= 0 else []

    def _propose_after(self, max_tokens: int | None, after: Sequence[int]) -> list[int]:
        tokens, latest_start = self._tokens, self._latest_start
        size, saved = len(tokens), {}
        for token in after:  # extend, keeping what each new entry replaced
            end = len(tokens) - 1
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                key = tuple(tokens[end - n + 1 : end + 1])
                if key not in saved:
                    saved[key] = latest_start.get(key)
                latest_start[key] = end - n + 1
            tokens.append(int(token))
        try:
            return list(self.propose(max_tokens))
        finally:
            del tokens[size:]
            for key, old in saved.items():
                if old is None:
                    del latest_start[key]
                else:
                    latest_start[key] = old
