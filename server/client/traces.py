"""Synthetic agentic traffic as a Mooncake-format JSONL trace.

    python -m k3serve.server.client.traces --out trace.jsonl [--sessions 16] [--seed 0]
        [--preset agentic|tiny] [--block-size 512] [... size / timing options, see --help]

Each line is one request: ``{"timestamp": ms, "input_length": n, "output_length": m,
"hash_ids": [...]}`` (``--annotate`` adds ``session``, ``kind`` and ``turn``).

Block semantics (the Mooncake convention). A request's prompt is the concatenation of the
blocks named by ``hash_ids``: block i covers tokens ``[i*B, (i+1)*B)`` for block size B, and
only the last block may be partial, so

    (len(hash_ids) - 1) * B  <  input_length  <=  len(hash_ids) * B.

A hash id always denotes the same block content at the same position after the same
preceding blocks (ids are chained: a shared id implies a shared prefix up to and including
that block). A *full* block's id is reused by every later request that extends that prefix;
the id of a *partial* last block is never reused (the next turn completes that block with
new tokens, i.e. a different block), so no id is ever used with two different lengths.

The traffic model:

* one system prompt (``system_tokens``) shared by all sessions;
* each session adds its own context (``session_prefix_tokens``), then runs ``turns`` turns:
  a turn's prompt is the previous turn's prompt + the previous output + a new user / tool
  message (``user_tokens``), so prompts grow on a shared prefix;
* between turns: the assumed decode time of the previous output
  (``output_length * decode_ms_per_token``) plus a think / tool time (``think_ms``);
* with probability ``subagent_prob`` after a turn, a burst of ``subagent_fanout`` subagents
  is forked at once from the session's current context (prompt so far + last output), each
  with its own short suffix (``subagent_suffix_tokens``) and ``subagent_turns`` turns of its
  own; the parent's next turn starts after the last subagent is done and carries their
  results as its new message;
* sessions start as a Poisson process with ``session_rate`` sessions per second;
* a session (or subagent) ends early instead of exceeding ``max_context_tokens``
  (``input_length + output_length``).

Ranges are inclusive ``(lo, hi)`` pairs drawn uniformly. Everything is deterministic from the
seed. ``min_prompt_tokens`` gives the prompt tokens an ideal (infinite, token-granular) prefix
cache would still have to compute for a trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Iterable

import numpy as np


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    system_tokens: int = 6000
    session_prefix_tokens: tuple[int, int] = (500, 4000)
    turns: tuple[int, int] = (3, 12)
    user_tokens: tuple[int, int] = (50, 1500)
    output_tokens: tuple[int, int] = (50, 600)
    think_ms: tuple[int, int] = (500, 5000)
    decode_ms_per_token: float = 20.0
    session_rate: float = 0.5
    subagent_prob: float = 0.25
    subagent_fanout: tuple[int, int] = (2, 6)
    subagent_suffix_tokens: tuple[int, int] = (100, 800)
    subagent_output_tokens: tuple[int, int] = (50, 400)
    subagent_turns: tuple[int, int] = (1, 3)
    max_context_tokens: int = 131072


PRESETS: dict[str, TraceConfig] = {
    # Roughly coding-agent shaped, for real models (block 512 as in the Mooncake traces).
    "agentic": TraceConfig(),
    # Small enough for the tiny demo model on a CPU: use with --block-size 16.
    "tiny": TraceConfig(system_tokens=40, session_prefix_tokens=(8, 40), turns=(2, 5), user_tokens=(4, 40),
                        output_tokens=(4, 24), think_ms=(50, 300), decode_ms_per_token=5.0, session_rate=5.0,
                        subagent_prob=0.3, subagent_fanout=(2, 4), subagent_suffix_tokens=(4, 24),
                        subagent_output_tokens=(4, 16), subagent_turns=(1, 2), max_context_tokens=512),
}


class _Context:
    """A prompt under construction: its full blocks (ids) plus the length of a partial tail."""

    __slots__ = ("full", "tail")

    def __init__(self, full: list[int] | None = None, tail: int = 0):
        self.full = list(full or [])
        self.tail = tail

    def fork(self) -> "_Context":
        return _Context(self.full, self.tail)

    def length(self, block_size: int) -> int:
        return len(self.full) * block_size + self.tail


class _Builder:
    def __init__(self, block_size: int):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.bs = block_size
        self.next_id = 0
        self.rows: list[tuple[float, int, dict]] = []  # (timestamp, creation order, row)

    def _new_id(self) -> int:
        h = self.next_id
        self.next_id += 1
        return h

    def append(self, ctx: _Context, n: int) -> None:
        """Append n new tokens: every block they complete (or touch) is new content -> new id."""
        total = ctx.tail + n
        for _ in range(total // self.bs):
            ctx.full.append(self._new_id())
        ctx.tail = total % self.bs

    def emit(self, ctx: _Context, ts: float, output_length: int, extra: dict | None) -> None:
        hash_ids = list(ctx.full)
        if ctx.tail:
            hash_ids.append(self._new_id())  # a partial block: never reused
        row = {"timestamp": int(round(ts)), "input_length": ctx.length(self.bs),
               "output_length": int(output_length), "hash_ids": hash_ids}
        if extra:
            row.update(extra)
        self.rows.append((row["timestamp"], len(self.rows), row))


def _draw(rng: np.random.Generator, r: tuple[int, int]) -> int:
    lo, hi = int(r[0]), int(r[1])
    if hi < lo:
        raise ValueError(f"bad range {r}")
    return int(rng.integers(lo, hi + 1))


def generate_trace(seed: int, num_sessions: int, *, block_size: int = 512, preset: str = "agentic",
                   config: TraceConfig | None = None, annotate: bool = False, **overrides) -> list[dict]:
    """Generate the trace rows (sorted by timestamp; ties keep generation order).

    ``config`` (or the named ``preset``) gives the traffic model; keyword ``overrides`` replace
    single fields of it (e.g. ``turns=(2, 4)``). ``annotate`` adds ``session`` / ``kind``
    ("turn" or "subagent") / ``turn`` fields (not part of the Mooncake format).
    """
    cfg = config if config is not None else PRESETS[preset]
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    if num_sessions < 0:
        raise ValueError("num_sessions must be >= 0")
    rng = np.random.default_rng(seed)
    b = _Builder(block_size)
    system = _Context()
    b.append(system, max(0, cfg.system_tokens))
    fits = lambda ctx, out: ctx.length(block_size) + out <= cfg.max_context_tokens  # noqa: E731

    t_start = 0.0
    for s in range(num_sessions):
        if s > 0 and cfg.session_rate > 0:
            t_start += float(rng.exponential(1000.0 / cfg.session_rate))
        ctx = system.fork()
        b.append(ctx, max(1, _draw(rng, cfg.session_prefix_tokens)))
        t = t_start
        n_turns = _draw(rng, cfg.turns)
        for turn in range(n_turns):
            if turn > 0:
                b.append(ctx, max(1, _draw(rng, cfg.user_tokens)))
            out = max(1, _draw(rng, cfg.output_tokens))
            if not fits(ctx, out):
                break
            b.emit(ctx, t, out, {"session": s, "kind": "turn", "turn": turn} if annotate else None)
            b.append(ctx, out)  # the model's answer becomes part of the conversation
            t += out * cfg.decode_ms_per_token + _draw(rng, cfg.think_ms)
            if turn < n_turns - 1 and rng.random() < cfg.subagent_prob:
                t_done = t
                for a in range(_draw(rng, cfg.subagent_fanout)):
                    sub = ctx.fork()
                    ta = t
                    for st in range(_draw(rng, cfg.subagent_turns)):
                        b.append(sub, max(1, _draw(rng, cfg.subagent_suffix_tokens)))
                        sout = max(1, _draw(rng, cfg.subagent_output_tokens))
                        if not fits(sub, sout):
                            break
                        b.emit(sub, ta, sout,
                               {"session": s, "kind": "subagent", "turn": turn, "subagent": a, "subturn": st}
                               if annotate else None)
                        b.append(sub, sout)
                        ta += sout * cfg.decode_ms_per_token + _draw(rng, cfg.think_ms)
                    t_done = max(t_done, ta)
                t = t_done
    b.rows.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in b.rows]


def row_blocks(row: dict, block_size: int) -> list[tuple[object, int]]:
    """The (hash_id, token count) blocks that make up a row's prompt (Mooncake convention).

    Raises ValueError when ``hash_ids`` cannot cover ``input_length``; extra trailing hash ids
    (more than needed) are ignored."""
    n_in = int(row["input_length"])
    hashes = list(row.get("hash_ids") or [])
    if n_in < 0:
        raise ValueError(f"negative input_length in {row!r}")
    need = -(-n_in // block_size)
    if need > len(hashes):
        raise ValueError(f"input_length {n_in} needs {need} blocks of {block_size} tokens "
                         f"but the row has {len(hashes)} hash_ids (wrong --block-size?)")
    out = []
    for i in range(need):
        out.append((hashes[i], min(block_size, n_in - i * block_size)))
    return out


def min_prompt_tokens(trace: Iterable[dict], block_size: int) -> int:
    """Prompt tokens that must be computed at least once: each distinct hash id counted once
    with the largest length it is used with (a full block, or a request's partial tail).

    This is what an ideal prefix cache (infinite, token-granular, shared by all requests)
    achieves; a real one computes more (eviction, page granularity, concurrent requests that
    miss a prefix still being prefilled, engines that recompute the last prompt token on a
    full hit)."""
    seen: dict[object, int] = {}
    for row in trace:
        for h, n in row_blocks(row, block_size):
            if n > seen.get(h, 0):
                seen[h] = n
    return sum(seen.values())


def trace_summary(trace: list[dict], block_size: int) -> dict:
    total_in = sum(int(r["input_length"]) for r in trace)
    total_out = sum(int(r["output_length"]) for r in trace)
    mpt = min_prompt_tokens(trace, block_size)
    span = (trace[-1]["timestamp"] - trace[0]["timestamp"]) / 1000.0 if trace else 0.0
    return {"requests": len(trace), "input_tokens": total_in, "output_tokens": total_out,
            "min_prompt_tokens": mpt, "ideal_hit_rate": (1 - mpt / total_in) if total_in else 0.0,
            "max_input_length": max((int(r["input_length"]) for r in trace), default=0),
            "span_s": span, "block_size": block_size}


def write_jsonl(trace: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for row in trace:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def _range(s: str) -> tuple[int, int]:
    parts = s.replace(":", ",").split(",")
    if len(parts) == 1:
        return int(parts[0]), int(parts[0])
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {s!r}")
    return int(parts[0]), int(parts[1])


_RANGE_FIELDS = ["session_prefix_tokens", "turns", "user_tokens", "output_tokens", "think_ms", "subagent_fanout",
                 "subagent_suffix_tokens", "subagent_output_tokens", "subagent_turns"]
_SCALAR_FIELDS = {"system_tokens": int, "decode_ms_per_token": float, "session_rate": float,
                  "subagent_prob": float, "max_context_tokens": int}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gen_agentic_trace", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", "-o", default="-", help="output JSONL file ('-' = stdout)")
    p.add_argument("--sessions", type=int, default=16, help="number of top-level sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", choices=sorted(PRESETS), default="agentic",
                   help="default sizes: 'agentic' (real models) or 'tiny' (demo model; use --block-size 16)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash block")
    p.add_argument("--annotate", action="store_true", help="add session/kind/turn fields to each row")
    for f in _RANGE_FIELDS:
        p.add_argument("--" + f.replace("_", "-"), type=_range, default=None, metavar="LO,HI")
    for f, t in _SCALAR_FIELDS.items():
        p.add_argument("--" + f.replace("_", "-"), type=t, default=None)
    p.add_argument("--quiet", "-q", action="store_true", help="no summary on stderr")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {f: getattr(args, f) for f in _RANGE_FIELDS + list(_SCALAR_FIELDS) if getattr(args, f) is not None}
    trace = generate_trace(args.seed, args.sessions, block_size=args.block_size, preset=args.preset,
                           annotate=args.annotate, **overrides)
    if args.out == "-":
        for row in trace:
            sys.stdout.write(json.dumps(row, separators=(",", ":")) + "\n")
    else:
        write_jsonl(trace, args.out)
    if not args.quiet:
        s = trace_summary(trace, args.block_size)
        print(f"{s['requests']} requests over {s['span_s']:.1f} s, input {s['input_tokens']} tokens "
              f"(max {s['max_input_length']}), output {s['output_tokens']}, min prompt tokens to compute "
              f"{s['min_prompt_tokens']} (ideal prefix-cache hit rate {s['ideal_hit_rate']:.1%}, "
              f"block {args.block_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
