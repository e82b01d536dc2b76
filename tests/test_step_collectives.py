"""No compiled step moves a whole parameter or cache array between devices.

XLA's Auto partitioner places the collectives of a step. Two of its choices did that with
every step, without changing a token: the latent MoE down/up projections were computed in
the expert dispatch's token layout, which all-gathered both weights in every MoE layer (on
the full K3, 2 × 7168 × 3584 bf16 per layer and chip), and with dp=1 the KDA conv rows were
scattered into the replicated pool split over channels, then the whole pool was gathered.
``StepParallel.latent_down``/``latent_up`` and the per-device ``put_slots`` pin the layouts.
The check reads every warmed-up program's optimized HLO (``sharding.collectives``) under a
recipe without DP, one with attention DP, and one with DP and expert TP, in 8-device children.
"""
from __future__ import annotations

import os

import pytest

from _util import run_children

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPES = ["ep=4,tp=2,dcp=8", "ep=8,tp=1,dp=2,dcp=4", "ep=4,tp=2,dp=2,dcp=4"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_children(os.path.join(HERE, "_collectives_check.py"), [tmp_path_factory.mktemp("coll")],
                        [{"recipe": r} for r in RECIPES], 8, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_no_step_gathers_a_whole_weight_or_cache_array(results, recipe):
    r = results[recipe]
    assert r["devices"] == 8 and r["programs"] >= 4 and len(r["tokens"]) == 3, r
    assert "ffn.1.block_sparse_moe.routed_expert_down_proj.weight" in r["arrays"], r["arrays"]
    assert "cache.kda_conv" in r["arrays"], r["arrays"]
    assert any(k.get("all-gather") or k.get("all-reduce") for k in r["kinds"].values()), r["kinds"]  # it reads them
    assert r["gathers"] == [], "\n".join(r["gathers"])
