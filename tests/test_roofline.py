"""The planner's decode roofline (``sharding/roofline.py``, issue #18) on a config small enough
to count by hand, the recipe ranking, and the plan's weight bytes per device against what a
sharded load actually places (an 8-virtual-device child, ``_plan_bytes_check.py``)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from _util import run_children

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny():
    from k3serve.checkpoints.synthetic import k3_config
    from k3serve.model import K3Config

    # 5 layers: dense 0, KDA 0-2 and 4, MLA 3; 8 experts top-2 MXFP4 of [32 x 32]
    return k3_config(vocab_size=256, hidden_size=96, num_hidden_layers=5, full_attn_layers=[4], kda_num_heads=8,
                     kda_head_dim=16, mla_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, num_experts=8, num_experts_per_token=2,
                     num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32,
                     intermediate_size=64, attn_res_block_size=2), K3Config


@pytest.fixture(scope="module")
def setup():
    from k3serve.sharding.memory import param_inventory

    raw, K3Config = tiny()
    cfg = K3Config.from_dict(raw)
    return cfg, param_inventory(cfg, "bfloat16")


def cost(setup, recipe, **kw):
    from k3serve.sharding.recipe import Recipe
    from k3serve.sharding.roofline import TPU7X, step_cost

    cfg, inv = setup
    device = dataclasses.replace(TPU7X, collective_latency_s=kw.pop("latency", 0.0))
    return step_cost(cfg, Recipe.parse(recipe), inv, device=device, **kw)


def test_bytes_counted_by_hand_on_one_device(setup):
    c = cost(setup, None, context_len=100, concurrency=4)
    # MLA latent cache: 1 MLA layer x (kv_lora 16 + rope 8) x 2 bytes = 48 B/token, 4 requests x 100 tokens
    assert c.hbm_bytes["MLA KV"] == 4 * 100 * 48
    # KDA state: 4 layers x (8 heads x 16 x 16 + 3 conv taps x 3 x 8 x 16) x 4 bytes, read and written
    assert c.hbm_bytes["KDA state"] == 2 * 4 * (4 * (8 * 16 * 16 + 3 * 3 * 8 * 16) * 4)
    # routed experts: 4 MoE layers x 8 experts x 3 matrices of [32, 32] MXFP4 (512 packed
    # bytes + 32 scale bytes); 4 tokens of top-2 of 8 touch 1 - (3/4)^4 of them
    routed = 4 * 8 * 3 * (32 * 16 + 32)
    assert c.hbm_bytes["routed experts"] == pytest.approx((1 - 0.75 ** 4) * routed)
    assert c.flops["routed experts"] == pytest.approx(2 * (4 * 8 * 3 * 32 * 32) * (2 / 8) * 4)
    assert c.hbm_bytes["LM head"] == 256 * 96 * 2 and c.flops["LM head"] == 2 * 96 * 256 * 4
    assert sum(c.ici_bytes.values()) == 0 and c.collectives == 0  # nothing to exchange on one device
    assert c.bound == "HBM" and c.step_s == pytest.approx(sum(c.hbm_bytes.values()) / (7.37e12 / 2))  # a TensorCore: half the chip's
    assert c.tok_s_total == pytest.approx(4 / c.step_s)


def test_ici_and_collectives_counted_by_hand_on_two_devices(setup):
    c = cost(setup, "ep=2,tp=1,dcp=2", context_len=100, concurrency=1, latency=1e-6)
    assert c.hbm_bytes["MLA KV"] == 100 * 48 / 2  # the sequence's pages dealt over two ranks
    # two ring all-reduces per layer over 2 ranks (2 (G-1)/G = 1) of one token's [96] bf16
    assert c.ici_bytes["TP all-reduces"] == 2 * 5 * 1 * 96 * 2
    # dispatch + combine: half a token per device, top-2, [32] bf16 latent, half of it remote, 4 MoE layers
    assert c.ici_bytes["EP dispatch + combine"] == 2 * 0.5 * 2 * 32 * 2 * 0.5 * 4
    # DCP merge: 1 MLA layer, half of the partial outputs (8 heads, kv_lora 16) in fp32 and
    # the other rank's LSE (8 heads)
    assert c.ici_bytes["DCP merge"] == 0.5 * 1 * 8 * 16 * 4 + 1 * 8 * 4
    # the step's collectives (roofline.step_collectives): 2 TP reductions per layer; per MoE
    # layer the latent input's gather over "ep", the sizes, dispatch, combine and output gather
    # (tp = 1: no gather of h); per MLA layer the query's two gathers, the LSE gather and the sum;
    # the LM head's gather
    assert c.collective_parts == {"TP reductions": 2 * 5, "EP exchange": 5 * 4, "DCP (MLA)": 4 * 1, "LM head": 1}
    assert c.collectives == 35
    assert c.latency_s == pytest.approx(35e-6) and c.bound == "latency"
    assert c.step_s == pytest.approx(max(c.hbm_s, c.ici_s, c.flops_s) + 35e-6)


def test_speculation_advances_by_the_accepted_tokens(setup):
    plain = cost(setup, None, context_len=64, concurrency=2)
    spec = cost(setup, None, context_len=64, concurrency=2, tokens_per_step=4, accepted=2.5)
    assert spec.flops["routed experts"] == pytest.approx(4 * plain.flops["routed experts"])
    assert spec.tok_s_per_user == pytest.approx(2.5 / spec.step_s)


def test_full_k3_shape_latency_then_hbm_bound():
    from k3serve.model.config import k3_full
    from k3serve.sharding.memory import param_inventory
    from k3serve.sharding.recipe import PRESETS
    from k3serve.sharding.roofline import step_cost

    cfg = k3_full()
    inv = param_inventory(cfg)
    rows = [step_cost(cfg, PRESETS["v7-32-decode"], inv, context_len=9216, concurrency=b) for b in (1, 8, 16, 72)]
    # the step waits on 835 collectives (4.2 ms at 5 us each); per device (a TensorCore: half
    # the chip's bandwidth) concurrency 16 reads more than that takes
    assert rows[0].collectives == 835
    assert [r.bound for r in rows] == ["latency", "latency", "HBM", "HBM"]
    assert all(a.tok_s_per_user > b.tok_s_per_user for a, b in zip(rows, rows[1:]))
    assert all(a.tok_s_total < b.tok_s_total for a, b in zip(rows, rows[1:]))
    # the published anchor this should not be slower than: tpu-inference, tpu7x-32, c=8, 8k/1k: 18.35 tok/s/user
    assert rows[1].tok_s_per_user > 18.35


def test_recommend_ranks_fitting_recipes_first(setup):
    from k3serve.sharding.roofline import TPU7X, candidate_recipes, recommend

    cfg, inv = setup
    recipes = candidate_recipes(cfg, 4)
    assert recipes and all(r.devices == 4 for r in recipes)
    assert {"ep=4,tp=1", "ep=2,tp=2,dcp=4", "ep=4,tp=1,dp=2"} <= {str(r) for r in recipes}
    small = dataclasses.replace(TPU7X, hbm_gb=0.002)  # 2 MB: 6 to 17 requests of 4K fit, by recipe
    ranked = recommend(cfg, recipes, inv, context_len=4096, concurrency=10, device=small)
    fits = [x["fits"] for x in ranked]
    assert True in fits and False in fits and fits == sorted(fits, reverse=True)
    ok = [x["tok_s_total"] for x in ranked if x["fits"]]
    assert ok == sorted(ok, reverse=True)


def test_plan_cli_roofline_and_recommend():
    run = lambda *a: subprocess.run([sys.executable, "-m", "k3serve.server.cli", "plan", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("--recipe", "v7-32-decode", "--concurrency", "1,72", "--context-len", "9216", "--json")
    assert r.returncode == 0, r.stderr
    steps = json.loads(r.stdout)["steps"]
    assert [s["concurrency"] for s in steps] == [1, 72] and steps[1]["bound"] == "HBM"
    r = run("--recommend", "32", "--concurrency", "64", "--top", "3")
    assert r.returncode == 0 and r.stdout.count("tok/s/user") == 3, r.stderr


def test_plan_weight_bytes_equal_a_sharded_load(tmp_path):
    from k3serve.checkpoints.synthetic import generate_checkpoint

    raw, _ = tiny()
    src = generate_checkpoint(tmp_path / "src", raw, seed=2)
    res = run_children(os.path.join(HERE, "_plan_bytes_check.py"), [src],
                       [{"recipes": ["ep=8,tp=1", "ep=4,tp=2,dp=2,dcp=4", "ep=2,tp=4"]}], 8, timeout=600)
    for name, x in res.items():
        assert x["held"] == [x["plan"]], (name, x)  # every device holds exactly what the plan says


def test_draft_adds_its_weights_cache_and_collectives(setup):
    from k3serve.sharding.roofline import Draft

    d = Draft("d", verify_tokens=4, accepted=2.5, params=1e6, layers=2, kv_bytes_per_token=64)
    for recipe, n in ((None, 1), ("ep=2,tp=1", 2)):
        plain = cost(setup, recipe, context_len=128, concurrency=3, latency=1e-6)
        spec = cost(setup, recipe, context_len=128, concurrency=3, latency=1e-6, draft=d)
        assert spec.hbm_bytes["draft weights"] == pytest.approx(2e6 / n)
        assert spec.hbm_bytes["draft KV"] == pytest.approx(3 * 128 * 64)
        assert spec.flops["draft"] == pytest.approx(2e6 * 3 * 4 / n)
        assert spec.flops["routed experts"] == pytest.approx(4 * plain.flops["routed experts"])
        assert spec.collectives - plain.collectives == (0 if n == 1 else 2 * 2 + 1)
        assert spec.tok_s_per_user == pytest.approx(2.5 / spec.step_s)


def test_compare_seed_shape_and_published_figures(tmp_path):
    """The seed's split (DCP32 below ~48 requests, DP2 x DCP16 above) appears once DSpark is
    counted, and the seed's 408 tok/s/user at 1 is within 2x of the speculative ceiling (now
    below it: the step waits on its collectives) and above the plain one."""
    from k3serve.model.config import k3_full
    from k3serve.sharding.plan_compare import SEED_PER_USER_AT_1, compare_seed
    from k3serve.sharding.memory import param_inventory
    from k3serve.sharding.roofline import TPU7X

    cfg = k3_full()
    cmp = compare_seed(cfg, param_inventory(cfg), TPU7X)
    assert cmp.crossover[False] is None and 40 <= cmp.crossover[True] <= 72
    # the step's 1,000-odd collectives (roofline.step_collectives, as compiled) put even the
    # speculative ceiling a little below the seed's figure: within 2x either way, above the plain one
    assert cmp.at_1[False] < cmp.at_1[True] < SEED_PER_USER_AT_1 < 2 * cmp.at_1[True]
    assert cmp.waits_at_1[0] > 835 and cmp.waits_at_1[1] > cmp.waits_at_1[2] / 2
    assert cmp.implied_input_per_output(True) > 1 and cmp.tpu_inference_ceiling > 18.35
    png = tmp_path / "seed.png"
    r = subprocess.run([sys.executable, "-m", "k3serve.server.cli", "plan", "--compare-seed", "--png", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "from 56 concurrent requests" in r.stdout and "408 tok/s/user" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = subprocess.run([sys.executable, "-m", "k3serve.server.cli", "plan", "--compare-seed", "--json", "--png", ""],
                       capture_output=True, text=True, timeout=300)
    out = json.loads(r.stdout)
    assert out["dp2_ahead_from"] == {"plain": None, "speculative": cmp.crossover[True]}
    assert len(out["curves"]) == 4 and out["published"]["seed_tok_s_per_user_at_1"] == SEED_PER_USER_AT_1
