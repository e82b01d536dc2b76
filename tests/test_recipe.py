"""Parallelism recipes: parsing, presets, and the checks against a model config."""
from __future__ import annotations

import math

import pytest

from k3serve.model.config import k3_full, k3_small
from k3serve.sharding.recipe import PRESETS, Recipe, RecipeError


def test_parse_strings_and_presets():
    r = Recipe.parse("ep=8,tp=4,dcp=32,sp=4")
    assert (r.ep, r.tp, r.dp, r.dcp, r.sp, r.devices, r.attn_tp) == (8, 4, 1, 32, 4, 32, 32)
    r = Recipe.parse("ep=8, tp=4, dp=2, dcp=16, sp=4")
    assert (r.devices, r.attn_group, r.dcp) == (32, 16, 16)
    assert Recipe.parse("ep=32,tp=1") == Recipe(ep=32)
    assert Recipe.parse("v7-32-decode-dp2").describe()["spec"] == "ep=8,tp=4,dp=2,dcp=16,sp=4"
    assert Recipe.parse(None) == Recipe.parse("") == PRESETS["single"]
    for name, rec in PRESETS.items():  # the canonical string parses back to the same sizes
        assert Recipe.parse(str(rec)).describe() | {"recipe": name} == rec.describe()


@pytest.mark.parametrize("text, msg", [
    ("ep=8,tp=4,dcp=64", "dcp=64 must divide the attention group of 32"),
    ("ep=8,tp=4,dp=3", "dp=3 must divide the 32 devices"),
    ("ep=8,tp=4,dp=2,dcp=32", "dcp=32 must divide the attention group of 16"),
    ("ep=4,tp=2,sp=3", "sp=3 must divide"),
    ("ep=8,pp=2", "unknown axis 'pp'"),
    ("ep=8,ep=4", "ep given twice"),
    ("ep=0", "ep must be a positive integer"),
    ("ep8", "cannot parse 'ep8'"),
])
def test_parse_errors_are_clear(text, msg):
    with pytest.raises(RecipeError, match=msg):
        Recipe.parse(text)


def test_presets_fit_the_full_k3_and_checks_name_the_problem():
    full = k3_full()
    for name in ("v7-32-decode", "v7-32-decode-dp2", "v7-32-prefill"):
        PRESETS[name].validate(full, num_devices=32)
    PRESETS["v7-16-decode"].validate(full, num_devices=16)
    with pytest.raises(RecipeError, match="needs ep × tp = 32 devices, the mesh has 16"):
        PRESETS["v7-32-decode"].validate(full, num_devices=16)
    small = k3_small()  # 4 heads, 16 experts
    PRESETS["test-4"].validate(small, num_devices=4)
    with pytest.raises(RecipeError, match=r"KDA heads \(4\) are not divisible by the attention tensor-parallel"):
        Recipe(ep=8, tp=1).validate(small)
    with pytest.raises(RecipeError, match=r"routed experts \(16\) are not divisible by ep = 32"):
        Recipe(ep=32, dp=8).validate(small)


@pytest.mark.parametrize("recipe, heads, msg", [
    # the mesh is (dp, ep / dp, tp): a DP group is a slice of the expert groups
    (Recipe(ep=2, tp=4, dp=4), 8, "dp=4 must divide ep=2"),
    # DCP and SP run over whole mesh axes of one attention group
    (Recipe(ep=8, tp=1, dp=2, dcp=2), 8, r"dcp=2 must be 1, tp=1, ep/dp=4 or the attention group 4"),
    (Recipe(ep=2, tp=4, dp=2, sp=2), 8, r"sp=2 must be 1, tp=4, ep/dp=1 or the attention group 4"),
    (Recipe(ep=8, tp=1, dcp=4), 8, r"dcp=4 must be 1, tp=1, ep/dp=8 or the attention group 8"),
    # heads split over the attention group (6 heads: groups of 1, 2 or 3 ranks only)
    (Recipe(ep=4, tp=2, dp=2), 6, r"KDA heads \(6\) are not divisible by the attention tensor-parallel degree "
                                  r"\(devices / dp\) = 4"),
])
def test_validate_rejects_what_the_step_cannot_run(recipe, heads, msg):
    """What ``validate`` accepts runs (``test_attention_dp.py`` builds every recipe on 8 devices
    that validates); these do not fit the mesh layout or the model and say why."""
    cfg = k3_small(kda_num_heads=heads, mla_num_heads=heads, num_experts=16)
    with pytest.raises(RecipeError, match=msg):
        recipe.validate(cfg, num_devices=8)
    Recipe(ep=4, tp=2, dp=4, dcp=2).validate(cfg, num_devices=8)  # the recipe fits 6 heads


def test_memory_plan_full_k3_on_32_devices():
    from k3serve.server.cli import main
    from k3serve.sharding.memory import param_inventory
    from k3serve.sharding.memory import plan_memory, weights_per_device

    full = k3_full()
    inv = param_inventory(full)
    tp_only, dcp32, dp2 = (plan_memory(full, PRESETS[n] if n in PRESETS else Recipe.parse(n), inv)
                           for n in ("ep=8,tp=4", "v7-32-decode", "v7-32-decode-dp2"))
    # 24 MLA layers x 640 (576-wide rows stored in whole 128-lane vregs) x 2 bytes
    assert tp_only.kv_per_token_total == 30_720 and dcp32.kv_per_token_per_device == 30_720 / 32
    assert dp2.kv_per_token_per_device == 30_720 / 16
    assert tp_only.kda_state_per_request == 69 * (96 * 128 * 128 + 3 * 3 * 96 * 128) * 4
    # all weight bytes are accounted for exactly once over the mesh when nothing is replicated...
    total = sum(math.prod(s) * b for _, s, b in inv)
    single = weights_per_device(inv, Recipe())
    assert single == total
    # ...and the 32-way split puts the experts' share on each device, plus what the load keeps
    # whole on every device (the routers, 1.18 GB; MLA's low-rank down-projections, ...)
    experts = sum(math.prod(s) * b for p, s, b in inv if ".experts." in p and "shared" not in p)
    assert experts / 32 < tp_only.weights_per_device < experts / 32 + 6e9  # measured: 45.2 + 5.6 GB
    assert dp2.weights_per_device > dcp32.weights_per_device  # attention copied per DP group
    assert tp_only.max_concurrent_requests == 10  # (0.9 x 101.74 GB - 50.77 GB) / 4.07 GB per request
    # each request also pays serve's 2 prefix-cache KDA snapshot slots (0: caching off)
    assert dcp32.snapshots_per_request == 2
    assert dcp32.per_request_per_device == 131072 * 960 + 3 * dcp32.kda_state_per_request_per_device
    assert dcp32.max_concurrent_requests == 240 and dp2.max_concurrent_requests == 220
    off = plan_memory(full, PRESETS["v7-32-decode"], inv, snapshots_per_request=0)
    assert off.max_concurrent_requests == 290
    with pytest.raises(ValueError):
        plan_memory(full, PRESETS["v7-32-decode"], inv, snapshots_per_request=-1)
    assert main(["plan", "--recipe", "ep=8,tp=4,dp=3"]) == 2

