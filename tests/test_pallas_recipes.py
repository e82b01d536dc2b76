"""The Pallas kernel backend under sharding recipes (issue #33), on 8 CPU virtual devices in
one subprocess (body: ``_pallas_recipes_check.py``), every kernel interpreted.

A 3-layer K3 (two KDA layers, an MLA layer, LatentMoE with MXFP4 experts; 8 KDA and MLA
heads, 8 experts) loaded with ``kernels="pallas-interpret"`` decodes greedily under two recipes and
gives the one-device ``kernels="reference"`` tokens (a prefill of two prompts, then a decode
step: both the prefill and the decode kernels), logits within 1e-4; the model is loaded
straight into each recipe's shards and the experts' repack keeps every placement:

* ``ep=4,tp=2,dcp=4``: EP + TP, MLA pages over 4 DCP ranks (each rank writes only its pages,
  attends over its own columns, partials merged by their LSE), KDA heads one per device, the
  MXFP4 grouped matmul per EP rank behind the padded all_to_all;
* ``ep=4,tp=2,dp=2,dcp=2``: attention DP (each group on its own slots and pages, both groups
  used), DCP 2 inside a group, two KDA heads per device.

The step's jaxpr holds the six kernel call sites of the scan body (MLA write and attend, KDA
decode and prefill, the gate/up and down grouped matmuls): the kernels ran, not the
references. Then the ragged exchange: ``expert_ffn_ep(impl="ragged")`` with the kernel on
layer 1 of a repacked stack equals the one-device reference (the collective emulated: XLA:CPU
has none). And the KDA kernels per rank on 2-layer pools under dp=2 with split heads, a prefix
hit (read slot != write slot), a fresh row and snapshots from a prefill and a decode row equal
the one-device kernels group by group (the conv windows go through the per-rank copy of the
conv pool and back); so does the speculative record mode per rank (decode rows with drafts
folding accepted drafts of an earlier step, the journal split over the groups and the heads)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _util import run_children

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = {"recipes": {"ep4tp2-dcp4": "ep=4,tp=2,dcp=4", "dp2-dcp2": "ep=4,tp=2,dp=2,dcp=2"},
        "lengths": [5, 7], "new_tokens": 2, "ragged_recipe": "ep=4,tp=2,dp=2"}
pytestmark = pytest.mark.slow  # interpreted kernels on 8 devices: three compiles, about a minute


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = run_children(os.path.join(HERE, "_pallas_recipes_check.py"), [tmp_path_factory.mktemp("pr")], [SPEC], 8,
                       timeout=900)
    print(json.dumps(res))
    return res


@pytest.mark.parametrize("name", list(SPEC["recipes"]))
def test_pallas_under_recipe_matches_the_reference(runs, name):
    ref, got = runs["reference"], runs[name]
    assert got["tokens"] == ref["tokens"], (got, ref)
    a, b = np.array(got["last_logits"]), np.array(ref["last_logits"])
    err = np.abs(a - b).max() / np.abs(b).max()
    assert err < 1e-4, (got, ref)
    assert ref["kernel_calls"] == 0 and got["kernel_calls"] == 6, got
    assert got["placement_kept"], got  # a placed load repacked in its shards, not moved
    if "dp" in name:
        assert sorted(set(got["groups"])) == [0, 1], got  # both DP groups served a row


def test_ragged_exchange_with_the_gmm_kernel(runs):
    assert runs["ragged_gmm_err"] < 1e-5, runs["ragged_gmm_err"]


def test_kda_pools_per_rank_with_snapshots(runs):
    assert runs["kda_pools_err"] < 1e-5, runs["kda_pools_err"]


def test_kda_record_mode_per_rank(runs):
    assert runs["kda_spec_pools_err"] < 1e-5, runs["kda_spec_pools_err"]
