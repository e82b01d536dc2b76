"""Host time per decode step against context length (issue #12): per-step host work must not
grow with the sequence.

    k3serve bench host [--model DIR | demo] [--contexts 1024,16384] [--rows 4] [--steps 24]
        [--penalties] [--stop]

One engine (``max_model_len`` fits the longest context) runs, for each context length,
``--rows`` greedy requests whose prompts have that many tokens (one prompt for all rows, so
with prefix caching the prefill is computed about once) through their prefill, then times
``--steps`` decode steps. A step's host time is its wall time in ``Engine.step`` minus the
time it spent blocked waiting for the device (``runner.wait_s``): planning, packing,
dispatch, output handling. A step that compiled a new shape (a sequence crossing into the
next page bucket) is left out and counted in ``steps_compiling``. Reported per context: the median and mean host ms per step, and
the ratio of the longest context's median to the shortest's (goal: <= 1.3). ``--penalties``
gives every request repetition and frequency penalties, ``--stop`` a stop string (needs the
checkpoint's tokenizer), so those per-step paths are timed too.

Only ``Engine``, ``Engine.step``, ``runner.wait_s`` and ``runner.num_compiles`` are used, so the same file measures an
older tree of the package as well. On CPU the "device" shares the host's cores: a loaded
machine inflates both numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .report import emit, model_dir as resolve_model


def measure(eng, prompt, rows: int, steps: int, warm: int, params) -> dict:
    """Prefill ``rows`` copies of ``prompt``, decode ``warm`` steps, then time ``steps`` decode
    steps; the requests are aborted afterwards."""
    rids = [eng.add_request(prompt, params) for _ in range(rows)]
    got = dict.fromkeys(rids, 0)
    t = time.perf_counter()
    while min(got.values()) < warm:  # prefill, then a few decode steps
        for o in eng.step():
            if o.rid in got:
                got[o.rid] += len(o.new_token_ids)
    prefill_s = time.perf_counter() - t
    host, wall, compiled = [], [], 0
    for _ in range(steps):
        c0, w0, t0 = eng.runner.num_compiles, eng.runner.wait_s, time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        if eng.runner.num_compiles != c0:  # a new shape (e.g. the next page bucket): not host work
            compiled += 1
            continue
        wall.append(dt)
        host.append(dt - (eng.runner.wait_s - w0))
    for r in rids:
        eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    eng.step()  # the aborted requests' final outputs
    ms = [1e3 * h for h in host]
    return {"context": len(prompt), "rows": rows, "steps": len(host), "steps_compiling": compiled,
            "prefill_s": round(prefill_s, 1),
            "host_ms_median": round(statistics.median(ms), 3), "host_ms_mean": round(statistics.fmean(ms), 3),
            "host_ms_min": round(min(ms), 3), "wall_ms_median": round(1e3 * statistics.median(wall), 3)}


def run(model_dir, contexts, rows: int, steps: int, warm: int = 4, chunk: int = 512, penalties: bool = False,
        stop: bool = False, seed: int = 0) -> dict:
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.engine.engine import Engine
    from k3serve.server.engine.sampling_params import SamplingParams

    m = load_pretrained(model_dir)
    kw = {}
    if stop:
        from k3serve.server.text.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
        if tok is None:
            raise SystemExit("--stop needs the checkpoint's tokenizer")
        import inspect

        if "detokenizer" in inspect.signature(Engine).parameters:
            kw["detokenizer"] = lambda: tok.detokenizer(keep_text=False)
        else:  # an older engine: a whole-sequence decode function
            kw["detokenize"] = tok.decode
    max_len = -(-(max(contexts) + warm + steps + 16) // 256) * 256
    eng = Engine(m, max_num_seqs=rows, max_num_batched_tokens=chunk, chunk_size=chunk, page_size=16,
                 max_model_len=max_len, warmup=False, **kw)
    extra = dict(repetition_penalty=1.1, frequency_penalty=0.2) if penalties else {}
    if stop:
        extra["stop"] = ("\x00never\x00",)
    params = SamplingParams(max_new_tokens=max_len - max(contexts) - 1, temperature=0, ignore_eos=True, **extra)
    rng = np.random.default_rng(seed)
    V = m.config.vocab_size
    out = []
    for ctx in contexts:
        prompt = rng.integers(5, min(V, 32000), ctx).tolist()
        out.append(measure(eng, prompt, rows, steps, warm, params))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return {"max_model_len": max_len, "penalties": penalties, "stop": stop, "results": out,
            "ratio_longest_over_shortest": round(out[-1]["host_ms_median"] / out[0]["host_ms_median"], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="checkpoint dir, or 'demo'")
    ap.add_argument("--contexts", default="1024,16384", help="comma list of prompt lengths")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per context")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--penalties", action="store_true", help="repetition + frequency penalties on every request")
    ap.add_argument("--stop", action="store_true", help="a (never matching) stop string on every request")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    model_dir = resolve_model(a.model)
    contexts = sorted(int(c) for c in a.contexts.split(","))
    report = {"model": str(model_dir), **run(model_dir, contexts, a.rows, a.steps, chunk=a.chunk,
                                              penalties=a.penalties, stop=a.stop)}
    return emit(report, a.json)


if __name__ == "__main__":
    sys.exit(main())
