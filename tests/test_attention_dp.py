"""Attention-DP recipes through the engine with warm-up, over small head and expert counts
(issue #12), in one subprocess with 8 CPU virtual devices (body: ``_attention_dp_check.py``).

Warm-up compiles every step shape ahead of time, and such a program only takes the input
shardings it was compiled for, so the cache a step returns must keep the layout it was
allocated with (``StepParallel.cache_shardings``). Before the fix the KDA state came back with
its heads gathered (``P(None, 'dp')`` for ``P(None, 'dp', ('ep', 'tp'), None, None)``) and
every recipe with dp > 1 crashed in warm-up. Each cell serves dp + 1 requests (one per DP
group, one queued) with ``LLM(..., max_num_seqs=dp, page_size=4)`` and checks the greedy
tokens equal the one-device ones, that nothing compiles after warm-up and that the cache
keeps its layout. Cells (8 devices; H = KDA = MLA heads, E experts):

* the issue's model, H=6 (divides tp but not ep·tp), E=32 top-8: ``ep=4,tp=2,dp=4,dcp=2``
  (the group is the tp axis, DCP over it) and ``ep=8,tp=1,dp=4,dcp=2`` (group and DCP on
  the ep axis), and ``ep=8,tp=1,dp=8`` (one device per group);
* H=4 (= the group, does not divide ep·tp), E=16 top-4: ``ep=4,tp=2,dp=2`` (no DCP, heads
  over ep × tp);
* H=8 (divides everything), E=8 top-2: ``ep=2,tp=4,dp=2,dcp=4`` (group = tp, full DCP: MLA
  heads whole per rank, one expert group per DP group) and ``ep=4,tp=2,dp=2,dcp=2`` (DCP on
  tp, heads over ep).

Prompts of 5 and 11 tokens (two prefill chunks of 8), a 16-token step budget and a bucket
growth of 16: token buckets 1 and 16, two step programs per cell to warm up. The cells run in
two children at once (``halves``): compiles are single-threaded, so two children use both cores.

Heads that do not divide the attention group, dp that does not divide ep and DCP/SP sizes
that are not whole mesh axes are rejected by ``Recipe.validate`` (``test_recipe.py``); the
child also checks that every recipe on 8 devices that validates for these models builds its
mesh and parallel step."""
from __future__ import annotations

import os

import pytest
from _util import run_children

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = {
    "models": {"h6e32": [6, 32, 8], "h4e16": [4, 16, 4], "h8e8": [8, 8, 2]},
    "cells": {
        "h6-ep4tp2-dp4-dcp2": ["h6e32", "ep=4,tp=2,dp=4,dcp=2"],
        "h6-ep8tp1-dp4-dcp2": ["h6e32", "ep=8,tp=1,dp=4,dcp=2"],
        "h6-ep8tp1-dp8": ["h6e32", "ep=8,tp=1,dp=8"],
        "h4-ep4tp2-dp2": ["h4e16", "ep=4,tp=2,dp=2"],
        "h8-ep2tp4-dp2-dcp4": ["h8e8", "ep=2,tp=4,dp=2,dcp=4"],
        "h8-ep4tp2-dp2-dcp2": ["h8e8", "ep=4,tp=2,dp=2,dcp=2"],
    },
}


def halves(spec: dict) -> list:
    """Two children, three cells each (each model's cells together: they share its one-device
    reference); the second also runs the validation sweep."""
    cells = list(spec["cells"])
    return [dict(spec, cells={c: spec["cells"][c] for c in part}, sweep=i == 1)
            for i, part in enumerate((cells[:3], cells[3:]))]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    return run_children(os.path.join(HERE, "_attention_dp_check.py"), [tmp_path_factory.mktemp("dp")],
                        halves(SPEC), 8, timeout=900)


@pytest.mark.parametrize("cell", list(SPEC["cells"]))
def test_attention_dp_engine_matches_one_device(matrix, cell):
    x = matrix[cell]
    assert "error" not in x, x
    assert x["equal"], x
    assert x["later_compiles"] == 0 and x["layout_kept"], x


def test_every_validated_recipe_builds(matrix):
    assert matrix["validate_sweep"] == [], matrix["validate_sweep"]
