"""The weight-free drafters of speculative decoding (``server/spec/ngram.py`` and
``server/spec/suffix.py``, issue #34): exact proposals on hand-made sequences, the incremental
n-gram index against the scanning drafter on random sequences after every append, the suffix
tree's counts and matches against brute force, tenant isolation, eviction back to an empty
tree, and the adaptive draft length. Host-only, pure Python."""
from __future__ import annotations

import numpy as np
import pytest

from k3serve.server.spec.ngram import NgramDrafter, NgramIndex
from k3serve.server.spec.suffix import SuffixDrafter, SuffixTree


def _index(tokens, **kwargs) -> NgramIndex:
    index = NgramIndex(**kwargs)
    index.extend(tokens)
    return index


# -- n-gram (prompt lookup) ------------------------------------------------------------------

@pytest.mark.parametrize("tokens, kwargs, expected", [
    ([1, 2, 3, 4, 1, 2], {}, [3, 4, 1, 2]),
    ([1, 2, 3, 4, 1, 2], {"max_tokens": 2}, [3, 4]),
    # the most recent earlier occurrence of [1, 2] is the one followed by 8
    ([1, 2, 9, 1, 2, 8, 1, 2], {}, [8, 1, 2]),
    # the longest suffix wins over a more recent shorter one: [5, 1, 2] -> 7, not [1, 2] -> 8
    ([5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2], {}, [7, 6, 1, 2, 8, 5, 1]),
    # ... unless it is longer than max_ngram: then [1, 2] and its latest occurrence
    ([5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2], {"max_ngram": 2}, [8, 5, 1, 2]),
    # an occurrence may overlap the suffix; the proposal is what follows, up to the end
    ([1, 1, 1, 1], {}, [1]),
    ([3, 1, 1, 1, 1], {"max_ngram": 2}, [1]),
    # the single-token fallback, and min_ngram switching it off
    ([4, 9, 5, 6, 9], {}, [5, 6, 9]),
    ([4, 9, 5, 6, 9], {"min_ngram": 2}, []),
    # nothing matches / too short / a zero budget
    ([1, 2, 3, 4], {}, []),
    ([], {}, []),
    ([7], {}, []),
    ([1, 2, 1, 2], {"max_tokens": 0}, []),
])
def test_ngram_exact_proposals(tokens, kwargs, expected):
    assert NgramDrafter(**kwargs).propose(tokens) == expected
    assert _index(tokens, **kwargs).propose() == expected


def test_ngram_per_call_max_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter = NgramDrafter(max_tokens=3)
    assert drafter.propose(tokens) == [3, 4, 5]
    assert drafter.propose(tokens, max_tokens=5) == [3, 4, 5, 6, 1]
    assert drafter.propose(tokens, max_tokens=0) == []
    index = drafter.new_index()
    index.extend(tokens)
    assert (index.propose(), index.propose(max_tokens=1)) == ([3, 4, 5], [3])
    assert len(index) == len(tokens)
    # numpy input, plain ints out
    assert NgramDrafter().propose(np.array(tokens)) == [3, 4, 5, 6, 1, 2]
    assert all(type(t) is int for t in NgramDrafter().propose(np.array(tokens)))


@pytest.mark.parametrize("kwargs, message", [
    ({"min_ngram": 0}, "min_ngram"),
    ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_ngram_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramDrafter(**kwargs)
    with pytest.raises(ValueError, match=message):
        NgramIndex(**kwargs)


def test_ngram_negative_call_budget():
    with pytest.raises(ValueError, match="max_tokens"):
        NgramDrafter().propose([1, 1], max_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        _index([1, 1]).propose(max_tokens=-1)


def test_ngram_index_agrees_with_the_scan():
    """~200 random sequences over 5 tokens, various settings, checked after every append."""
    rng = np.random.default_rng(34)
    settings = [(4, 1, 7), (3, 2, 5), (5, 3, 3), (2, 2, 10), (1, 1, 4)]
    checks = hits = 0
    for case in range(200):
        max_ngram, min_ngram, max_tokens = settings[case % len(settings)]
        drafter = NgramDrafter(max_ngram, min_ngram, max_tokens)
        index = drafter.new_index()
        tokens = [int(t) for t in rng.integers(0, 5, int(rng.integers(0, 301)))]
        pos = 0
        while pos < len(tokens):
            step = int(rng.integers(1, 4))  # appends of 1..3 tokens (a prompt, accepted drafts)
            index.extend(tokens[pos : pos + step])
            pos = min(pos + step, len(tokens))
            expected = drafter.propose(tokens[:pos])
            assert index.propose() == expected, (case, pos)
            checks += 1
            hits += bool(expected)
    assert checks > 5000 and 0.5 * checks < hits < checks  # both outcomes well exercised


def test_ngram_index_scales_to_long_sequences():
    """100k tokens through the index (no wall-time assert: O(max_ngram**2) per token keeps it
    well under a second here); a pattern planted far back is found from the tail."""
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(1000, 50_000, 100_000)]
    planted = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    tokens[500:509] = planted
    tokens[-3:] = planted[:3]
    index = NgramIndex()
    for start in range(0, len(tokens), 1000):
        index.extend(tokens[start : start + 1000])
        index.propose()
    assert len(index) == 100_000
    assert index.propose() == planted[3:] + tokens[509:510]
    assert index.propose() == NgramDrafter().propose(tokens)


# -- suffix tree -----------------------------------------------------------------------------

def _brute_counts(sequences, depth):
    counts = {}
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + depth) + 1):
                key = tuple(seq[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def _brute_match_len(sequences, context, max_len):
    """Longest suffix of ``context`` (<= max_len) that occurs followed by a token."""
    best = 0
    for k in range(1, min(max_len, len(context)) + 1):
        suffix = list(context[len(context) - k :])
        if any(seq[i : i + k] == suffix for seq in sequences for i in range(len(seq) - k)):
            best = k
    return best


def test_suffix_tree_counts_and_matches_against_brute_force():
    rng = np.random.default_rng(2411)
    for case in range(30):
        depth = int(rng.integers(1, 7))
        tree, live = SuffixTree(depth), {}
        for op in range(25):
            kind = rng.integers(0, 3)
            if kind == 0 or not live:
                seq_id = (case, op)
                live[seq_id] = [int(t) for t in rng.integers(0, 3, int(rng.integers(0, 12)))]
                tree.add_sequence(seq_id, live[seq_id])
            elif kind == 1:
                seq_id = list(live)[int(rng.integers(0, len(live)))]
                new = [int(t) for t in rng.integers(0, 3, int(rng.integers(0, 5)))]
                tree.extend(seq_id, new)
                live[seq_id] += new
            else:
                seq_id = list(live)[int(rng.integers(0, len(live)))]
                tree.remove_sequence(seq_id)
                del live[seq_id]
            expected = _brute_counts(live.values(), depth)
            assert tree.path_counts() == expected
            assert tree.num_nodes == len(expected) and tree.num_sequences == len(live)
            context = [int(t) for t in rng.integers(0, 3, 8)]
            for max_depth in (1, 3, 8):
                match_len, continuation = tree.match(context, max_depth, 1)
                longest = min(max_depth, depth - 1)
                assert match_len == _brute_match_len(list(live.values()), context, longest)
                if match_len:  # the first continuation token is a most frequent follower
                    suffix = tuple(context[len(context) - match_len :])
                    followers = {t: expected.get(suffix + (t,), 0) for t in range(3)}
                    assert followers[continuation[0]] == max(followers.values()) > 0
                else:
                    assert continuation == []
        for seq_id in list(live):
            tree.remove_sequence(seq_id)
        assert tree.num_nodes == 0 and tree.path_counts() == {}


def test_suffix_tree_majority_and_recency():
    tree = SuffixTree(8)
    for i, follower in enumerate([7, 7, 8, 7, 9]):
        tree.add_sequence(i, [1, 2, 3, follower])
    assert tree.match([50, 1, 2, 3], 8, 4) == (3, [7])  # 3 x 7 beats the more recent 8 and 9
    ties = SuffixTree(8)
    ties.add_sequence("a", [1, 2, 3, 7])
    ties.add_sequence("b", [1, 2, 3, 8])
    assert ties.match([1, 2, 3], 8, 4) == (3, [8])  # one each: the most recent
    ties.extend("a", [1, 2, 3, 7])
    assert ties.match([1, 2, 3], 8, 1) == (3, [7])  # now seen twice


def test_suffix_tree_continues_past_its_depth():
    """The walk re-anchors where the trie ends, so a repeating pattern is extended as far as
    asked, even beyond the depth."""
    tree = SuffixTree(4)
    tree.add_sequence(0, [5, 6, 7, 8] * 3)
    assert tree.match([5, 6], 10, 9) == (2, [7, 8, 5, 6, 7, 8, 5, 6, 7])
    assert tree.match([5, 6], 1, 2) == (1, [7, 8])  # the matched length respects max_depth
    assert tree.match([9], 10, 5) == (0, [])


def test_suffix_tree_errors():
    tree = SuffixTree(3)
    tree.add_sequence("x", [1, 2])
    with pytest.raises(ValueError, match="already"):
        tree.add_sequence("x", [3])
    with pytest.raises(KeyError, match="'y'"):
        tree.extend("y", [1])
    with pytest.raises(KeyError, match="'y'"):
        tree.remove_sequence("y")
    with pytest.raises(ValueError, match="depth"):
        SuffixTree(0)
    with pytest.raises(ValueError, match="max_tokens"):
        tree.match([1], 3, -1)


# -- suffix drafter --------------------------------------------------------------------------

def test_ngram_index_proposes_after_unappended_tokens():
    """``propose(after=x)`` (async scheduling: an in-flight row's drafts) = the scan over the
    sequence followed by ``x``, and leaves the index as it was (the next proposals and appends
    answer as if the call never happened)."""
    rng = np.random.default_rng(35)
    checks = hits = 0
    for case in range(150):
        drafter = NgramDrafter(4, 1, 9)
        index, shadow = drafter.new_index(), drafter.new_index()
        tokens = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 120)))]
        pos = 0
        while pos < len(tokens):
            step = int(rng.integers(1, 4))
            index.extend(tokens[pos : pos + step])
            shadow.extend(tokens[pos : pos + step])
            pos = min(pos + step, len(tokens))
            after = [int(t) for t in rng.integers(0, 4, int(rng.integers(0, 5)))]
            expected = drafter.propose(tokens[:pos] + after, 5)
            assert index.propose(5, after) == expected, (case, pos, after)
            assert index.propose() == shadow.propose() and index._latest_start == shadow._latest_start
            checks += 1
            hits += bool(expected)
    assert checks > 1000 and 0.3 * checks < hits < checks


def test_suffix_drafter_proposes_after_unappended_tokens():
    drafter = SuffixDrafter()
    drafter.start("r", "t", [5, 6, 7, 8] * 3 + [5])
    # the context 5 6 (the request's 5, then an in-flight 6) occurred earlier, followed by 7 8
    assert drafter.propose("r", max_tokens=3, after=[6]) == [7, 8, 5]
    assert drafter.propose("r", max_tokens=3, after=[6, 7]) == [8, 5, 6]
    assert drafter.propose("r", max_tokens=3) == [6, 7, 8]  # nothing was appended


def test_suffix_drafter_own_tree_repeated_pattern():
    drafter = SuffixDrafter()
    drafter.start("r", "t", [5, 6, 7, 8] * 3 + [5, 6])
    # the last 10 tokens occurred earlier, followed by 7: a 10-token draft
    assert drafter.propose("r") == [7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    assert drafter.propose("r", max_tokens=3) == [7, 8, 5]
    drafter.extend("r", [7, 8])
    assert drafter.propose("r") == [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    assert drafter.propose("r", max_tokens=0) == []


def test_suffix_drafter_adaptive_length():
    story = list(range(100, 140))
    drafter = SuffixDrafter(max_tokens=16, min_match=2)
    drafter.start("seed", "t", [1])
    drafter.extend("seed", story)
    drafter.finish("seed")
    for matched, expected_len in [(1, 0), (2, 2), (5, 5), (12, 12), (20, 16)]:
        drafter.start(matched, "t", [7] + story[:matched])
        assert drafter.propose(matched) == story[matched : matched + expected_len], matched
    # a match is capped at max_depth, and a full-length match still has a continuation
    shallow = SuffixDrafter(max_depth=4)
    shallow.start("seed", "t", [])
    shallow.extend("seed", story)
    shallow.finish("seed")
    shallow.start("a", "t", story[:10])
    assert shallow.propose("a") == story[10:14]
    halved = SuffixDrafter(length_factor=0.5, min_match=1)
    halved.start("seed", "t", [])
    halved.extend("seed", story)
    halved.finish("seed")
    halved.start("a", "t", story[:5])  # ceil(0.5 * 5) = 3
    assert halved.propose("a") == story[5:8]


def test_suffix_drafter_tenant_isolation():
    pattern = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter = SuffixDrafter()
    drafter.start("a1", "tenant-a", [1, 2])
    drafter.extend("a1", pattern)
    drafter.finish("a1")
    drafter.start("a2", "tenant-a", [3, 10, 11, 12])
    drafter.start("b1", "tenant-b", [3, 10, 11, 12])
    assert drafter.propose("a2") == [13, 14, 15]
    assert drafter.propose("b1") == []
    assert (drafter.num_tenant_sequences("tenant-a"), drafter.num_tenant_sequences("tenant-b")) == (1, 0)
    # B's own finished output is proposed to B; A's stays A's
    drafter.extend("b1", [50, 11, 12, 13, 99, 98])
    drafter.finish("b1")
    drafter.start("b2", "tenant-b", [0, 10, 11, 12, 13])
    drafter.start("a3", "tenant-a", [0, 10, 11, 12, 13])
    assert drafter.propose("b2") == [99, 98]  # B's output holds [11, 12, 13] -> 99, 98
    assert drafter.propose("a3") == [14, 15, 16, 17]


def test_suffix_drafter_own_tree_wins_ties():
    drafter = SuffixDrafter(min_match=1)
    drafter.start("old", "t", [])
    drafter.extend("old", [1, 2, 8])
    drafter.finish("old")
    drafter.start("r", "t", [1, 2, 9, 0, 1, 2])  # own: [1, 2] -> 9; tenant: [1, 2] -> 8
    assert drafter.propose("r") == [9, 0]
    drafter.start("s", "t", [4, 1, 2, 9, 5, 4, 1, 2])  # own [4, 1, 2] is longer
    assert drafter.propose("s") == [9, 5, 4]
    drafter.start("u", "t", [7, 1, 2])  # only the tenant tree matches
    assert drafter.propose("u") == [8]


def test_suffix_drafter_eviction_and_empty_tenant_tree():
    drafter = SuffixDrafter(max_depth=6, max_tenant_sequences=2)
    outputs = [[1, 2, 3, 4, 5], [6, 7, 8, 9], [1, 2, 30, 40]]
    for i, output in enumerate(outputs):
        drafter.start(i, "t", [0])
        drafter.extend(i, output)
        drafter.finish(i)
    # the first output was evicted: its continuation is gone, the tree holds exactly the last two
    kept = SuffixTree(7)
    kept.add_sequence(1, outputs[1])
    kept.add_sequence(2, outputs[2])
    assert drafter.num_tenant_sequences("t") == 2
    assert drafter.num_tenant_nodes("t") == kept.num_nodes > 0
    drafter.start("q", "t", [9, 1, 2])
    assert drafter.propose("q") == [30, 40]
    # a tree whose sequences are all evicted is empty
    tree = SuffixTree(7)
    for i, output in enumerate(outputs):
        tree.add_sequence(i, output * 3)
    for i in range(len(outputs)):
        tree.remove_sequence(i)
    assert tree.num_nodes == 0 and tree.num_sequences == 0
    # max_tenant_sequences=0 keeps nothing
    none_kept = SuffixDrafter(max_tenant_sequences=0)
    none_kept.start("r", "t", [1])
    none_kept.extend("r", [2, 3])
    none_kept.finish("r")
    assert none_kept.num_tenant_nodes("t") == 0


def test_suffix_drafter_abort_keeps_nothing():
    drafter = SuffixDrafter()
    drafter.start("r", "t", [1, 2])
    drafter.extend("r", [3, 4, 5, 6])
    drafter.abort("r")
    assert drafter.num_tenant_sequences("t") == 0 and drafter.num_tenant_nodes("t") == 0
    drafter.start("s", "t", [9, 3, 4])
    assert drafter.propose("s") == []
    # the id can be started again
    drafter.start("r", "t", [1])
    assert drafter.propose("r") == []


def test_suffix_drafter_errors():
    drafter = SuffixDrafter()
    for call, args in [(drafter.extend, ("nope", [1])), (drafter.finish, ("nope",)),
                       (drafter.abort, ("nope",)), (drafter.propose, ("nope",))]:
        with pytest.raises(KeyError, match="unknown request 'nope'"):
            call(*args)
    drafter.start("r", "t", [1])
    with pytest.raises(ValueError, match="already started"):
        drafter.start("r", "t", [1])
    drafter.finish("r")
    with pytest.raises(KeyError, match="unknown request 'r'"):
        drafter.propose("r")
    drafter.start("s", "t", [1])
    with pytest.raises(ValueError, match="max_tokens"):
        drafter.propose("s", max_tokens=-1)
    for kwargs, message in [({"max_depth": 0}, "max_depth"), ({"max_tokens": -1}, "max_tokens"),
                            ({"max_tenant_sequences": -1}, "max_tenant_sequences"),
                            ({"min_match": 0}, "min_match"), ({"length_factor": 0.0}, "length_factor")]:
        with pytest.raises(ValueError, match=message):
            SuffixDrafter(**kwargs)
