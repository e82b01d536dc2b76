"""Grammars for constrained decoding: compile once per schema, one matcher per request.

A request's constraint (:class:`Constraint`: a regex, a JSON schema, an EBNF grammar or an
xgrammar structural tag) is compiled by :class:`GrammarCompiler` against the model's
vocabulary (each id's bytes; chat markers such as ``<|open|>`` their names (:func:`is_marker`),
other control tokens none, so no grammar allows them; the stop ids are allowed exactly where
the grammar may end). Compiling is the slow part (milliseconds to
seconds for a large tool schema), so it happens where the request is validated — the gRPC
handler's thread or the ``LLM`` caller — never on the engine's thread, and the result is
cached by the constraint's hash (``cache_entries`` most recent; xgrammar's compiled grammars
are immutable and shared by every matcher).

A :class:`Matcher` is one request's position in its grammar: the engine advances it with each
token the request emits and, before a step samples the request's next token, writes the
allowed ids into the request's row of the step's bitmask (``int32[rows, ceil(V / 32)]``,
bit ``i % 32`` of word ``i // 32`` set: id ``i`` allowed; xgrammar's layout), which the
sampling program applies on the device.

JSON never holds a raw control character (bytes below 0x20 appear only escaped, and the compact
grammars below have no free whitespace), but xgrammar 0.2.9's rule for a string with
``minLength`` / ``maxLength`` lets ids whose bytes include them through (``"\x18"`` inside a
string: unparsable). So a JSON schema's matcher also clears every id with such a byte from its
bitmask row; the grammar allows a superset of what is sampled, so it accepts every token.

JSON schemas compile with compact separators (``", "``, ``": "``) and no free whitespace:
with any-whitespace grammars a model can pad forever inside a value (xgrammar's and SGLang's
``any_whitespace`` default), which a server bounding output by ``max_new_tokens`` turns into
truncated, unparsable JSON.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import threading
import time

import numpy as np

from .xgrammar_native import api

KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
MAX_CONSTRAINT_CHARS = 1 << 20  # a constraint's text; larger is refused before compiling


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile (its message says why)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"a {self.kind} constraint needs a non-empty string")
        if len(self.text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{self.kind} of {len(self.text)} characters; at most {MAX_CONSTRAINT_CHARS}")

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()


def is_marker(name: str) -> bool:
    """A control token that is chat structure (``<|open|>``, ``<|sep|>``, ``<|close|>``, ...):
    grammars may spell it (tool-call sections are made of them, and a structural tag's
    ``<|open|>tools<|sep|>`` must be the model's real marker tokens, not their characters), so
    it keeps its name as its bytes. Reserved slots and bracketed ids (``[BOS]``, ``[PAD]``)
    have none: no grammar produces them."""
    return name.startswith("<|") and name.endswith("|>") and not name.startswith("<|reserved_token_")


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """``bool[rows, V]`` -> the packed ``int32[rows, ceil(V / 32)]`` layout (bit ``i % 32`` of
    word ``i // 32``: id ``i`` allowed)."""
    rows, V = allowed.shape
    bits = np.zeros((rows, bitmask_words(V) * 32), bool)
    bits[:, :V] = allowed
    words = (bits.reshape(rows, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return words.astype(np.uint32).view(np.int32)


class GrammarCompiler:
    """Compiles constraints for one vocabulary (``vocab_bytes[i]``: id ``i``'s bytes, ``b""``
    for control tokens and ids no token has); ``stop_ids`` are the ids that end a sequence
    (the model's eos). Thread-safe."""

    def __init__(self, vocab_bytes: list[bytes], stop_ids: list[int], *, threads: int = 2, cache_entries: int = 256):
        x = api()
        self.vocab_size = len(vocab_bytes)
        self.vocab_bytes = list(vocab_bytes)
        self.stop_ids = [int(t) for t in stop_ids]
        # packed like a bitmask row: ids without a byte below 0x20 (what JSON may hold raw)
        self.json_keep = pack_bitmask(np.array([[not any(b < 0x20 for b in t) for t in vocab_bytes]]))[0]
        self._info = x.TokenizerInfo(list(vocab_bytes), 0, self.vocab_size, self.stop_ids, False)  # 0: RAW bytes
        self._compiler = x.GrammarCompiler(self._info, threads, False, -1, False)
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses
        self.compile_s = 0.0

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_ids: list[int], **kw) -> "GrammarCompiler":
        """From a ``server.text.tokenizer.Tokenizer``; ids from the tokenizer's size up to the
        model's ``vocab_size`` (a padded embedding) have no bytes."""
        vocab = [b""] * vocab_size
        for i in range(min(vocab_size, tokenizer.vocab_size)):
            vocab[i] = b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i)
        stops = set(int(t) for t in stop_ids)
        for name, i in tokenizer.special_tokens.items():
            if 0 <= i < vocab_size and i not in stops and is_marker(name):
                vocab[i] = name.encode()
        return cls(vocab, stop_ids, **kw)

    def compile(self, c: Constraint):
        """The compiled grammar of ``c`` (cached); :class:`GrammarError` if it does not compile."""
        key = c.key
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        t = time.perf_counter()
        try:
            g = self._compile(c)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with its message
            raise GrammarError(f"{c.kind} does not compile: {_short(e)}") from None
        with self._lock:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t
            self._cache[key] = g
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return g

    def _compile(self, c: Constraint):
        comp = self._compiler
        if c.kind == "json_schema":
            # compact separators, no free whitespace, strict (no properties the schema lacks)
            return comp.compile_json_schema(c.text, False, None, None, True, None, False)
        if c.kind == "regex":
            return comp.compile_regex(c.text)
        if c.kind == "ebnf":
            return comp.compile_grammar_from_strings(c.text, "root")
        return comp.compile_structural_tag(c.text)

    def matcher(self, c: Constraint, stop_ids: list[int] | None = None, gate: bytes | None = None) -> "Matcher":
        """A fresh matcher for ``c`` (compiled or taken from the cache); ``stop_ids``: the ids
        that may end this request (default: the compiler's); ``gate``: see :class:`Matcher`."""
        return Matcher(self.compile(c), self.vocab_size, stop_ids,
                       keep=self.json_keep if c.kind == "json_schema" else None,
                       gate=gate, vocab=self.vocab_bytes if gate else None)


class Matcher:
    """One request's place in its grammar.

    ``gate`` (bytes; ``vocab``: each id's bytes): the grammar starts only after the output has
    spelled ``gate`` — a thinking request (its prompt opened a think block) thinks freely and
    is constrained from the answer on (``server.text.chat.thinking_gate``: after
    ``<|open|>response<|sep|>``). Until then every id is allowed and nothing ends the grammar."""

    def __init__(self, compiled, vocab_size: int, stop_ids: list[int] | None = None, keep: np.ndarray | None = None,
                 gate: bytes | None = None, vocab: list[bytes] | None = None):
        self._compiled, self.vocab_size, self._keep = compiled, vocab_size, keep
        self._stop_ids = None if stop_ids is None else [int(t) for t in stop_ids]
        self._m = api().GrammarMatcher(compiled, self._stop_ids, False, 0, None)
        self.rejected: int | None = None  # the first token the grammar did not accept
        if gate and vocab is None:
            raise ValueError("a gated matcher needs the vocabulary's bytes")
        self._gate0, self._vocab = gate or None, vocab
        self.gate, self._tail = self._gate0, b""  # the gate still to be spelled (None: the grammar runs)

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False (and the matcher unchanged) if the grammar forbids it."""
        if self.gate is not None:
            t = int(token)
            tail = self._tail + (self._vocab[t] if 0 <= t < len(self._vocab) else b"")
            if tail.endswith(self.gate):
                self.gate, self._tail = None, b""
            else:
                self._tail = tail[-len(self.gate):]
            return True
        ok = bool(self._m.accept_token(int(token), False))
        if not ok and self.rejected is None:
            self.rejected = int(token)
        return ok

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the ids allowed next into ``bitmask[row]`` (``int32[rows, ceil(V / 32)]``)."""
        if self.gate is not None:
            bitmask[row] = -1
            return
        self._m.fill_next_token_bitmask(bitmask, int(row), False)
        if self._keep is not None:  # ids the grammar must not allow whatever it says (JSON: control bytes)
            bitmask[row] &= self._keep

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop id: the request ends."""
        return self.gate is None and bool(self._m.is_terminated())

    def fork(self) -> "Matcher":
        """A new matcher for the same grammar at the start (``n > 1`` samples start together)."""
        return Matcher(self._compiled, self.vocab_size, self._stop_ids, self._keep, self._gate0, self._vocab)


def _short(e: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    msg = re.sub(r"^\[[0-9:]+\]\s*", "", str(e).strip())
    msg = re.sub(r"^\S+\.(cc|h):\d+:\s*", "", msg)
    msg = msg.replace("Check failed: (error.empty()) is false: ", "")
    msg = " ".join(msg.split())
    return msg if len(msg) <= 500 else msg[:500] + "..."
