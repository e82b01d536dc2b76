"""Where a decode step's time goes: per-op device time of engine steps, from a jax profile.

    PYTHONPATH=<dir holding k3serve> python tools/profile_step.py --model DIR [--rows 1] [--steps 20]
        [--zero-experts] [--top 30]

Builds an engine on the checkpoint (no prefix caching, synchronous scheduling), prefills
``--rows`` 128-token prompts, then times ``--steps`` decode steps (median, untraced) and runs
as many more under ``jax.profiler.trace``. Every XLA op event of the trace is summed per
(kernel kind, the op's JAX name from the compiled HLO's metadata), so a line reads "how many
ms per step this op took and how often it ran". ``--zero-experts`` replaces the routed
experts by zeros: the difference of two runs is what the experts cost. The profiler adds its
own overhead to small ops; compare lines within one run, and step medians across runs.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--zero-experts", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    if a.zero_experts:
        import k3serve.kernels.ops as ops

        ops.expert_ffn = lambda x, *args, **kw: jnp.zeros(x.shape, jnp.float32) + 0 * x
    from k3serve.checkpoints import load_pretrained
    from k3serve.server.bench.offline import prompts_for
    from k3serve.server.engine.engine import Engine
    from k3serve.server.engine.sampling_params import SamplingParams

    m = load_pretrained(a.model)
    eng = Engine(m, max_num_seqs=max(8, a.rows), max_num_batched_tokens=256, page_size=16, max_model_len=256,
                 enable_prefix_caching=False, async_scheduling=False)
    params = SamplingParams(max_new_tokens=3 * a.steps + 10, temperature=0, ignore_eos=True)
    for p in prompts_for(np.random.default_rng(0), a.rows, 128, m.config.vocab_size):
        eng.add_request(p, params)
    while any(r.num_computed < len(r.prompt) for r in eng.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    bucket = eng.runner._bucket(a.rows)
    names = {}
    for mt in re.finditer(r'\n\s*%([\w.-]+) = [^\n]*?op_name="([^"]*)"', eng.runner._compiled[bucket].as_text()):
        names[mt.group(1)] = mt.group(2)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(a.steps):
                eng.step()
        events = json.load(gzip.open(glob.glob(d + "/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or "hlo_op" not in e.get("args", {}) or e["name"].startswith(("while", "cond", "call")):
            continue
        op = names.get(e["name"], "?").replace("jit(fn)/", "").replace("while/body/closed_call/", "")
        key = f"{e['name'].split('.')[0]:<34} {op[-80:]}"
        total[key] += e["dur"]
        count[key] += 1
    print(f"rows {a.rows}, bucket {bucket}, zero experts {a.zero_experts}: engine step median "
          f"{1e3 * statistics.median(times):.2f} ms untraced; traced op time {sum(total.values()) / 1e3 / a.steps:.2f} ms/step")
    print(f"{'ms/step':>8} {'n/step':>6}  kernel kind / JAX op")
    for key, us in total.most_common(a.top):
        print(f"{us / 1e3 / a.steps:8.3f} {count[key] // a.steps:6d}  {key}")


if __name__ == "__main__":
    main()
