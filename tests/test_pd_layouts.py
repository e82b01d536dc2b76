"""P/D handoffs between engines of different layouts (issue #16), in one subprocess with 8
virtual CPU devices (body: ``_pd_layout_check.py``; the way: ``server/engine/cache/deal.py``).

The decode's reservation says what each of its devices needs (``handoff_target``); the
prefill cuts those pieces out of its export on its own devices; the pieces go through JAX's
transfer server (two endpoints in one process) onto the decode's devices, which put the load's
inputs together. Pairs (prefill > decode): one device > ``ep=4,tp=1,dcp=4`` (a sequence's pages
dealt over four ranks), the same DCP layout on two sets of devices (rank r to rank r),
``ep=4,tp=2,dp=2,dcp=2`` (two DP groups) > one device, and ``dcp=4`` > the ``dp=2,dcp=2``
layout. Prompts of 3, 8 and 21 tokens with 4-token pages (inside a page, on a page boundary,
more pages than ranks). Every decode gives the one-device engine's greedy tokens with logprobs
within 1e-5; nothing leaks on either side. Swapping two ranks' pages or two head ranges of
the KDA state must change the output (the test can see a mis-dealt piece). One pair also goes
through gRPC servers with the test in smg's place."""
from __future__ import annotations

import math
import os

import pytest

from _util import run_children

HERE = os.path.dirname(os.path.abspath(__file__))
PAIRS = ["one>dcp4a", "dcp4a>dcp4b", "dp2>one", "dcp4b>dp2"]
LENGTHS = [3, 8, 21]
# two children at once (compiles are single-threaded): three engines each
SPECS = [{"lengths": LENGTHS, "pairs": PAIRS[:2], "mutate": [["rows", "one>dcp4a"], ["state", "one>dcp4a"]],
          "second_turn": "one>dcp4a"},
         {"lengths": LENGTHS, "pairs": PAIRS[2:], "grpc": "dcp4b>dp2"}]
pytestmark = pytest.mark.slow  # an 8-device child with four engines of different recipes


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_children(os.path.join(HERE, "_pd_layout_check.py"), [tmp_path_factory.mktemp("pdl")], SPECS, 8,
                        timeout=900)


@pytest.mark.parametrize("pair", PAIRS)
def test_handoff_across_layouts_matches_one_device(result, pair):
    x = result[pair]
    assert x["gap"] <= 1e-5, x


def test_same_layout_sends_only_what_each_rank_holds(result):
    """Between two ``dcp=4`` engines the 21-token prompt's six pages go as four rows pieces of
    two pages (ranks hold 2, 2, 1, 1: padded to 2), never the whole prompt to every rank."""
    assert result["dcp4a>dcp4b"]["bytes"] == result["one>dcp4a"]["bytes"]


def test_second_turn_reuses_the_decode_prefix_cache(result):
    """A second turn (the 21-token prompt, its output and five more tokens) to the ``dcp=4``
    decode with prefix caching on: it maps its cached prefix's whole pages (``first_page`` > 0)
    and asks only for the rest, with the one-device tokens and logprobs."""
    x = result["turn2:one>dcp4a"]
    assert x["gap"] <= 1e-5 and x["first_page"] >= 4, x


def test_through_the_grpc_servers(result):
    """The same through a prefill and a decode gRPC server (the destination in ``AwaitHandoff``,
    the pieces through the servers' transfer endpoints): ``dcp=4`` on four devices to
    ``dp=2,dcp=2`` on eight, the one-device greedy tokens, nothing held afterwards."""
    x = result["grpc:dcp4b>dp2"]
    assert x["equal"] and x["bytes"] > 0, x


@pytest.mark.parametrize("what", ["rows", "state"])
def test_misdealt_piece_changes_the_output(result, what):
    assert math.isinf(result[f"mutated:{what}:one>dcp4a"]["gap"]) or result[f"mutated:{what}:one>dcp4a"]["gap"] > 1e-3
