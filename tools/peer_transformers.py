"""Peer baseline for bench_offline: transformers' KimiLinearForCausalLM.generate on CPU.

Runs in a separate venv with torch + transformers (never a k3serve dependency, never
imported by tests). Same workload as bench_offline: c equal-length random prompts (same
generator seed, ids in [2, 4000)), greedy, eos ignored, one batched ``generate`` call per
concurrency level, run ``--untimed-runs`` times untimed first.
Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--untimed-runs", type=int, default=1, help="runs of each concurrency before the timed one")
    a = ap.parse_args()
    import torch
    from transformers import AutoConfig, KimiLinearForCausalLM

    torch.set_num_threads(a.threads)
    cfg = AutoConfig.from_pretrained(a.model)
    if getattr(cfg, "model_type", "") != "kimi_linear":
        raise SystemExit("the transformers peer runs Kimi Linear checkpoints only")
    model = KimiLinearForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(0)
    V = cfg.vocab_size
    out = []
    with torch.no_grad():
        # warm-up (first-call setup)
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        for c in [int(x) for x in a.concurrency.split(",")]:
            ids = torch.tensor(np.stack([rng.integers(2, min(V, 4000), a.prompt_len) for _ in range(c)]))
            for _ in range(a.untimed_runs + 1):  # the last run is the timed one
                t = time.perf_counter()
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.gen_len,
                                     min_new_tokens=a.gen_len, do_sample=False, eos_token_id=None, pad_token_id=0)
                wall = time.perf_counter() - t
            n = int((gen.shape[1] - a.prompt_len) * c)
            out.append({"concurrency": c, "tokens": n, "wall_s": round(wall, 3), "tok_per_s": round(n / wall, 1)})
    print(json.dumps({"torch": torch.__version__, "threads": a.threads, "results": out}))


if __name__ == "__main__":
    main()
