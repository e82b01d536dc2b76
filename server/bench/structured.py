"""Constrained decoding's cost: step time with 0, 1 and all rows under a JSON schema, and
grammar compile time for a large tool schema.

    python -m k3serve.server.bench.structured [--model DIR | demo] [--rows 8] [--steps 32]
        [--context 64] [--tools 64] [--vocab 163840] [--json out.json]
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

At K3's vocabulary size (``--vocab``, default 163,840; a synthetic vocabulary of random printable
tokens, seeded): the host's cost per constrained row and token (the matcher's bitmask fill and
token accept, medians over 200 tokens of the schema above) and the sampling program's time at
``--rows`` rows with an all-ones bitmask against one row masked (jit of ``sampler.sample``,
median of 20 calls, the pair run twice, alternating).
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


def run(model_dir, rows: int, steps: int, context: int, tools: int, vocab: int = 163_840, seed: int = 0) -> dict:
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
                            "cached_ms": round(1e3 * warm, 3)},
            "at_vocab": at_vocab(vocab, rows, seed)}


def at_vocab(V: int, rows: int, seed: int = 0) -> dict:
    """Host cost per constrained token and the sampler with / without a mask at ``V`` ids."""
    import jax
    import jax.numpy as jnp

    from ..engine.sampler import build_sampler_inputs, sample
    from ..engine.sampling_params import SamplingParams
    from ..structured.grammar import Constraint, GrammarCompiler, bitmask_words

    rng = np.random.default_rng(seed)
    vocab, seen = [bytes([i]) for i in range(256)], set()
    while len(vocab) < V - 256:
        t = bytes(rng.integers(32, 127, int(rng.integers(2, 9))).tolist())
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    vocab += [b""] * (V - len(vocab))
    eos = V - 255
    t = time.perf_counter()
    comp = GrammarCompiler(vocab, [eos])
    info_s = time.perf_counter() - t
    m = comp.matcher(Constraint("json_schema", json.dumps(LONG_SCHEMA)), [eos])
    W = bitmask_words(V)
    buf = np.zeros((rows, W), np.int32)
    fills, accepts = [], []
    for i in range(200):
        t = time.perf_counter()
        m.fill(buf, 0)
        fills.append(time.perf_counter() - t)
        allowed = np.flatnonzero(np.unpackbits(buf[0].view(np.uint8), bitorder="little"))
        t = time.perf_counter()
        m.accept(int(allowed[i % len(allowed)]))
        accepts.append(time.perf_counter() - t)
    logits = jnp.asarray(rng.normal(size=(rows, V)).astype(np.float32))
    params = [SamplingParams(temperature=0.0)] * (rows // 2) + [SamplingParams(temperature=1.0, seed=i)
                                                                for i in range(rows - rows // 2)]
    inp = build_sampler_inputs(params, None, [0] * rows, [[1]] * rows, [[]] * rows, vocab_size=V)
    free = np.full((rows, W), -1, np.int32)
    masked = free.copy()
    masked[0] = buf[0]
    f = jax.jit(lambda lg, b: sample(lg, inp, 0, bitmask=b).tokens)
    times = {"free": [], "one_row_masked": []}
    for _ in range(2):
        for name, b in (("free", jnp.asarray(free)), ("one_row_masked", jnp.asarray(masked))):
            f(logits, b).block_until_ready()
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                f(logits, b).block_until_ready()
                ts.append(time.perf_counter() - t)
            times[name].append(round(1e3 * statistics.median(ts), 2))
    return {"vocab": V, "tokenizer_info_s": round(info_s, 2),
            "fill_us": round(1e6 * statistics.median(fills), 1),
            "fill_us_p90": round(1e6 * sorted(fills)[int(0.9 * (len(fills) - 1))], 1),
            "accept_us": round(1e6 * statistics.median(accepts), 1), "sampler_ms": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--tools", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=163_840, help="vocabulary size of the host and sampler figures")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    return emit(run(resolve_model(a.model), a.rows, a.steps, a.context, a.tools, a.vocab), a.json)


if __name__ == "__main__":
    sys.exit(main())
