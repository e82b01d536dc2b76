"""Constrained decoding (xgrammar), logit bias and token_ids_logprob through the engine, on the
tiny text model (random weights, the demo tokenizer's real vocabulary): outputs that parse and
validate against 20 JSON schemas, greedy and sampled; regex and EBNF outputs in their
language; constrained and free rows in one step without touching each other or the program
count; bad grammars refused with nothing changed; speculation leaves constrained rows alone."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from _json_schema_check import problems
from _util import assert_all_free, tiny_text_checkpoint

from k3serve.server.structured.xgrammar_native import available

pytestmark = pytest.mark.skipif(not available(), reason="xgrammar is not installed (make install does it)")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}},
        "required": ["id", "roles"]}}, "required": ["user"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -100, "maximum": 100},
                                      "y": {"type": "integer", "minimum": -100, "maximum": 100}},
     "required": ["kind", "x", "y"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5},
                                                                 "v": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["k", "v"]}, "maxItems": 3},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "enum": ["none"]}]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "null"},
    {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
     "required": ["a"]},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temp", "unit"]},
    {"type": "boolean"},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 3}},
     "required": ["tags", "count"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "assignee": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
     "required": ["status", "priority", "assignee"]},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
     "maxItems": 2},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "rate": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["code", "rate"]},
    {"type": "object", "properties": {"function": {"enum": ["get_weather", "get_time"]},
                                      "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                                    "required": ["city"]}},
     "required": ["function", "arguments"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from k3serve.server.engine.llm import LLM

    return LLM(tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt")), max_num_seqs=8, max_num_batched_tokens=64,
               chunk_size=32, page_size=16, max_model_len=256)


def _sp(**kw):
    from k3serve.server.engine.sampling_params import SamplingParams

    return SamplingParams(**kw)


def _prompt(llm, text="Answer in JSON please:"):
    return llm.engine.tokenizer.encode(text)


def _text(llm, out) -> str:
    """The output without its stop token (eos)."""
    ids = list(out.token_ids)
    if out.finish_reason == "stop" and ids and ids[-1] == llm.engine.model.config.eos_token_id:
        ids = ids[:-1]
    return llm.engine.tokenizer.decode(ids)


def test_json_schema_outputs_parse_and_validate(llm):
    """20 schemas, each greedy and sampled (seeded), all in one continuously batched run."""
    assert len(SCHEMAS) == 20
    params = [_sp(max_new_tokens=160, temperature=t, seed=11 + i, json_schema=json.dumps(s))
              for i, s in enumerate(SCHEMAS) for t in (0.0, 1.0)]
    outs = llm.generate([_prompt(llm)] * len(params), params)
    for i, out in enumerate(outs):
        schema = SCHEMAS[i // 2]
        text = _text(llm, out)
        assert out.finish_reason == "stop", (i, out.finish_reason, text)
        value = json.loads(text)
        assert not problems(value, schema), (i, text, problems(value, schema))
    assert_all_free(llm.engine)


def test_regex_and_ebnf_outputs_are_in_their_language(llm):
    cases = [(dict(regex=r"[0-9]{3}-[a-z]{2,4}"), r"[0-9]{3}-[a-z]{2,4}"),
             (dict(regex=r"(yes|no)(, because [a-z ]{1,12})?"), r"(yes|no)(, because [a-z ]{1,12})?"),
             (dict(ebnf='root ::= "move " dir " " num\ndir ::= "left" | "right"\nnum ::= [1-9] [0-9]?'),
              r"move (left|right) [1-9][0-9]?"),
             (dict(ebnf='root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'), r"\[[a-c](,[a-c])*\]")]
    params = [_sp(max_new_tokens=60, temperature=t, seed=3, **c) for c, _ in cases for t in (0.0, 1.0)]
    outs = llm.generate([_prompt(llm, "Say something")] * len(params), params)
    for i, out in enumerate(outs):
        text = _text(llm, out)
        assert out.finish_reason == "stop" and re.fullmatch(cases[i // 2][1], text), (i, out.finish_reason, text)


def test_constrained_and_free_rows_share_steps_without_new_programs(llm):
    """A free greedy row's tokens are the same with constrained rows beside it, and serving
    grammars compiles no program warm-up did not."""
    prompt = _prompt(llm, "The weather today is")
    alone = llm.generate(prompt, _sp(max_new_tokens=24, temperature=0))[0].token_ids
    before = llm.engine.num_compiles
    mixed = llm.generate([prompt] * 4, [_sp(max_new_tokens=24, temperature=0),
                                        _sp(max_new_tokens=40, temperature=0, regex="[a-z]{5,30}"),
                                        _sp(max_new_tokens=60, temperature=1.0, seed=2, json_schema=json.dumps(SCHEMAS[0])),
                                        _sp(max_new_tokens=24, temperature=0)])
    assert mixed[0].token_ids == alone and mixed[3].token_ids == alone
    assert re.fullmatch("[a-z]{5,30}", _text(llm, mixed[1]))
    assert llm.engine.num_compiles == before
    # every sampling program warm-up compiled takes the bitmask (int32[rows, ceil(V / 32)]): the
    # same programs `k3serve compile` lowers for tpu7x (tests/test_compile_cli.py)
    import jax

    V = llm.engine.model.config.vocab_size
    for R, exe in llm.engine.runner._compiled_sample.items():
        args = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(exe.args_info)]
        assert ((R, -(-V // 32)), "int32") in args, (R, args)


def test_bad_grammars_are_refused_and_change_nothing(llm):
    from k3serve.server.engine.request import RequestError

    eng = llm.engine
    before = (eng.num_compiles, len(eng.requests))
    for bad in (dict(json_schema='{"type":'), dict(json_schema='{"type": "no-such-type"}'), dict(regex="a("),
                dict(ebnf="root ::= undefined_rule"), dict(structural_tag='{"not": "a tag"}')):
        with pytest.raises(RequestError) as e:
            eng.add_request(_prompt(llm), _sp(max_new_tokens=4, **bad))
        assert "does not compile" in str(e.value), e.value
    with pytest.raises(ValueError):
        _sp(regex="a", ebnf='root ::= "a"')  # one constraint per request
    assert (eng.num_compiles, len(eng.requests)) == before
    assert_all_free(eng)
    out = llm.generate(_prompt(llm), _sp(max_new_tokens=8, temperature=0, regex="ok|fine"))[0]
    assert _text(llm, out) in ("ok", "fine")


def test_logit_bias_and_token_ids_logprob(llm):
    from k3serve.server.engine.request import OutOfRangeError

    prompt = _prompt(llm, "Once upon a time")
    base = llm.generate(prompt, _sp(max_new_tokens=6, temperature=0, logprobs=5))[0]
    first = base.token_ids[0]
    banned = llm.generate(prompt, _sp(max_new_tokens=6, temperature=0, logit_bias={first: -100}))[0]
    assert banned.token_ids[0] != first
    forced = llm.generate(prompt, _sp(max_new_tokens=6, temperature=0.8, seed=1, logit_bias={1234: 100}))[0]
    assert forced.token_ids == [1234] * 6
    # token_ids_logprob: the raw log-probs of the asked ids at every position, whatever was sampled
    alts = [a for a, _ in base.logprobs[0][1]]
    asked = llm.generate(prompt, _sp(max_new_tokens=6, temperature=0, token_ids_logprob=alts[:3]))[0]
    assert asked.token_ids == base.token_ids and len(asked.id_logprobs) == 6
    want = dict(base.logprobs[0][1])
    for tid, lp in asked.id_logprobs[0]:
        assert abs(lp - want[tid]) < 1e-5
    V = llm.engine.model.config.vocab_size
    for bad in (dict(logit_bias={V: 1.0}), dict(token_ids_logprob=[V + 3])):
        with pytest.raises(OutOfRangeError):
            llm.engine.add_request(prompt, _sp(max_new_tokens=4, **bad))
    assert_all_free(llm.engine)


def test_speculation_leaves_constrained_rows_undrafted(tmp_path_factory):
    """An n-gram speculating engine: constrained requests get no drafts (their matcher sees each
    token before the next is sampled) and still validate; a free request beside them speculates."""
    from k3serve.server.engine.llm import LLM

    llm = LLM(tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt")), max_num_seqs=4, max_num_batched_tokens=64,
              chunk_size=32, page_size=16, max_model_len=256,
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    rep = llm.engine.tokenizer.encode("a b c d a b c d a b c d a b c d")
    outs = llm.generate([rep, rep], [_sp(max_new_tokens=80, temperature=0, json_schema=json.dumps(SCHEMAS[7])),
                                     # forced to repeat one id (a logit bias): the n-gram drafter proposes
                                     _sp(max_new_tokens=24, temperature=0, logit_bias={1234: 100})])
    assert not problems(json.loads(_text(llm, outs[0])), SCHEMAS[7])
    assert outs[0].spec_draft_tokens == 0 and outs[1].spec_draft_tokens > 0
    assert outs[1].token_ids == [1234] * 24
    assert_all_free(llm.engine)


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_grammars_walk_each_vocabulary(kind, tmp_path):
    """The K3 release's format (tiktoken BPE: multi-byte merges, UTF-8 split across tokens,
    control tokens after the ranks; Kimi Linear ships the same format) and the demo's
    sentencepiece: a JSON text and a tool-call section, tokenized as the model would emit them,
    are accepted token by token, each token is in the bitmask the matcher gave before it, and
    the stop id ends the grammar."""
    import numpy as np

    from test_tokenizer import TINY_MERGES, _write_tiny_tiktoken

    from k3serve.server.structured.grammar import Constraint, GrammarCompiler
    from k3serve.server.text.demo_tokenizer import write_demo_tokenizer
    from k3serve.server.text.tokenizer import load_tokenizer

    if kind == "tiktoken":
        n = _write_tiny_tiktoken(tmp_path, TINY_MERGES)
        tok, V, eos = load_tokenizer(tmp_path), n + 256, n + 2
    else:
        write_demo_tokenizer(tmp_path)
        tok = load_tokenizer(tmp_path)
        V, eos = tok.vocab_size, tok.eos_token_id
    comp = GrammarCompiler.from_tokenizer(tok, V, [eos])
    schema = {"type": "object", "properties": {"greeting": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["greeting", "n"]}
    cases = [(Constraint("json_schema", json.dumps(schema)), '{"greeting": "hello world 你好 🎉", "n": 42}', False),
             (Constraint("regex", r"<\|open\|>call [a-z]+<\|close\|>"), "<|open|>call hello<|close|>", True)]
    for c, text, special in cases:
        m = comp.matcher(c, [eos])
        ids = tok.encode(text, allow_special=special) + [eos]
        mask = np.zeros((1, -(-V // 32)), np.int32)
        for t in ids:
            m.fill(mask, 0)
            assert (mask[0, t // 32] >> (t % 32)) & 1, (kind, c.kind, t, tok.id_to_token(t))
            assert m.accept(t), (kind, c.kind, t)
        assert m.terminated


def test_a_thinking_prompt_constrains_only_the_answer(llm):
    """A prompt that opens the think block (K3's thinking mode) gets a gated matcher: every id
    is allowed while the model reasons, the grammar starts after ``<|open|>response<|sep|>``
    and ends the request at eos; a prompt without thinking is constrained from its first token."""
    import numpy as np

    from k3serve.server.text.chat import Segment, _close, _open, encode_chat, encode_segments, thinking_gate

    eng, tok = llm.engine, llm.engine.tokenizer
    V, eos = eng.model.config.vocab_size, eng.model.config.eos_token_id
    msgs = [{"role": "user", "content": "Give me JSON."}]
    think, plain = encode_chat(tok, msgs, thinking=True), encode_chat(tok, msgs, thinking=False)
    assert thinking_gate(tok, think) == b"<|open|>response<|sep|>" and thinking_gate(tok, plain) is None
    schema = json.dumps(SCHEMAS[3])
    m = eng._matcher(_sp(json_schema=schema), think)
    assert m.gate is not None and eng._matcher(_sp(json_schema=schema), plain).gate is None
    assert eng._matcher(_sp(structural_tag='{"format": {"type": "const_string", "value": "x"}}'), think).gate is None
    reasoning = encode_segments(tok, [Segment('Let me think {"no": json} here', False)] + _close("think"))
    opening = encode_segments(tok, _open("response"))
    answer = opening + tok.encode('{"ok": true}') + [eos]
    mask = np.zeros((1, -(-V // 32)), np.int32)
    for i, t in enumerate(reasoning + answer):
        m.fill(mask, 0)
        gated = i < len(reasoning) + len(opening)  # until <|open|>response<|sep|> is spelled
        assert (mask == -1).all() == gated, i
        assert (mask[0, t // 32] >> (t % 32)) & 1 and m.accept(t) and not (m.terminated and t != eos), i
    assert m.terminated
