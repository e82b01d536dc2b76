"""Child-process body for ``test_attention_dp.py`` (run with 8 virtual CPU devices): tiny K3
checkpoints with small head and expert counts, served through ``k3serve.LLM`` under
attention-DP recipes with warm-up (the ahead-of-time compiled steps), against the one-device
greedy tokens; then every recipe on 8 devices that ``Recipe.validate`` accepts builds its
mesh and parallel step. Prints one JSON line."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time

import jax
import numpy as np

from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
from k3serve.checkpoints import load_pretrained
from k3serve.server.engine.llm import LLM
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.sharding.mesh import build_mesh
from k3serve.sharding.parallel import StepParallel
from k3serve.sharding.recipe import Recipe, RecipeError

NEW_TOKENS = 3


def checkpoint(root: str, heads: int, experts: int, top_k: int) -> str:
    """A 2-layer K3 (KDA + dense MLP, MLA + LatentMoE) with ``heads`` KDA and MLA heads."""
    cfg = k3_config(vocab_size=256, hidden_size=96, num_hidden_layers=2, full_attn_layers=[2],
                    kda_num_heads=heads, kda_head_dim=16, mla_heads=heads, q_lora_rank=16, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=experts,
                    num_experts_per_token=top_k, num_shared_experts=1, moe_intermediate_size=32,
                    routed_expert_hidden_size=32, intermediate_size=64, attn_res_block_size=2)
    out = os.path.join(root, f"h{heads}e{experts}-{os.getpid()}")  # one per child: children run at once
    return str(generate_checkpoint(out, cfg, seed=heads + experts))


def prompts_for(n: int, vocab: int):
    """The first ``n`` of nine prompts (two lengths: the one-device reference compiles little;
    11 tokens take two prefill chunks of 8)."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab, 11 if i % 2 else 5).tolist() for i in range(9)][:n]


def run_cell(path: str, recipe: str, expect_for) -> dict:
    """Serve dp + 1 requests (max_num_seqs = dp: one per DP group, the last one queued) under
    ``recipe`` with warm-up; greedy tokens vs one device, compiles after warm-up, cache layout."""
    r = Recipe.parse(recipe)
    prompts = prompts_for(r.dp + 1, 256)
    t = time.perf_counter()
    c0 = time.process_time()
    out = {"recipe": recipe}
    try:
        # a 16-token budget grown to in one step (bucket_growth 16): token buckets 1 and 16, two
        # step programs to warm up (growth 8 added a bucket of 8, a third program of the same kind)
        llm = LLM(path, recipe=recipe, devices=jax.devices()[: r.devices], max_num_seqs=r.dp, page_size=4,
                  max_model_len=32, chunk_size=8, max_num_batched_tokens=16, bucket_growth=16,
                  enable_prefix_caching=False)
        eng = llm.engine
        warm = eng.runner.num_compiles
        got = [o.token_ids for o in llm.generate(
            prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))]
        want = eng.par.cache_shardings(eng.model.config.kda_num_heads)
        layout = {k: str(getattr(eng.cache_mgr.device_cache, k).sharding.spec) for k in want}
        ndim = {k: getattr(eng.cache_mgr.device_cache, k).ndim for k in want}
        out.update(warmup_s=round(eng.warmup_s, 1), run_s=round(time.perf_counter() - t, 1))
        t1 = time.process_time()
        exp = expect_for(prompts)
        out["ref_cpu_s"] = round(time.process_time() - t1, 1)
        out.update(equal=got == exp, got=got, warmup_compiles=warm,
                   later_compiles=eng.runner.num_compiles - warm,
                   layout_kept=all(getattr(eng.cache_mgr.device_cache, k).sharding.is_equivalent_to(v, ndim[k])
                                   for k, v in want.items()),
                   layout=layout)
    except Exception as e:  # report every cell, not just the first failure
        out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    out["s"] = round(time.perf_counter() - t, 1)
    out["cpu_s"] = round(time.process_time() - c0, 1)
    return out


def validate_sweep(cfgs) -> list:
    """Every (ep, tp, dp, dcp, sp) on 8 devices × config: ``validate`` accepts it exactly
    when its mesh and parallel step can be built (returns the disagreements)."""
    bad = []
    divs = (1, 2, 4, 8)
    for ep, dp, dcp, sp in itertools.product(divs, divs, divs, divs):
        try:
            r = Recipe(ep=ep, tp=8 // ep, dp=dp, dcp=dcp, sp=sp)
        except RecipeError:
            continue  # rejected on its own sizes
        for cfg in cfgs:
            try:
                r.validate(cfg, num_devices=8)
            except RecipeError:
                continue
            try:
                StepParallel(r, build_mesh(r, jax.devices()))
            except Exception as e:
                bad.append(f"{r} validates for {cfg.kda_num_heads} heads but: {e}")
    return bad


def main():
    root, spec = sys.argv[1], json.loads(sys.argv[2])
    res, refs = {}, {}
    for name, (heads, experts, top_k) in spec["models"].items():
        refs[name] = checkpoint(root, heads, experts, top_k)
    models = {name: load_pretrained(p) for name, p in refs.items()}
    cache: dict = {}

    def expect(name):
        m = models[name]

        def get(prompts):  # one device, each prompt alone (memoised: cells share prompts)
            return [cache.setdefault((name, tuple(p)), m.greedy(p, NEW_TOKENS)) for p in prompts]
        return get

    for cell, (name, recipe) in spec["cells"].items():
        res[cell] = run_cell(refs[name], recipe, expect(name))
        print(cell, res[cell], file=sys.stderr, flush=True)
    if spec.get("sweep", True):
        res["validate_sweep"] = validate_sweep([m.config for m in models.values()])
    print(json.dumps(res))


if __name__ == "__main__":
    main()
