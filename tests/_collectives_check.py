"""Child-process body for ``test_step_collectives.py`` (8 virtual CPU devices): a tiny K3
(KDA + MLA, LatentMoE with 8 experts, 8 heads) served by ``k3serve.LLM`` under ``recipe``
with warm-up; every compiled step and sampling program is read for its collectives. Prints
one JSON line: per recipe, the all-gathers that move a whole parameter or cache array, and
each program's collectives by kind.

    python _collectives_check.py ROOT '{"recipe": "..."}'
"""
from __future__ import annotations

import json
import os
import sys

import jax
from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config
from k3serve.server.engine.llm import LLM
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.sharding.collectives import collectives, runner_arrays, summary, whole_array_gathers

root, spec = sys.argv[1], json.loads(sys.argv[2])
# widths above 64 and unlike any token or row count of a step (at most 16 tokens, 2 experts
# each, over 8 ranks), so a whole weight cannot be mistaken for an activation
cfg = k3_config(vocab_size=256, hidden_size=96, num_hidden_layers=4, full_attn_layers=[4], kda_num_heads=8,
                kda_head_dim=16, mla_heads=8, q_lora_rank=48, kv_lora_rank=48, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
                moe_intermediate_size=96, routed_expert_hidden_size=160, intermediate_size=192,
                attn_res_block_size=2)
ckpt = generate_checkpoint(os.path.join(root, f"c-{os.getpid()}"), cfg, seed=5)
llm = LLM(str(ckpt), recipe=spec["recipe"], max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
          page_size=8)
runner = llm.engine.runner
arrays = runner_arrays(runner)  # whole weights and cache arrays
programs = {f"step T={T}": exe for T, exe in runner._compiled.items()}
programs.update({f"sample R={R}": exe for R, exe in runner._compiled_sample.items()})
gathers, kinds = [], {}
for name, exe in sorted(programs.items()):
    colls = collectives(exe.as_text())
    kinds[name] = summary(colls)
    gathers += [f"{name}: {arr} <- {c.shapes} ({c.op_name[-80:]})" for arr, c in whole_array_gathers(colls, arrays)]
tokens = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))[0].token_ids
print(json.dumps({spec["recipe"]: {"gathers": gathers, "arrays": sorted(arrays), "kinds": kinds, "programs": len(programs),
                                   "tokens": list(tokens), "devices": jax.device_count()}}))
