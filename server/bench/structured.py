"""Constrained decoding's cost: step time with 0, 1 and all rows under a JSON schema, and
grammar compile time for a large tool schema.

    python -m k3serve.server.bench.structured [--model DIR | demo] [--rows 8] [--steps 32]
        [--context 64] [--tools 64] [--json out.json]
    k3serve bench structured [same flags]

One engine (the checkpoint's tokenizer, async scheduling as ``serve`` runs it) decodes
``--rows`` requests in three rounds: none constrained, one constrained, all constrained. The
schema (an array of at least 200 small enums) keeps a constrained row going for the whole
round; free rows ignore eos. A round's step time is the median ``engine.step()`` over
``--steps`` steps taken while every row decodes (host work included: the matcher's bitmask
fill and token advance, the synchronous planning a grammar row needs). The free round runs
first and again last; ``overhead`` is a round's step time over the mean of the two, minus 1. The compile figure is xgrammar's for a JSON schema that is
one of ``--tools`` tool calls (each a name and an object of 8 typed arguments): cold (first
compile) and cached (the engine's cache by hash).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .report import emit, model_dir as resolve_model

LONG_SCHEMA = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 200}


def tool_schema(n: int) -> dict:
    """A JSON schema for one call among ``n`` tools, 8 typed arguments each."""
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "number"}, {"type": "boolean"}, {"enum": ["low", "mid", "high"]},
             {"type": "array", "items": {"type": "string"}, "maxItems": 8},
             {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}}, "required": ["k"]},
             {"anyOf": [{"type": "string"}, {"type": "null"}]}]
    calls = [{"type": "object", "properties": {
        "name": {"const": f"tool_{i}"},
        "arguments": {"type": "object", "properties": {f"arg_{j}": kinds[(i + j) % len(kinds)] for j in range(8)},
                      "required": [f"arg_{j}" for j in range(0, 8, 2)]}},
        "required": ["name", "arguments"]} for i in range(n)]
    return {"anyOf": calls}


def run(model_dir, rows: int, steps: int, context: int, tools: int, seed: int = 0) -> dict:
    from ...checkpoints import load_pretrained
    from ..engine.engine import Engine
    from ..engine.sampling_params import SamplingParams
    from ..structured.grammar import Constraint
    from ..text.tokenizer import load_tokenizer
    from .offline import prompts_for

    m = load_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise SystemExit(f"{model_dir} has no tokenizer: constrained decoding needs one")
    eng = Engine(m, max_num_seqs=rows, max_num_batched_tokens=max(256, rows), page_size=16,
                 max_model_len=context + steps + 400, enable_prefix_caching=False, tokenizer=tok)
    rng = np.random.default_rng(seed)
    compiles = eng.stats()["num_compiles"]
    schema = json.dumps(LONG_SCHEMA)
    rounds = []
    for constrained in (0, 1, rows, 0):  # the free round again last: the machine's drift
        for i, p in enumerate(prompts_for(rng, rows, context, m.config.vocab_size)):
            c = dict(json_schema=schema) if i < constrained else {}
            eng.add_request(p, SamplingParams(max_new_tokens=steps + 8, temperature=0, ignore_eos=not c, **c))
        while any(req.num_computed < len(req.prompt) for req in eng.requests.values()):
            eng.step()  # prefill
        times = []
        for _ in range(steps):
            if len(eng.scheduler.running) < rows:
                break
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        rounds.append({"constrained_rows": constrained, "rows": rows, "steps_timed": len(times),
                       "step_ms": round(1e3 * statistics.median(times), 2),
                       "step_ms_p90": round(1e3 * sorted(times)[int(0.9 * (len(times) - 1))], 2)})
    base = (rounds[0]["step_ms"] + rounds[-1]["step_ms"]) / 2
    for r in rounds:
        r["overhead"] = round(r["step_ms"] / base - 1, 3)
    comp = eng.grammar_compiler()
    big = json.dumps(tool_schema(tools))
    t = time.perf_counter()
    comp.compile(Constraint("json_schema", big))
    cold = time.perf_counter() - t
    t = time.perf_counter()
    comp.compile(Constraint("json_schema", big))
    warm = time.perf_counter() - t
    return {"model": str(model_dir), "vocab_size": m.config.vocab_size, "context": context,
            "compiles_after_warmup": eng.stats()["num_compiles"] - compiles, "rounds": rounds,
            "tool_schema": {"tools": tools, "schema_chars": len(big), "compile_ms": round(1e3 * cold, 1),
                            "cached_ms": round(1e3 * warm, 3)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--tools", type=int, default=64)
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    return emit(run(resolve_model(a.model), a.rows, a.steps, a.context, a.tools), a.json)


if __name__ == "__main__":
    sys.exit(main())
