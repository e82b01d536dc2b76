"""Train the demo checkpoint's tokenizer: a small sentencepiece BPE in the K3 vocabulary layout.

Why: the demo checkpoint (vocab 4096, ``checkpoints/synthetic.py``) needs a real tokenizer so
that text, chat requests and routers (``smg`` loads ``tokenizer.json`` +
``tokenizer_config.json``) work end to end without downloading anything. The corpus is the
Python standard library's own ``.py`` sources, which every machine has offline.

    python -m k3serve.server.text.demo_tokenizer --out DIR

Layout (matches the K3 release, scaled to V = 4096): ids 0..255 are the byte-fallback pieces
``<0x00>``..``<0xFF>``, 256..3839 the learned BPE pieces, and the 256 control slots
3840..4095 follow K3 (``server.tokenizer.k3_control_tokens``): ``[BOS]`` 3840, ``[EOS]`` 3841,
``<|end_of_msg|>`` 3842 (eos), ``<|open|>`` 3843, ``<|close|>`` 3844, ``<|sep|>`` 3845,
``<|media_begin|>`` 3858 .. ``<|media_pad|>`` 3861, ``[UNK]`` 4094, ``[PAD]`` 4095, the rest
``<|reserved_token_<id>|>``.

Files written by :func:`write_demo_tokenizer`:

* ``tokenizer.model``: the sentencepiece model. Trained without a dummy prefix, without
  whitespace folding and without Unicode normalization, so decode(encode(text)) == text. Its
  control slots are sentencepiece CONTROL pieces (``[UNK]`` the UNKNOWN piece), so
  sentencepiece never produces them from text.
* ``tokenizer.json``: the same tokenizer in the Hugging Face ``tokenizers`` format, derived
  from the model (BPE with byte fallback; merges ordered by the score of the merged piece;
  spaces replaced by U+2581 in the normalizer; no pre-tokenizer; decoder U+2581 -> space,
  byte fallback, fuse; the 256 control tokens as special ``added_tokens``).
* ``tokenizer_config.json``: special tokens (eos ``<|end_of_msg|>``), ``model_max_length``,
  ``added_tokens_decoder`` and a Jinja ``chat_template`` that renders exactly the K3 chat
  program of ``server/chat.py`` for system/user/assistant messages (thinking off unless the
  template variable ``thinking`` is true).

Reproducibility: the corpus is a sorted, size-capped list of files and training runs on one
thread without sampling, so the same Python installation gives byte-identical files (another
Python version has other stdlib sources and so another, equally valid, tokenizer). Training
takes about a second or two; results are memoized per process and cached by the caller (the
demo checkpoint folder).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import struct
import sys
import sysconfig
import time
from pathlib import Path

from k3serve.server.text.tokenizer import K3_CONTROL_SLOTS, NUM_CONTROL_SLOTS, k3_control_tokens

DEMO_VOCAB_SIZE = 4096
CORPUS_BYTES = 3_000_000
"""About 3 MB of stdlib sources: enough for 3,584 merges, about a second of training."""
MAX_SENTENCE_BYTES = 2000
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}

# sentencepiece piece types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def demo_corpus(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Training sentences: the stdlib's ``.py`` files in sorted path order (tests and
    site-packages left out) until ``max_bytes``, cut at line ends into pieces of at most
    ~2 KB (sentencepiece skips longer sentences). Newlines are kept in the text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root).as_posix()
        for f in filenames:
            if f.endswith(".py"):
                found.append((f if rel == "." else f"{rel}/{f}", Path(dirpath, f)))
    paths = [p for _, p in sorted(found)]
    sentences: list[str] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text.encode("utf-8"))
        chunk: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            n = len(line.encode("utf-8"))
            if chunk and size + n > MAX_SENTENCE_BYTES:
                sentences.append("".join(chunk))
                chunk, size = [], 0
            if n <= MAX_SENTENCE_BYTES:
                chunk.append(line)
                size += n
        if chunk:
            sentences.append("".join(chunk))
    if not sentences:
        raise RuntimeError(f"no Python sources found under {root}")
    return sentences


# --------------------------------------------------------------------------------------------
# Training and relayout of the sentencepiece model
# --------------------------------------------------------------------------------------------


def train_sentencepiece(sentences: list[str], n_ordinary: int) -> bytes:
    """Raw sentencepiece BPE model: ``<unk>`` at id 0, then 256 byte pieces, then
    ``n_ordinary - 256`` learned pieces."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buf,
        model_type="bpe",
        vocab_size=n_ordinary + 1,  # + <unk>, moved to the [UNK] slot afterwards
        byte_fallback=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        max_sentence_length=4 * MAX_SENTENCE_BYTES,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return buf.getvalue()


# Minimal protobuf wire format, enough to edit a sentencepiece ModelProto without the
# generated module (sentencepiece's pb2 needs a newer protobuf runtime than the project pins).


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _parse(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """[(field number, wire type, value)]: int for varints, bytes otherwise."""
    out = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = _read_varint(buf, pos)
        elif wt == 1:
            val, pos = buf[pos : pos + 8], pos + 8
        elif wt == 2:
            n, pos = _read_varint(buf, pos)
            val, pos = buf[pos : pos + n], pos + n
        elif wt == 5:
            val, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        out.append((num, wt, val))
    return out


def _serialize(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for num, wt, val in fields:
        out += _varint(num << 3 | wt)
        if wt == 0:
            out += _varint(int(val))
        elif wt == 2:
            out += _varint(len(val)) + val
        else:
            out += val
    return bytes(out)


def _piece(text: str, score: float, ptype: int) -> bytes:
    fields = [(1, 2, text.encode("utf-8")), (2, 5, struct.pack("<f", score))]
    if ptype != _NORMAL:
        fields.append((3, 0, ptype))
    return _serialize(fields)


def read_pieces(model: bytes) -> list[tuple[str, float, int]]:
    """[(piece, score, type)] of a serialized sentencepiece ModelProto, in id order."""
    pieces = []
    for num, _, val in _parse(model):
        if num == 1:
            text, score, ptype = "", 0.0, _NORMAL
            for n, _, v in _parse(val):
                if n == 1:
                    text = v.decode("utf-8")
                elif n == 2:
                    score = struct.unpack("<f", v)[0]
                elif n == 3:
                    ptype = v
            pieces.append((text, score, ptype))
    return pieces


def relayout(raw_model: bytes, vocab_size: int) -> bytes:
    """Move ``<unk>`` out of id 0 and append the K3 control slots: ordinary pieces keep
    their order (and scores) at ids ``0..V-257``; ids ``V-256..V-1`` become control pieces
    named as in K3, with ``[UNK]`` as the unknown piece and the trainer spec's
    unk/bos/eos/pad ids and pieces pointed at ``[UNK]``/``[BOS]``/``[EOS]``/``[PAD]``."""
    fields = _parse(raw_model)
    pieces = [val for num, _, val in fields if num == 1]
    first = _parse(pieces[0])
    if not any(n == 3 and v == _UNKNOWN for n, _, v in first):
        raise ValueError("expected <unk> as piece 0 of the trained model")
    ordinary = pieces[1:]
    n_ordinary = vocab_size - NUM_CONTROL_SLOTS
    if len(ordinary) != n_ordinary:
        raise ValueError(f"trained {len(ordinary)} ordinary pieces, layout needs {n_ordinary}")
    control = k3_control_tokens(vocab_size)
    new_pieces = ordinary + [
        _piece(name, 0.0, _UNKNOWN if name == "[UNK]" else _CONTROL) for _, name in sorted(control.items())
    ]
    ids = {name: i for i, name in control.items()}
    spec_ids = {40: ids["[UNK]"], 41: ids["[BOS]"], 42: ids["[EOS]"], 43: ids["[PAD]"], 4: vocab_size}
    spec_pieces = {45: "[UNK]", 46: "[BOS]", 47: "[EOS]", 48: "[PAD]"}

    out: list[tuple[int, int, int | bytes]] = [(1, 2, p) for p in new_pieces]
    for num, wt, val in fields:
        if num == 1:
            continue
        if num == 2:  # TrainerSpec
            spec = [f for f in _parse(val) if f[0] not in spec_ids and f[0] not in spec_pieces]
            spec += [(k, 0, v) for k, v in spec_ids.items()]
            spec += [(k, 2, v.encode()) for k, v in spec_pieces.items()]
            val = _serialize(spec)
        out.append((num, wt, val))
    return _serialize(out)


# --------------------------------------------------------------------------------------------
# tokenizer.json / tokenizer_config.json
# --------------------------------------------------------------------------------------------


def tokenizer_json(model: bytes) -> dict:
    """Hugging Face ``tokenizers`` JSON equivalent to the sentencepiece model ``model``.

    Sentencepiece BPE merges, at each step, the adjacent pair whose concatenation is the
    highest-scoring piece. The equivalent merge list has one entry per way of splitting a
    learned piece into two ordinary pieces, ranked by the merged piece's score (then by the
    ids of the halves). Byte and control pieces take part in no merge.
    """
    pieces = read_pieces(model)
    vocab = {text: i for i, (text, _, _) in enumerate(pieces)}
    normal = {text: i for i, (text, _, t) in enumerate(pieces) if t == _NORMAL}
    merges = []
    for text, i in normal.items():
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in normal and right in normal:
                merges.append((-pieces[i][1], i, normal[left], normal[right], left, right))
    merges.sort()
    for *_, left, right in merges:
        if " " in left or " " in right:  # cannot happen: spaces are escaped to U+2581
            raise ValueError("piece with a space breaks the 'a b' merge format")
    added = [
        {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (text, _, t) in enumerate(pieces) if t in (_CONTROL, _UNKNOWN)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "[UNK]",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{left} {right}" for *_, left, right in merges],
        },
    }


def _chat_template() -> str:
    """Jinja rendering of the K3 chat program (``server/chat.py``) as one line of template
    text: no newline or blank outside ``{{ }}`` output, so whitespace control settings
    (trim_blocks / lstrip_blocks) cannot change the result."""
    esc = '|string|replace("&", "&amp;")|replace(\'"\', "&quot;")'
    t = [
        "{% macro text(c) %}{% if c is string %}{{ c }}{% elif c is not none %}"
        '{% for p in c %}{% if p.type == "text" %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}',
        # tool declarations (json.dumps in server/chat.py; tojson may sort keys / escape HTML)
        f'{{% if tools %}}{OPEN}message role="system" type="tool-declare"{SEP}{{{{ tools|tojson }}}}{CLOSE}message{SEP}{END}{{% endif %}}',
        "{% for message in messages %}",
        '{% set role = "system" if message.role == "developer" else message.role %}',
        f'{OPEN}message role="{{{{ role{esc} }}}}"'
        f'{{% if message.name is defined and message.name %}} name="{{{{ message.name{esc} }}}}"{{% endif %}}{SEP}',
        '{% if role == "assistant" %}',
        "{% if message.reasoning_content is defined and message.reasoning_content %}"
        f"{OPEN}think{SEP}{{{{ message.reasoning_content }}}}{CLOSE}think{SEP}{{% endif %}}",
        "{% set calls = message.tool_calls if message.tool_calls is defined and message.tool_calls else [] %}",
        '{% set content = text(message.content) if message.content is defined else "" %}',
        f"{{% if content or not calls %}}{OPEN}response{SEP}{{{{ content }}}}{CLOSE}response{SEP}{{% endif %}}",
        f"{{% if calls %}}{OPEN}tools{SEP}{{% for call in calls %}}",
        "{% set fn = call.function if call.function is defined else call %}",
        f'{OPEN}call tool="{{{{ fn.name{esc} }}}}" index="{{{{ loop.index0 }}}}"{SEP}',
        "{% if fn.arguments is mapping %}{% for key, value in fn.arguments.items() %}",
        f'{OPEN}argument key="{{{{ key{esc} }}}}" type="'
        '{% if value is string %}string{% elif value is boolean %}boolean{% elif value is none %}null'
        '{% elif value is number %}number{% elif value is mapping %}object{% else %}array{% endif %}"'
        f"{SEP}{{% if value is string %}}{{{{ value }}}}{{% else %}}{{{{ value|tojson }}}}{{% endif %}}{CLOSE}argument{SEP}",
        "{% endfor %}{% endif %}",
        f"{CLOSE}call{SEP}{{% endfor %}}{CLOSE}tools{SEP}{{% endif %}}",
        '{% else %}{{ text(message.content) if message.content is defined else "" }}{% endif %}',
        f"{CLOSE}message{SEP}{END}",
        "{% endfor %}",
        f'{{% if add_generation_prompt %}}{OPEN}message role="assistant"{SEP}'
        f"{{% if thinking is defined and thinking %}}{OPEN}think{SEP}{{% else %}}{OPEN}response{SEP}{{% endif %}}{{% endif %}}",
    ]
    return "".join(t)


CHAT_TEMPLATE = _chat_template()


def tokenizer_config(vocab_size: int, model_max_length: int) -> dict:
    control = k3_control_tokens(vocab_size)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[BOS]",
        "eos_token": END,
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "additional_special_tokens": [n for n in K3_CONTROL_SLOTS.values() if n not in ("[BOS]", "[PAD]", "[UNK]", END)],
        "added_tokens_decoder": {
            str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, name in sorted(control.items())
        },
        "chat_template": CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


DEMO_MODEL_MAX_LENGTH = 4096
"""``max_position_embeddings`` of the demo config; a ``config.json`` in the output folder wins."""


def build_demo_tokenizer(corpus_bytes: int = CORPUS_BYTES, vocab_size: int = DEMO_VOCAB_SIZE,
                         model_max_length: int = DEMO_MODEL_MAX_LENGTH) -> dict[str, bytes]:
    """Train and return ``{file name: content}`` (no caching)."""
    model = relayout(train_sentencepiece(demo_corpus(corpus_bytes), vocab_size - NUM_CONTROL_SLOTS), vocab_size)
    return {
        "tokenizer.model": model,
        "tokenizer.json": _dump(tokenizer_json(model)),
        "tokenizer_config.json": _dump(tokenizer_config(vocab_size, model_max_length)),
    }


def _dump(obj) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, indent=1) + "\n").encode("utf-8")


@functools.lru_cache(maxsize=2)
def _cached(corpus_bytes: int, vocab_size: int) -> dict[str, bytes]:
    return build_demo_tokenizer(corpus_bytes, vocab_size)


def _checkpoint_limits(out_dir: Path) -> tuple[int | None, int | None]:
    """(vocab_size, max_position_embeddings) of ``out_dir/config.json`` when it has them."""
    try:
        cfg = json.loads((out_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    text = cfg.get("text_config") if isinstance(cfg, dict) else None
    text = text if isinstance(text, dict) else (cfg if isinstance(cfg, dict) else {})
    vocab, max_len = text.get("vocab_size"), text.get("max_position_embeddings")
    return (vocab if isinstance(vocab, int) else None), (max_len if isinstance(max_len, int) else None)


def write_demo_tokenizer(out_dir: Path) -> None:
    """Write ``tokenizer.model``, ``tokenizer.json`` and ``tokenizer_config.json`` of the demo
    tokenizer into ``out_dir`` (trained once per process, then reused). When ``out_dir``
    already holds a checkpoint ``config.json``, its vocabulary must be the demo's 4096 and
    its ``max_position_embeddings`` becomes ``model_max_length``."""
    out_dir = Path(out_dir)
    vocab, max_len = _checkpoint_limits(out_dir)
    if vocab is not None and vocab != DEMO_VOCAB_SIZE:
        raise ValueError(f"{out_dir}/config.json has vocab_size {vocab}; the demo tokenizer has {DEMO_VOCAB_SIZE}")
    files = dict(_cached(CORPUS_BYTES, DEMO_VOCAB_SIZE))
    if max_len is not None and max_len != DEMO_MODEL_MAX_LENGTH:
        files["tokenizer_config.json"] = _dump(tokenizer_config(DEMO_VOCAB_SIZE, max_len))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        tmp = out_dir / f".{name}.tmp-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, out_dir / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3serve.server.text.demo_tokenizer", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder to write the tokenizer files into")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    write_demo_tokenizer(args.out)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        print(args.out / name, (args.out / name).stat().st_size)
    print(f"vocab_size: {DEMO_VOCAB_SIZE}  time: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
