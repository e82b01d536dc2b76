"""Every TPU v7 preset on 32 (or 16) CPU virtual devices against one device, in one
subprocess (the device count is fixed at jax import; the body is ``_parallel_check.py``).

The model is a 2-layer K3 (KDA + dense MLP, MLA + LatentMoE with MXFP4 experts) whose dims
divide by 32: 32 KDA heads, 32 MLA heads, 32 experts. Per preset: one prefill step of 8 rows
of very different lengths (1 to 45 tokens, page size 4, so some sequences have fewer pages
than there are DCP ranks) and two greedy decode steps through the recipe's parallel step
(DCP attention with the exact LSE merge, attention DP, SP, the explicit EP exchange — a
padded all_to_all on CPU) equal the single-device step
(1e-4 relative; argmax tokens identical); the MLA pool holds total / (dp × dcp) bytes per
device and each sequence's pages are dealt round-robin over its group's ranks. Then the
engine serves four requests under DP2 × DCP16 — two DP groups at once — with the
single-device greedy tokens."""
from __future__ import annotations

import json
import os

import pytest
from _util import run_children

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS = [3, 29, 16, 45, 7, 1, 12, 33]
pytestmark = pytest.mark.slow  # one 32-virtual-device subprocess that compiles every preset

SPEC = {
    "recipes": {"v7-32-decode": "v7-32-decode", "v7-32-decode-dp2": "v7-32-decode-dp2",
                # SP at 8 rows (the presets keep it for steps of 1,024 rows and more)
                "v7-32-prefill": "v7-32-prefill", "v7-16-decode": "ep=4,tp=4,dcp=16,sp=4,sp_min_rows=8"},
    "lengths": LENGTHS, "page_size": 4, "decode_steps": 2,
    "engine": {"dp2": "v7-32-decode-dp2"}, "engine_lengths": [5, 40, 17, 9], "engine_new_tokens": 6,
}
BLOCKS = {"v7-32-decode": (1, 32), "v7-32-decode-dp2": (2, 16), "v7-32-prefill": (1, 1), "v7-16-decode": (1, 16)}


def k32_checkpoint(root):
    """A 2-layer K3 whose heads and experts divide by 32 (about 1 s to generate)."""
    from k3serve.checkpoints.synthetic import generate_checkpoint, k3_config

    cfg = k3_config(vocab_size=512, hidden_size=64, num_hidden_layers=2, full_attn_layers=[2], kda_num_heads=32,
                    kda_head_dim=32, mla_heads=32, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=8, v_head_dim=8, num_experts=32, num_experts_per_token=2,
                    num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                    intermediate_size=64, attn_res_block_size=2)
    return generate_checkpoint(os.path.join(root, "k32"), cfg, seed=5)


def halves(spec: dict) -> list:
    """The spec as two children of about equal compile time: three recipes, then the fourth
    and the engine (about 80 and 65 s side by side on a 2-core box; in the first, v7-32-prefill
    reuses v7-32-decode's single-device programs: ``_parallel_check.one_device_step``)."""
    names = list(spec["recipes"])
    a = dict(spec, recipes={k: spec["recipes"][k] for k in names[:3]}, engine={})
    b = dict(spec, recipes={k: spec["recipes"][k] for k in names[3:]})
    return [a, b]


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    ckpt = k32_checkpoint(tmp_path_factory.mktemp("k32"))
    res = run_children(os.path.join(HERE, "_parallel_check.py"), [ckpt], halves(SPEC), 32, timeout=1200)
    print(json.dumps({k: {f: v for f, v in x.items() if f != "spread"} for k, x in res.items()}))
    return res


@pytest.mark.parametrize("name", list(SPEC["recipes"]))
def test_preset_matches_one_device(presets, name):
    x = presets[name]
    assert x["err"] < 1e-4 and x["tokens_equal"], x
    assert x["ep_exchange"] == "padded", x  # the explicit EP exchange ran inside the step (CPU: all_to_all)
    assert x["collectives"]["all-to-all"] > 0, x
    # SP where the recipe asks for it at 8 rows; elsewhere whole rows (the residual pinned)
    assert x["sp_active"] == (name == "v7-16-decode"), x


@pytest.mark.parametrize("name", list(SPEC["recipes"]))
def test_dcp_pages_split_evenly(presets, name):
    """Per-device MLA KV bytes = total / (dp × dcp); page k of a sequence on rank (k + o) mod dcp
    of its group: each rank of the group holds floor or ceil of pages / dcp, other groups none."""
    x = presets[name]
    dp, dcp = BLOCKS[name]
    assert x["kv_bytes_device"] * dp * dcp == x["kv_bytes_total"], x
    for spread, g in zip(x["spread"], x["groups"]):
        mine = spread[g * dcp:(g + 1) * dcp]
        assert sum(spread) == sum(mine) and max(mine) - min(mine) <= 1, (spread, g)
    if dcp > 1:  # the 1-token and 3-token rows have one page: most ranks hold none of them
        assert min(LENGTHS) <= 4 and sum(x["spread"][LENGTHS.index(1)]) == 1


def test_engine_dp2_dcp16_two_groups(presets):
    x = presets["engine:dp2"]
    assert x["equal"], x
    assert sorted(set(x["groups"])) == [0, 1], x  # both attention DP groups served at once
    assert x["free_pages"] == x["num_pages"] and x["recipe"] == "ep=8,tp=4,dp=2,dcp=16,sp=4", x

