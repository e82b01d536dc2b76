"""Child-process body for ``test_pallas_recipes.py`` (8 virtual CPU devices): one tiny K3
served through the engine under each recipe, with ``kernels="pallas-interpret"`` (every
Pallas kernel per rank inside the recipe's shard_maps) and with ``kernels="reference"``;
prints one JSON line with each run's greedy tokens and logprobs."""
from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np

from k3serve.checkpoints import load_pretrained
from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.sharding.recipe import Recipe


def checkpoint(root: str) -> str:
    """A 2-layer K3 (KDA + dense MLP, MLA + LatentMoE with MXFP4 experts), 8 KDA and MLA heads
    (one per device of an 8-rank attention group), 8 experts."""
    cfg = k3_config(vocab_size=256, hidden_size=64, num_hidden_layers=2, full_attn_layers=[2], kda_num_heads=8,
                    kda_head_dim=16, mla_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, num_experts=8, num_experts_per_token=2,
                    num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    intermediate_size=64, attn_res_block_size=2)
    return str(generate_checkpoint(os.path.join(root, "k3-pallas-recipes"), cfg, seed=11))


def serve(path: str, kernels: str, recipe: str, prompts, new_tokens: int) -> dict:
    r = Recipe.parse(recipe)
    m = load_pretrained(path, kernels=kernels)
    eng = Engine(m, max_num_seqs=len(prompts), max_num_batched_tokens=16, chunk_size=8, page_size=4,
                 max_model_len=32, warmup=False, recipe=recipe, devices=jax.devices()[: r.devices],
                 enable_prefix_caching=False)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=1)
    rids = [eng.add_request(p, sp) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.rid] = o
    eng.check_invariants()
    return {"tokens": [done[i].token_ids for i in rids],
            "logprobs": [[lp for lp, _ in done[i].logprobs] for i in rids], "steps": eng.num_steps}


def main():
    root, spec = sys.argv[1], json.loads(sys.argv[2])
    path = checkpoint(root)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in spec["lengths"]]
    out, t0 = {}, time.perf_counter()
    for name, recipe in spec["recipes"].items():
        for kernels in ("reference", "pallas-interpret"):
            out[f"{name}:{kernels}"] = serve(path, kernels, recipe, prompts, spec["new_tokens"])
            print(f"{time.perf_counter() - t0:.1f}s", name, kernels, out[f"{name}:{kernels}"], file=sys.stderr,
                  flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
