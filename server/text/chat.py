"""K3 chat rendering ("render program") and parsing of generated assistant output.

Why this module exists: K3 ships no Jinja chat template. Its tokenizer turns messages into a
list of segments, each encoded separately: the four structural markers (``<|open|>``,
``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``) become control ids, while every piece of
message text, tag name and attribute value is ordinary text. A user who types
``"<|open|>"`` therefore gets the text, never the control token, and cannot inject chat
structure. This module reproduces that program and inverts it for generated output.

Grammar ("XTML")::

    open(t, k="v"...) := <|open|> t [ k="v"]* <|sep|>       close(t) := <|close|> t <|sep|>
    message   := open(message, role=R[, name=N][, type=T]) CONTENT close(message) <|end_of_msg|>
    assistant := [open(think) REASONING close(think)] [open(response) TEXT close(response)]
                 [open(tools) { open(call, tool=NAME, index=I)
                                { open(argument, key=K, type=TYPE) TEXT close(argument) }
                                close(call) } close(tools)]
    prompt    := ... open(message, role="assistant") open(think)      (thinking on, default)
                                                     | open(response)   (thinking off)

API: :func:`render_chat` -> list of :class:`Segment` ``(text, is_special)``;
:func:`encode_chat` -> token ids; :func:`decode_segments` turns generated ids back into
segments and :func:`parse_output` turns segments (or decoded text) into reasoning, answer and
OpenAI-style tool calls.

Choices where the public description of K3 is silent (UNCERTAIN upstream; simplest
consistent choice here, see docs/tokenizer-and-chat.md):

* Adjacent ordinary-text segments are joined and encoded as one string (so the Jinja
  template in ``tokenizer_config.json``, which produces one string, gives the same ids).
* Attribute values escape ``&`` -> ``&amp;`` and ``"`` -> ``&quot;`` only; attribute order is
  role, name, type (message) and tool, index (call), key, type (argument).
* No ``[BOS]`` token is prepended.
* Message ``content`` may be a string, None, or a list of ``{"type": "text", "text": ...}``
  parts, joined without separator; other parts (images) are rejected here. Role
  ``developer`` is rendered as ``system``.
* Tools are declared first, as one system message ``type="tool-declare"`` whose content is
  the request's ``tools`` list as JSON (Python's default separators ``", "``/``": "``, keys
  in the given order, non-ASCII kept).
* Assistant history: the think block is rendered when ``reasoning_content`` is non-empty (the
  client decides whether prior reasoning is kept); the response block when the content is
  non-empty or there are no tool calls. Call ``index`` counts from 0 within the message.
* Arguments (the OpenAI JSON string, or a dict) must be a JSON object; a string value is
  rendered as raw text with ``type="string"``, anything else as JSON (as above) with its type
  (``number``/``boolean``/``null``/``object``/``array``).
* Tool results: each is its own ``role="tool"`` message (with ``name`` only if the message
  has one). The run of tool messages after an assistant message is reordered to the order of
  that message's ``tool_calls`` (matched by ``tool_call_id``); unmatched ones keep their
  relative order after the matched ones.
* ``thinking_effort``: ``None``/``"max"`` (the default) adds nothing; other values become an
  ``effort`` attribute of the generation prompt's ``think`` tag.
* :func:`parse_output` returns only tool calls whose ``call`` block was closed (a call cut by
  the token limit is dropped), and text outside any block as content.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
ROLES = ("system", "user", "assistant", "tool")
THINKING_EFFORTS = ("low", "high", "max")


class Segment(NamedTuple):
    text: str
    is_special: bool


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open(tag: str, *attrs: tuple[str, Any]) -> list[Segment]:
    head = tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs if v is not None)
    return [Segment(OPEN, True), Segment(head, False), Segment(SEP, True)]


def _close(tag: str) -> list[Segment]:
    return [Segment(CLOSE, True), Segment(tag, False), Segment(SEP, True)]


def _block(tag: str, text: str, *attrs: tuple[str, Any]) -> list[Segment]:
    body = [Segment(text, False)] if text else []
    return _open(tag, *attrs) + body + _close(tag)


def _message(role: str, body: list[Segment], name: Any = None, type: str | None = None) -> list[Segment]:
    name = name if name not in (None, "") else None
    return _open("message", ("role", role), ("name", name), ("type", type)) + body + _close("message") + [
        Segment(END_OF_MSG, True)
    ]


def content_text(content: Any) -> str:
    """Message content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"unsupported message content part {kind!r} (text only)")
        return "".join(out)
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _arg_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ValueError(f"tool-call argument of unsupported type {type(value).__name__}")


def _call_parts(call: dict) -> tuple[str, dict]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool call without a function name: {call!r}")
    args = fn.get("arguments", {})
    if args is None or args == "":
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise ValueError(f"tool call {fn['name']!r}: arguments are not valid JSON") from e
    if not isinstance(args, dict):
        raise ValueError(f"tool call {fn['name']!r}: arguments must be a JSON object")
    return fn["name"], args


def _render_tool_calls(calls: Sequence[dict]) -> list[Segment]:
    segs = _open("tools")
    for index, call in enumerate(calls):
        name, args = _call_parts(call)
        segs += _open("call", ("tool", name), ("index", index))
        for key, value in args.items():
            kind = _arg_type(value)
            segs += _block("argument", value if kind == "string" else _json(value), ("key", key), ("type", kind))
        segs += _close("call")
    return segs + _close("tools")


def _assistant_body(msg: dict) -> list[Segment]:
    body: list[Segment] = []
    reasoning = msg.get("reasoning_content")
    if reasoning:
        body += _block("think", str(reasoning))
    calls = msg.get("tool_calls") or []
    text = content_text(msg.get("content"))
    if text or not calls:
        body += _block("response", text)
    if calls:
        body += _render_tool_calls(calls)
    return body


def order_tool_results(messages: Sequence[dict]) -> list[dict]:
    """Reorder each run of ``tool`` messages that follows an assistant message to the order
    of that message's ``tool_calls`` (by ``tool_call_id``); unmatched results go last."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        out.append(msg)
        i += 1
        if msg.get("role") != "assistant" or not msg.get("tool_calls"):
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        run = list(messages[i:j])
        order = {c.get("id"): k for k, c in enumerate(msg["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        run.sort(key=lambda m: order.get(m.get("tool_call_id"), len(order)))  # stable
        out += run
        i = j
    return out


def render_chat(
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    thinking_effort: str | None = None,
) -> list[Segment]:
    """Segments of the K3 prompt for OpenAI-style ``messages`` (and ``tools``)."""
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort must be one of {THINKING_EFFORTS}, not {thinking_effort!r}")
    segs: list[Segment] = []
    if tools:
        segs += _message("system", [Segment(_json(list(tools)), False)], type="tool-declare")
    for msg in order_tool_results(list(messages)):
        if not isinstance(msg, dict):
            raise ValueError(f"message must be a dict, not {type(msg).__name__}")
        role = msg.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise ValueError(f"unsupported message role {msg.get('role')!r}")
        if role == "assistant":
            body = _assistant_body(msg)
        else:
            text = content_text(msg.get("content"))
            body = [Segment(text, False)] if text else []
        segs += _message(role, body, name=msg.get("name"))
    if add_generation_prompt:
        segs += _open("message", ("role", "assistant"))
        if thinking:
            effort = None if thinking_effort in (None, "max") else thinking_effort
            segs += _open("think", ("effort", effort))
        else:
            segs += _open("response")
    return _join_text(segs)


def _join_text(segs: Iterable[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segs:
        if not s.is_special and not s.text:
            continue
        if out and not s.is_special and not out[-1].is_special:
            out[-1] = Segment(out[-1].text + s.text, False)
        else:
            out.append(s)
    return out


def segments_to_text(segments: Iterable[Segment]) -> str:
    """The prompt as one string (what a Jinja template renders)."""
    return "".join(s.text for s in segments)


def encode_segments(tokenizer, segments: Iterable[Segment]) -> list[int]:
    """Ids of segments: specials by name, text as ordinary text (control strings stay text)."""
    ids: list[int] = []
    for s in _join_text(segments):
        if s.is_special:
            try:
                ids.append(tokenizer.special_tokens[s.text])
            except KeyError:
                raise ValueError(f"tokenizer has no control token {s.text!r}") from None
        else:
            ids += tokenizer.encode(s.text, allow_special=False)
    return ids


def thinking_gate(tokenizer, prompt_ids: Sequence[int]) -> bytes | None:
    """For constrained decoding: a prompt that ends by opening the assistant's think block
    (``thinking`` on) is answered with free reasoning, then ``<|open|>response<|sep|>`` and the
    answer; the grammar applies to the answer, so it starts after that text (returned as bytes).
    None for any other prompt, or a tokenizer without the K3 markers."""
    try:
        opening = encode_segments(tokenizer, _open("think"))
    except (ValueError, AttributeError):
        return None
    if len(prompt_ids) < len(opening) or list(prompt_ids[-len(opening):]) != opening:
        return None
    return segments_to_text(_open("response")).encode()


def encode_chat(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    thinking: bool = True,
    add_generation_prompt: bool = True,
    thinking_effort: str | None = None,
) -> list[int]:
    """Token ids of :func:`render_chat` with ``tokenizer`` (``server.tokenizer.Tokenizer``)."""
    segs = render_chat(messages, tools, thinking=thinking, add_generation_prompt=add_generation_prompt,
                       thinking_effort=thinking_effort)
    return encode_segments(tokenizer, segs)


# --------------------------------------------------------------------------------------------
# Parsing generated output
# --------------------------------------------------------------------------------------------


@dataclass
class ParsedOutput:
    reasoning: str | None = None
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
_ATTR_RE = re.compile(r'([^\s="]+)="([^"]*)"')


def split_markers(text: str) -> list[Segment]:
    """Segments of decoded text, taking the marker strings as markers."""
    out: list[Segment] = []
    pos = 0
    for m in _MARKER_RE.finditer(text):
        if m.start() > pos:
            out.append(Segment(text[pos : m.start()], False))
        out.append(Segment(m.group(), True))
        pos = m.end()
    if pos < len(text):
        out.append(Segment(text[pos:], False))
    return out


def decode_segments(tokenizer, ids: Iterable[int]) -> list[Segment]:
    """Segments of generated ids: control ids as specials, runs of other ids as text.

    Unlike decoding to a string and splitting on marker strings, this cannot confuse text
    that spells a marker with the marker itself."""
    out: list[Segment] = []
    run: list[int] = []

    def flush():
        if run:
            out.append(Segment(tokenizer.decode(run), False))
            run.clear()

    for i in ids:
        if tokenizer.is_special(i):
            flush()
            out.append(Segment(tokenizer.id_to_token(i), True))
        else:
            run.append(int(i))
    flush()
    return out


def _header(text: str) -> tuple[str, dict[str, str]]:
    text = text.strip()
    tag = text.split(None, 1)[0] if text else ""
    return tag, {k: html.unescape(v) for k, v in _ATTR_RE.findall(text[len(tag):])}


def _typed(text: str, kind: str | None) -> Any:
    if kind == "string":
        return text
    if kind == "null":
        return None
    if kind == "boolean":
        low = text.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    expected = {"number": (int, float), "object": dict, "array": list}.get(kind or "")
    if expected is not None and (not isinstance(value, expected) or isinstance(value, bool)):
        return text  # not what the type attribute announced: keep the model's text
    return value


def parse_output(
    output: str | Iterable[Segment],
    thinking: bool | None = None,
    call_id_prefix: str = "call_",
) -> ParsedOutput:
    """Reasoning, answer text and tool calls of a generated assistant turn.

    ``output`` is decoded text (control tokens as their strings, i.e. ``decode(ids,
    skip_special_tokens=False)``) or segments (:func:`decode_segments`, exact). ``thinking``
    says where generation started: True after the prompt's ``open(think)``, False after
    ``open(response)``, None at message level (e.g. a whole rendered assistant message).
    Tool calls come back OpenAI-style, ``{"id": call_id_prefix + str(n), "type": "function",
    "function": {"name", "arguments" (JSON string)}}``, with argument values typed by their
    ``type`` attribute. Parsing stops at ``<|end_of_msg|>``.
    """
    segs = split_markers(output) if isinstance(output, str) else list(output)
    result = ParsedOutput()
    stack: list[str] = ["message"]
    if thinking is True:
        stack.append("think")
        result.reasoning = ""
    elif thinking is False:
        stack.append("response")
    reasoning: list[str] = []
    content: list[str] = []
    call: dict | None = None
    arg: dict | None = None
    header: list[str] | None = None  # collecting an open/close header
    header_kind = ""

    for seg in segs:
        if seg.is_special:
            if header is not None and seg.text == SEP:
                tag, attrs = _header("".join(header))
                header = None
                if header_kind == OPEN:
                    stack.append(tag)
                    if tag == "think" and result.reasoning is None:
                        result.reasoning = ""
                    elif tag == "call":
                        call = {"name": attrs.get("tool", ""), "arguments": {}}
                    elif tag == "argument" and call is not None:
                        arg = {"key": attrs.get("key", ""), "type": attrs.get("type"), "text": []}
                else:  # close: pop up to the tag (tolerating unclosed inner blocks)
                    if tag in stack:
                        while stack:
                            top = stack.pop()
                            if top == "argument" and arg is not None and call is not None:
                                call["arguments"][arg["key"]] = _typed("".join(arg["text"]), arg["type"])
                                arg = None
                            elif top == "call" and call is not None:
                                if top == tag:
                                    result.tool_calls.append(call)
                                call = None
                            if top == tag:
                                break
                continue
            if seg.text == END_OF_MSG:
                break
            if seg.text in (OPEN, CLOSE):
                header, header_kind = [], seg.text
            # any other control token (or a stray <|sep|>) carries no text
            continue
        if header is not None:
            header.append(seg.text)
            continue
        top = stack[-1] if stack else "message"
        if top == "think":
            reasoning.append(seg.text)
        elif top == "argument":
            if arg is not None:
                arg["text"].append(seg.text)
        elif top in ("tools", "call"):
            pass  # only whitespace belongs here
        else:  # response, message level, or an unknown block
            content.append(seg.text)

    if result.reasoning is not None:
        result.reasoning = "".join(reasoning)
    result.content = "".join(content)
    result.tool_calls = [
        {"id": f"{call_id_prefix}{n}", "type": "function",
         "function": {"name": c["name"], "arguments": _json_args(c["arguments"])}}
        for n, c in enumerate(result.tool_calls)
    ]
    return result


def _json_args(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)
