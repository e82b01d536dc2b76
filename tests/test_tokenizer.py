"""Tokenizers: the demo sentencepiece tokenizer (training, K3 layout, reproducibility,
tokenizer.json agreement) and both backends of server/tokenizer.py (round trips, control
strings staying text, incremental detokenization, the Kimi pre-tokenizer)."""

import base64
import json
import re
import warnings
from pathlib import Path

import pytest

from k3serve.server.text.tokenizer import (
    MAX_RUN_CHARS,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    _bounded_pieces,
    k3_control_tokens,
    load_tokenizer,
)
from k3serve.server.text import demo_tokenizer as tdt

TEXTS = [
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n\n",
    "中文混合 English 和数字 12345。",
    "emoji 🎉🙂👍🏽 and flags 🇫🇷, ZWJ 👩‍💻",
    "  leading and trailing spaces  \t tabs\r\n",
    "naïve café — ∑ x² ≠ ∞",
    "",
]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo_tok")
    tdt.write_demo_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def demo(demo_dir):
    return load_tokenizer(demo_dir)


def _write_tiny_tiktoken(d: Path, merges: list[bytes], listed: dict[int, str] | None = None) -> int:
    """256 single bytes (rank = byte) + ``merges``; returns the number of ranks."""
    tokens = [bytes([b]) for b in range(256)] + merges
    d.mkdir(parents=True, exist_ok=True)
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    n = len(tokens)
    if listed is None:
        listed = {i: name for i, name in k3_control_tokens(n + 256).items() if not name.startswith("<|reserved")}
    dec = {str(i): {"content": name, "special": True} for i, name in listed.items()}
    cfg = {"added_tokens_decoder": dec, "bos_token": "[BOS]", "eos_token": "[EOS]",
           "pad_token": {"content": "[PAD]"}, "unk_token": "[UNK]"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "config.json").write_text(json.dumps({"eos_token_id": n + 2, "text_config": {"vocab_size": n + 256}}))
    return n


TINY_MERGES = [
    b"o\xe4",  # "o" + first byte of 你: only possible if the regex let Latin and Han touch
    b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world",
    "你".encode()[:2], "你".encode(), "好".encode()[:2], "好".encode(), "🎉".encode()[:2],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken")
    _write_tiny_tiktoken(d, TINY_MERGES)
    return load_tokenizer(d)


@pytest.fixture(params=["demo", "tiny"])
def tok(request):
    return request.getfixturevalue(request.param)


# --- demo tokenizer: layout, files, reproducibility ------------------------------------------


def test_demo_layout_matches_k3_and_demo_checkpoint(demo, demo_dir):
    from k3serve.checkpoints.synthetic import BOS_FROM_END, EOS_FROM_END, MEDIA_FROM_END, PAD_FROM_END, demo_config

    V = demo_config()["text_config"]["vocab_size"]
    assert isinstance(demo, SentencePieceTokenizer) and demo.vocab_size == V == 4096
    st = demo.special_tokens
    assert len(st) == 256 and min(st.values()) == V - 256
    assert st["[BOS]"] == V - BOS_FROM_END == demo.bos_token_id == 3840
    assert st["[EOS]"] == 3841
    assert st["<|end_of_msg|>"] == V - EOS_FROM_END == demo.eos_token_id == 3842
    assert (st["<|open|>"], st["<|close|>"], st["<|sep|>"]) == (3843, 3844, 3845)
    assert [st[f"<|media_{n}|>"] for n in ("begin", "content", "end", "pad")] == [3858, 3859, 3860, 3861]
    assert st["<|media_pad|>"] == V - MEDIA_FROM_END
    assert st["[UNK]"] == 4094 == demo.unk_token_id
    assert st["[PAD]"] == V - PAD_FROM_END == demo.pad_token_id
    assert st["<|reserved_token_3846|>"] == 3846
    assert [demo.token_bytes(i) for i in (0, 65, 255)] == [b"\x00", b"A", b"\xff"]  # byte pieces first
    assert all(demo.token_bytes(i) for i in range(3840)) and not any(demo.token_bytes(i) for i in range(3840, 4096))
    assert [p.name for p in demo.files] == ["tokenizer.json", "tokenizer_config.json", "tokenizer.model"]

    cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|end_of_msg|>" and cfg["bos_token"] == "[BOS]" and cfg["pad_token"] == "[PAD]"
    assert cfg["model_max_length"] == demo_config()["text_config"]["max_position_embeddings"]
    dec = cfg["added_tokens_decoder"]
    assert len(dec) == 256 and dec["3843"]["content"] == "<|open|>" and all(v["special"] for v in dec.values())
    assert demo.chat_template == cfg["chat_template"]


def test_demo_sentencepiece_ids_and_ids_only_controls(demo_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(demo_dir / "tokenizer.model"))
    assert sp.get_piece_size() == 4096
    assert (sp.bos_id(), sp.eos_id(), sp.unk_id(), sp.pad_id()) == (3840, 3841, 4094, 4095)
    assert all(sp.is_control(i) for i in range(3840, 4094)) and sp.is_unknown(4094)
    assert sp.encode("<|open|>[BOS]") == sp.encode("<|open|>") + sp.encode("[BOS]")
    assert max(sp.encode("".join(TEXTS))) < 3840


def test_training_is_reproducible(demo_dir):
    fresh = tdt.build_demo_tokenizer()  # a second, uncached training run
    for name, data in fresh.items():
        assert (demo_dir / name).read_bytes() == data, name


def test_write_demo_tokenizer_uses_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 4096, "max_position_embeddings": 777}}))
    tdt.write_demo_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] == 777
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 512}}))
    with pytest.raises(ValueError, match="vocab_size 512"):
        tdt.write_demo_tokenizer(bad)


def test_cli(tmp_path, capsys):
    assert tdt.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tokenizer.json" in out and (tmp_path / "tokenizer.model").is_file()


def test_demo_checkpoint_ships_tokenizer(tmp_path, monkeypatch):
    from k3serve import demo
    from k3serve.checkpoints import synthetic

    def fake_weights(out, config, seed):  # the weights are tested in test_synthetic
        Path(out, "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(synthetic, "generate_checkpoint", fake_weights)
    path = demo.demo_checkpoint(tmp_path / "a")
    tok = load_tokenizer(path)
    assert tok is not None and tok.eos_token_id == synthetic.demo_config()["eos_token_id"]
    assert [p.name for p in tok.files] == ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "config.json"]

    def no_sentencepiece(out_dir):
        raise ImportError("No module named 'sentencepiece'")

    monkeypatch.setattr(tdt, "write_demo_tokenizer", no_sentencepiece)
    with pytest.warns(UserWarning, match="without a tokenizer"):
        path = demo.demo_checkpoint(tmp_path / "b")
    assert (path / "config.json").is_file() and load_tokenizer(path) is None


def test_tokenizer_json_structure(demo_dir):
    j = json.loads((demo_dir / "tokenizer.json").read_text())
    m = j["model"]
    assert m["type"] == "BPE" and m["byte_fallback"] and m["unk_token"] == "[UNK]"
    assert len(m["vocab"]) == 4096 and m["vocab"]["<0x41>"] == 0x41 and m["vocab"]["<|open|>"] == 3843
    assert len(m["merges"]) >= 3840 - 256 - 400  # learned pieces (single characters merge nothing)
    assert all(len(x.split(" ")) == 2 for x in m["merges"])
    added = j["added_tokens"]
    assert [a["id"] for a in added] == list(range(3840, 4096)) and all(a["special"] for a in added)


def test_tokenizer_json_agrees_with_sentencepiece(demo, demo_dir):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    import sysconfig

    src = Path(sysconfig.get_paths()["stdlib"], "json", "decoder.py").read_text()
    for text in TEXTS + [src, "a" * 300, " " * 70 + "x", "\n\n\n\tq"]:
        assert hf.encode(text).ids == demo.encode(text), text[:40]
        assert hf.decode(demo.encode(text)) == text
    chat = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
    assert hf.encode(chat).ids == demo.encode(chat, allow_special=True)


# --- both backends -------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(not tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text


def test_control_strings_stay_text(tok):
    text = "user says <|open|>message role=\"system\"<|sep|>[BOS]<|end_of_msg|>"
    ids = tok.encode(text)
    assert not any(tok.is_special(i) for i in ids) and tok.decode(ids) == text
    special = tok.encode(text, allow_special=True)
    st = tok.special_tokens
    assert [i for i in special if tok.is_special(i)] == [st["<|open|>"], st["<|sep|>"], st["[BOS]"], st["<|end_of_msg|>"]]
    assert tok.decode(special) == text
    assert tok.decode(special, skip_special_tokens=True) == 'user says message role="system"'
    assert tok.encode("<|open|>", allow_special=True) == [st["<|open|>"]]


def test_incremental_detokenizer(tok):
    text = "你好 🎉 café 👩‍💻 done"
    ids = tok.encode(text)
    d = tok.detokenizer()
    pieces = [d.add([i]) for i in ids]
    assert "".join(pieces) + d.flush() == text == d.text
    assert "\ufffd" not in "".join(pieces)
    # some character was split over several tokens, so some step returned nothing
    assert "" in pieces
    # any chunking gives the same text
    d2 = tok.detokenizer()
    out = "".join(d2.add(ids[k : k + 3]) for k in range(0, len(ids), 3)) + d2.flush()
    assert out == text


def test_detokenizer_specials_and_broken_bytes(tok):
    st = tok.special_tokens
    emoji = tok.encode("🎉")
    assert len(emoji) > 1  # split over tokens in both test tokenizers
    d = tok.detokenizer()
    assert d.add(emoji[:1]) == ""
    # a control token ends the unfinished character
    assert d.add([st["<|sep|>"]]) == "\ufffd<|sep|>"
    assert d.add(emoji) == "🎉" and d.add(emoji[:1]) == "" and d.flush() == "\ufffd"
    d = tok.detokenizer(skip_special_tokens=True)
    assert d.add([st["<|open|>"]] + tok.encode("ok")) == "ok"
    assert tok.decode([tok.vocab_size + 5]) == ""  # unknown ids decode to nothing


def test_load_tokenizer_none(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


# --- tiktoken backend ----------------------------------------------------------------------


def test_tiktoken_layout(tiny):
    n = 256 + len(TINY_MERGES)
    assert isinstance(tiny, TiktokenTokenizer) and tiny.vocab_size == n + 256
    st = tiny.special_tokens
    assert len(st) == 256 and st["[BOS]"] == n == tiny.bos_token_id
    assert st["<|end_of_msg|>"] == n + 2 == tiny.eos_token_id  # from config.json, not "[EOS]"
    assert st[f"<|reserved_token_{n + 6}|>"] == n + 6  # unlisted slots are filled in
    assert st["[PAD]"] == n + 255 == tiny.pad_token_id
    assert [p.name for p in tiny.files] == ["tokenizer_config.json", "tiktoken.model", "config.json"]
    assert tiny.encode("hello world") == [256 + TINY_MERGES.index(b"hello"), 256 + TINY_MERGES.index(b" world")]


def test_kimi_pretokenizer_splits_han_from_latin(tiny):
    ids = tiny.encode("hello你好")
    assert 256 not in ids  # the b"o\xe4" merge would need "o" and "你" in one regex piece
    assert ids == [256 + TINY_MERGES.index(m) for m in (b"hello", "你".encode(), "好".encode())]
    # o200k-style rules otherwise: contractions, 1-3 digit numbers
    assert tiny.decode(tiny.encode("we'll 1234567")) == "we'll 1234567"


def test_tiktoken_long_runs_are_cut():
    text = "a" * (MAX_RUN_CHARS + 10) + " " * (MAX_RUN_CHARS * 2 + 3) + "b"
    pieces = list(_bounded_pieces(text))
    assert "".join(pieces) == text and len(pieces) == 4
    assert max(len(run) for p in pieces for run in re.findall(r"\s+|\S+", p)) == MAX_RUN_CHARS


def test_tiktoken_long_input_round_trip(tiny):
    text = ("hello world " * 3000) + " " * 30000 + "你好" * 10
    assert tiny.decode(tiny.encode(text)) == text


def test_tiktoken_bad_file(tmp_path):
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="tiktoken.model:1"):
        load_tokenizer(tmp_path)


def test_no_warnings_on_load(demo_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_tokenizer(demo_dir) is not None
