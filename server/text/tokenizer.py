"""Tokenizers for K3 checkpoints: the release's tiktoken BPE and the demo's sentencepiece BPE.

Why this module exists: the server receives token ids over gRPC, but it also has to turn
chat messages into ids (``server/chat.py``), stream generated text back incrementally, and
ship the tokenizer files to a router (``GetTokenizer``). This module finds what a checkpoint
folder ships and wraps it behind one small interface.

:func:`load_tokenizer` looks in ``model_dir`` for

* ``tiktoken.model`` (+ ``tokenizer_config.json``): the K3 release. One ``<base64 bytes>
  <rank>`` pair per line (the usual tiktoken file format); the control tokens are the
  ``added_tokens_decoder`` entries of ``tokenizer_config.json`` at ids >= the number of ranks.
  Text is split by the Kimi pre-tokenizer regex (:data:`KIMI_PAT_STR`) and encoded with the
  ``tiktoken`` package.
* ``tokenizer.model`` (+ ``tokenizer_config.json``): a sentencepiece model such as the demo
  tokenizer written by ``k3serve.server.text.demo_tokenizer``.

Either way the result is a :class:`Tokenizer`:

* ``encode(text, allow_special=False)``: with ``allow_special=False`` control-token strings
  such as ``"<|open|>"`` inside the text are ordinary text (never a control id), so user text
  cannot inject chat structure. With ``allow_special=True`` they become their control ids.
* ``decode(ids, skip_special_tokens=False)`` and :class:`Detokenizer` (``tok.detokenizer()``),
  an incremental decoder whose ``add(ids)`` returns only newly completed text: bytes of a
  UTF-8 character split over several tokens (byte-fallback pieces, byte-level BPE) are held
  back until the character is complete. ``decode`` is exactly ``add(ids) + flush()``.
* ``vocab_size``, ``special_tokens`` (control-token name -> id), ``bos_token_id``,
  ``eos_token_id``, ``pad_token_id``, ``chat_template``, ``model_max_length`` and ``files``
  (the files a tokenizer bundle for ``GetTokenizer`` should carry, among
  :data:`BUNDLE_FILES`).

K3 control-token layout (:func:`k3_control_tokens`): the last 256 ids of the vocabulary are
control slots. Offsets from the first slot (``V - 256``): ``[BOS]`` 0, ``[EOS]`` 1,
``<|end_of_msg|>`` 2 (the generation stop token, the config's eos), ``<|open|>`` 3,
``<|close|>`` 4, ``<|sep|>`` 5, ``<|media_begin|>`` 18, ``<|media_content|>`` 19,
``<|media_end|>`` 20, ``<|media_pad|>`` 21, ``[UNK]`` 254, ``[PAD]`` 255; every other slot is
``<|reserved_token_<id>|>``.

Choices made here (see docs/tokenizer-and-chat.md):

* ``eos_token_id`` is the model config's ``eos_token_id`` when ``config.json`` has one (the
  id the model was trained to stop on), else the tokenizer config's ``eos_token``.
* Ids that name no token (outside the vocabulary, or a gap in the tiktoken ranks) decode to
  the empty string instead of raising: a model whose embedding is padded past the tokenizer
  can sample them.
* Inputs longer than 25,000 characters are cut before the tiktoken regex into pieces with at
  most 25,000 consecutive whitespace or non-whitespace characters (and 400,000 characters in
  all), as the K3 tokenizer does, so the regex never runs on pathological input.
"""

from __future__ import annotations

import base64
import codecs
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

NUM_CONTROL_SLOTS = 256
"""K3 reserves the last 256 ids of its vocabulary (163,584 ranks + 256 = 163,840)."""

K3_CONTROL_SLOTS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
"""Named control tokens by offset from the first control id (``vocab_size - 256``)."""

BUNDLE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model",
                "special_tokens_map.json", "generation_config.json", "config.json")
"""Files a tokenizer bundle may carry, in this order."""

# The Kimi pre-tokenizer: o200k-style word/number/punctuation/space splitting, with runs of
# Han characters as their own alternative (first) and Han left out of the letter classes.
_NOT_HAN = r"&&[^\p{Han}]"
_CASED_HEAD = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _NOT_HAN + "]"
_CASED_TAIL = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _NOT_HAN + "]"
_SUFFIXES = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        _LEAD + _CASED_HEAD + "*" + _CASED_TAIL + "+" + _SUFFIXES,
        _LEAD + _CASED_HEAD + "+" + _CASED_TAIL + "*" + _SUFFIXES,
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
"""Pre-tokenizer regex of the K3 tiktoken tokenizer (syntax of tiktoken's Rust regex)."""

MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def k3_control_tokens(vocab_size: int) -> dict[int, str]:
    """id -> name of the 256 control tokens at the end of a K3-layout vocabulary."""
    first = vocab_size - NUM_CONTROL_SLOTS
    if first < 0:
        raise ValueError(f"vocab_size {vocab_size} < {NUM_CONTROL_SLOTS} control slots")
    return {first + i: K3_CONTROL_SLOTS.get(i, f"<|reserved_token_{first + i}|>") for i in range(NUM_CONTROL_SLOTS)}


def _token_name(value) -> str | None:
    """A tokenizer_config token entry: a plain string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Detokenizer:
    """Incremental decoder: ``add(ids)`` returns the text completed by these ids.

    Bytes of an unfinished UTF-8 character are kept until a later token completes it;
    :meth:`flush` ends the stream (an unfinished character becomes U+FFFD). Bytes that can
    never form a character are replaced by U+FFFD as soon as that is certain. ``text`` is all
    text returned so far (unless ``keep_text=False``: then each call costs only its own ids,
    and ``text`` stays empty).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, keep_text: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._keep = keep_text
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, ids: Iterable[int] | int) -> str:
        if isinstance(ids, int):
            ids = (ids,)
        out = []
        special = self._tok._id_to_special
        for i in ids:
            i = int(i)
            name = special.get(i)
            if name is None:
                out.append(self._utf8.decode(self._tok.token_bytes(i)))
            elif not self._skip:
                # A control token ends any unfinished character before it.
                out.append(self._utf8.decode(b"", final=True))
                self._utf8.reset()
                out.append(name)
        s = "".join(out)
        if self._keep:
            self.text += s
        return s

    def flush(self) -> str:
        s = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        if self._keep:
            self.text += s
        return s


class Tokenizer:
    """Common interface; the backends supply ordinary-text encoding and token bytes."""

    backend = "base"

    def __init__(self, model_dir: Path, control_tokens: dict[int, str], vocab_size: int):
        self.model_dir = Path(model_dir)
        self.config = _read_json(self.model_dir / "tokenizer_config.json")
        self._id_to_special = dict(control_tokens)
        self.special_tokens: dict[str, int] = {name: i for i, name in sorted(control_tokens.items())}
        self.vocab_size = max([vocab_size] + [i + 1 for i in control_tokens])
        names = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names)) if names else None

        model_cfg = _read_json(self.model_dir / "config.json")
        text_cfg = model_cfg.get("text_config") if isinstance(model_cfg.get("text_config"), dict) else {}

        def from_model_config(key: str) -> int | None:
            for cfg in (model_cfg, text_cfg):
                v = cfg.get(key + "_token_id")
                if isinstance(v, list):
                    v = v[0] if v else None
                if isinstance(v, int):
                    return v
            return None

        def pick(key: str) -> int | None:
            name = _token_name(self.config.get(key + "_token"))
            from_tok = self.special_tokens.get(name) if name else None
            if key == "eos":  # the model's stop token wins (see the module docstring)
                v = from_model_config(key)
                return v if v is not None else from_tok
            return from_tok if from_tok is not None else from_model_config(key)

        self.bos_token_id = pick("bos")
        self.eos_token_id = pick("eos")
        self.pad_token_id = pick("pad")
        unk = _token_name(self.config.get("unk_token"))
        self.unk_token_id = self.special_tokens.get(unk) if unk else None
        tmpl = self.config.get("chat_template")
        self.chat_template: str | None = tmpl if isinstance(tmpl, str) else None
        mml = self.config.get("model_max_length")
        self.model_max_length: int | None = int(mml) if isinstance(mml, (int, float)) and mml < 1e15 else None
        self.files: list[Path] = [self.model_dir / f for f in BUNDLE_FILES if (self.model_dir / f).is_file()]

    # -- to be supplied by backends ------------------------------------------------------
    def _encode_ordinary(self, text: str) -> list[int]:
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of an ordinary token (b"" for control tokens and unknown ids)."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; control-token strings stay text unless ``allow_special``."""
        if not allow_special or self._special_re is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                ids += self._encode_ordinary(text[pos : m.start()])
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._encode_ordinary(text[pos:])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        d = Detokenizer(self, skip_special_tokens)
        return d.add(ids) + d.flush()

    def detokenizer(self, skip_special_tokens: bool = False, keep_text: bool = True) -> Detokenizer:
        return Detokenizer(self, skip_special_tokens, keep_text)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._id_to_special

    def id_to_token(self, token_id: int) -> str | None:
        """Control-token name, or the token's text (bytes decoded with replacement)."""
        name = self._id_to_special.get(int(token_id))
        return name if name is not None else self.token_bytes(token_id).decode("utf-8", "replace")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.backend} vocab={self.vocab_size} dir={self.model_dir}>"


class SentencePieceTokenizer(Tokenizer):
    """``tokenizer.model`` (sentencepiece); control tokens from ``tokenizer_config.json``.

    Pieces of type CONTROL/UNKNOWN in the model are control tokens too, so sentencepiece
    never produces them from text.
    """

    backend = "sentencepiece"

    def __init__(self, model_dir: Path):
        import sentencepiece as spm

        model_dir = Path(model_dir)
        self._sp = spm.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
        n = self._sp.get_piece_size()
        control: dict[int, str] = {}
        self._bytes: list[bytes] = []
        for i in range(n):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                self._bytes.append(bytes([int(piece[3:5], 16)]))
            elif self._sp.is_control(i) or self._sp.is_unknown(i) or self._sp.is_unused(i):
                self._bytes.append(b"")
                control[i] = piece
            else:
                self._bytes.append(piece.replace("\u2581", " ").encode("utf-8"))
        control.update(_added_tokens(_read_json(model_dir / "tokenizer_config.json")))
        for i in control:
            if i < n:
                self._bytes[i] = b""
        super().__init__(model_dir, control, n)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int) if text else []

    def token_bytes(self, token_id: int) -> bytes:
        token_id = int(token_id)
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""


class TiktokenTokenizer(Tokenizer):
    """K3 release tokenizer: ``tiktoken.model`` ranks + control tokens above them."""

    backend = "tiktoken"

    def __init__(self, model_dir: Path, pat_str: str = KIMI_PAT_STR):
        import tiktoken

        model_dir = Path(model_dir)
        ranks = load_tiktoken_ranks(model_dir / "tiktoken.model")
        n_ranks = max(ranks.values()) + 1 if ranks else 0
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        control = _added_tokens(tok_cfg)
        model_cfg = _read_json(model_dir / "config.json")
        vocab = model_cfg.get("vocab_size") or (model_cfg.get("text_config") or {}).get("vocab_size")
        # Every slot between the ranks and the end of the vocabulary is a control token.
        end = max([n_ranks + NUM_CONTROL_SLOTS] + [i + 1 for i in control] + ([int(vocab)] if isinstance(vocab, int) else []))
        for i in range(n_ranks, end):
            control.setdefault(i, f"<|reserved_token_{i}|>")
        self._enc = tiktoken.Encoding(
            name=f"k3-{model_dir.name}",
            pat_str=pat_str,
            mergeable_ranks=ranks,
            special_tokens={name: i for i, name in control.items()},
        )
        self._bytes = {r: b for b, r in ranks.items()}
        super().__init__(model_dir, control, end)

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _bounded_pieces(text):
            ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes.get(int(token_id), b"")


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: ``<base64 token> <rank>`` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a '<base64> <rank>' line") from e
    return ranks


def _added_tokens(tok_cfg: dict) -> dict[int, str]:
    out: dict[int, str] = {}
    decoder = tok_cfg.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for k, v in decoder.items():
            name = _token_name(v)
            if name is not None and str(k).lstrip("-").isdigit():
                out[int(k)] = name
    return out


def _bounded_pieces(text: str) -> Iterator[str]:
    """Cut ``text`` so no piece exceeds MAX_ENCODE_CHARS characters or has a run longer than
    MAX_RUN_CHARS of only-whitespace or only-non-whitespace characters."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start : start + MAX_ENCODE_CHARS]
        if len(chunk) <= MAX_RUN_CHARS:
            yield chunk
            continue
        cut, run, prev = 0, 0, None
        for i, ch in enumerate(chunk):
            ws = ch.isspace()
            run = run + 1 if ws == prev else 1
            prev = ws
            if run > MAX_RUN_CHARS:
                yield chunk[cut:i]
                cut, run = i, 1
        yield chunk[cut:]


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer a checkpoint folder ships, or None when it has none we can read.

    ``tiktoken.model`` wins over ``tokenizer.model`` (a K3 release folder has only the
    former). A folder with only ``tokenizer.json`` returns None (the Hugging Face
    ``tokenizers`` runtime is not a dependency).
    """
    d = Path(model_dir)
    if (d / "tiktoken.model").is_file():
        return TiktokenTokenizer(d)
    if (d / "tokenizer.model").is_file():
        return SentencePieceTokenizer(d)
    return None
