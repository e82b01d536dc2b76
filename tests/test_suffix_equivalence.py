"""The path-compressed suffix tree of ``server/spec/suffix.py`` against the plain trie it
replaced (``tests/_suffix_trie_oracle.py``, one node per token of every suffix): the same
counts, matches and continuations (ties included) after every operation of random
add/extend/remove sequences, and the same proposals, tenant sizes and evictions of the
drafter on random start/extend/propose/finish/abort sequences over several tenants, with
small vocabularies (text that repeats a lot) and larger ones; the structure's own invariants
after every operation; removal back to zero nodes; its size on text that never repeats; the
engine's drafter on a long prompt. Host-only, pure Python."""
from __future__ import annotations

import gc
import random
import tracemalloc
from types import SimpleNamespace

import pytest

from _suffix_trie_oracle import SuffixDrafter as TrieDrafter
from _suffix_trie_oracle import SuffixTree as Trie
from k3serve.server.spec.drafting import SuffixEngineDrafter
from k3serve.server.spec.suffix import SuffixDrafter, SuffixTree


def _stored_nodes(tree: SuffixTree):
    stack = list((tree._root.children or {}).values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend((node.children or {}).values())


def _assert_names_live_sequences(tree: SuffixTree) -> None:
    """Every node names an occurrence in a sequence still in the tree (none keeps a removed
    sequence's tokens alive)."""
    live = {id(tokens) for tokens in tree._sequences.values()}
    assert all(id(node.tokens) in live for node in _stored_nodes(tree))


def _text(rng: random.Random, vocab: int, n: int, pool: list[list[int]]) -> list[int]:
    """Random tokens, or a piece of earlier text (possibly with a change) to make repeats."""
    if pool and rng.random() < 0.5:
        source = rng.choice(pool)
        if source:
            i = rng.randrange(len(source))
            piece = source[i : i + n]
            if piece and rng.random() < 0.3:
                piece[rng.randrange(len(piece))] = rng.randrange(vocab)
            return piece
    return [rng.randrange(vocab) for _ in range(n)]


def _contexts(rng: random.Random, vocab: int, sequences: list[list[int]], depth: int):
    yield [rng.randrange(vocab) for _ in range(rng.randint(0, depth + 2))]
    yield []
    for seq in rng.sample(sequences, min(3, len(sequences))):
        if seq:
            end = rng.randint(1, len(seq))
            context = seq[max(0, end - rng.randint(1, depth + 3)) : end]
            yield context
            yield [rng.randrange(vocab)] + context


@pytest.mark.parametrize("vocab", [1, 2, 3, 6, 40])
def test_tree_equals_the_trie_on_random_operations(vocab):
    rng = random.Random(1000 + vocab)
    for case in range(40):
        depth = rng.randint(1, 9)
        tree, trie, live = SuffixTree(depth), Trie(depth), {}
        for op in range(40):
            kind = rng.random()
            if kind < 0.3 or not live:
                seq_id = (case, op)
                live[seq_id] = _text(rng, vocab, rng.randint(0, 30), list(live.values()))
                tree.add_sequence(seq_id, live[seq_id])
                trie.add_sequence(seq_id, live[seq_id])
            elif kind < 0.75:
                seq_id = rng.choice(list(live))
                new = _text(rng, vocab, rng.choice([1, 1, 2, 3, 8, 20]), list(live.values()))
                if rng.random() < 0.5:
                    tree.extend(seq_id, new)
                else:  # a token at a time: the same tree
                    for token in new:
                        tree.extend(seq_id, [token])
                trie.extend(seq_id, new)
                live[seq_id] += new
            else:  # any sequence, not only the oldest
                seq_id = rng.choice(list(live))
                tree.remove_sequence(seq_id)
                trie.remove_sequence(seq_id)
                del live[seq_id]
            tree.check_invariants()
            assert tree.path_counts() == trie.path_counts()
            assert tree.num_nodes == trie.num_nodes and tree.num_sequences == trie.num_sequences
            assert tree.num_stored_nodes <= tree.num_nodes
            for context in _contexts(rng, vocab, list(live.values()), depth):
                for max_depth in {0, 1, rng.randint(1, depth + 1), depth + 1}:
                    max_tokens = rng.choice([0, 1, 3, 2 * depth + 5])
                    assert tree.match(context, max_depth, max_tokens) == trie.match(context, max_depth, max_tokens), \
                        (case, op, context, max_depth, max_tokens)
        for seq_id in list(live):
            tree.remove_sequence(seq_id)
            tree.check_invariants()
        assert tree.num_nodes == 0 and tree.num_stored_nodes == 0 and tree.path_counts() == {}
        assert tree._root.children == {}


def _drafter_pair(rng: random.Random):
    kwargs = dict(max_depth=rng.randint(1, 10), max_tokens=rng.choice([0, 1, 4, 16]),
                  max_tenant_sequences=rng.choice([0, 1, 2, 3, 256]), min_match=rng.randint(1, 3),
                  length_factor=rng.choice([0.5, 1.0, 2.5]))
    return SuffixDrafter(**kwargs), TrieDrafter(**kwargs)


@pytest.mark.parametrize("vocab", [2, 3, 5, 50])
def test_drafter_equals_the_trie_drafter_on_random_calls(vocab):
    rng = random.Random(2000 + vocab)
    tenants = ["a", "b", "c"]
    for case in range(30):
        drafter, oracle = _drafter_pair(rng)
        live: dict[int, str] = {}
        texts: list[list[int]] = []  # prompts and outputs so far, to replay pieces of
        next_id = 0
        for op in range(80):
            kind = rng.random()
            if kind < 0.2 or not live:
                # ids are reused once a request has left
                rid = rng.choice([r for r in range(next_id + 1) if r not in live])
                next_id = max(next_id, rid + 1)
                live[rid] = rng.choice(tenants)
                prompt = _text(rng, vocab, rng.randint(0, 25), texts)
                texts.append(prompt)
                drafter.start(rid, live[rid], prompt)
                oracle.start(rid, live[rid], prompt)
            elif kind < 0.6:
                rid = rng.choice(list(live))
                new = _text(rng, vocab, rng.choice([1, 1, 2, 4, 9]), texts)
                texts.append(new)
                drafter.extend(rid, new)
                oracle.extend(rid, new)
            elif kind < 0.75:
                rid = rng.choice(list(live))
                max_tokens = rng.choice([None, 0, 1, 5, 30])
                assert drafter.propose(rid, max_tokens) == oracle.propose(rid, max_tokens)
            elif kind < 0.93:
                rid = rng.choice(list(live))
                drafter.finish(rid)
                oracle.finish(rid)
                del live[rid]
            else:
                rid = rng.choice(list(live))
                drafter.abort(rid)
                oracle.abort(rid)
                del live[rid]
            for rid in live:
                assert drafter.propose(rid) == oracle.propose(rid), (case, op, rid)
            for tenant in tenants:
                assert drafter.num_tenant_sequences(tenant) == oracle.num_tenant_sequences(tenant)
                assert drafter.num_tenant_nodes(tenant) == oracle.num_tenant_nodes(tenant)
            for history in drafter._tenants.values():
                history.tree.check_invariants()
                _assert_names_live_sequences(history.tree)  # oldest evicted first: no leftovers
            for request in drafter._requests.values():
                request.tree.check_invariants()
                assert request.tokens is request.tree.tokens(next(iter(request.tree._sequences)))


def test_tenant_isolation_and_eviction_back_to_zero():
    """Two tenants replaying each other's text: each is proposed only its own; evicting
    every output of a tenant's tree (oldest first) brings it back to zero nodes."""
    rng = random.Random(7)
    drafter, oracle = SuffixDrafter(max_depth=6, max_tenant_sequences=4), TrieDrafter(max_depth=6, max_tenant_sequences=4)
    text = {"a": [rng.randrange(5) for _ in range(40)], "b": [rng.randrange(5, 10) for _ in range(40)]}
    for i in range(12):
        for tenant in ("a", "b"):
            rid = f"{tenant}{i}"
            start = rng.randrange(30)
            for d in (drafter, oracle):
                d.start(rid, tenant, text[tenant][start : start + 3])
                d.extend(rid, text[tenant][start + 3 : start + 10])
            other = "b" if tenant == "a" else "a"
            probe = f"probe-{rid}"
            for d in (drafter, oracle):
                d.start(probe, tenant, text[other][:5])  # the other tenant's text
            got = drafter.propose(probe)
            assert got == oracle.propose(probe)
            assert not set(got) & set(text[other])  # never the other tenant's tokens
            for d in (drafter, oracle):
                d.abort(probe)
                d.finish(rid)
            assert drafter.num_tenant_nodes(tenant) == oracle.num_tenant_nodes(tenant)
    tree = drafter._tenants["a"].tree
    assert tree.num_sequences == 4 and tree.num_stored_nodes > 0
    for seq_id in list(drafter._tenants["a"].finished):
        tree.remove_sequence(seq_id)
        tree.check_invariants()
        _assert_names_live_sequences(tree)
    assert tree.num_nodes == 0 and tree.num_stored_nodes == 0


def test_tree_is_small_on_text_that_never_repeats():
    """About one stored node per token where the trie had ``depth`` (here 25), and at most a
    few hundred bytes per token (the trie: about 6.9 KB)."""
    rng = random.Random(11)
    n = 20_000
    prompt = [rng.randrange(163_840) for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    drafter = SuffixDrafter(max_depth=24)
    drafter.start("r", "t", prompt)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tree = drafter._requests["r"].tree
    assert tree.num_stored_nodes < 1.2 * n and tree.num_nodes > 24 * n - 400
    assert held / n < 400, held / n
    drafter.extend("r", prompt[:30])  # a repeat of the start: drafts its continuation
    assert drafter.propose("r", 5) == prompt[30:35]


def test_tree_continues_a_long_repeat_in_full():
    """A long repeated block: every window walks shared chains, and a proposal follows the
    block across the depth limit, as the trie did."""
    rng = random.Random(12)
    block = [rng.randrange(1000) for _ in range(300)]
    tree, trie = SuffixTree(9), Trie(9)
    for t in (tree, trie):
        t.add_sequence(0, block * 3 + block[:50])
    tree.check_invariants()
    assert tree.num_stored_nodes <= 2 * len(block)
    assert tree.match(block[:50], 8, 100) == trie.match(block[:50], 8, 100) == (8, block[50:150])


def test_an_ended_request_leaves_no_garbage_cycle():
    """A request's tree is freed by reference counting when it finishes or is aborted (its
    windows' bookkeeping would otherwise tie its tokens and nodes in a cycle)."""
    rng = random.Random(13)
    drafter = SuffixDrafter(max_depth=8)
    gc.collect()
    gc.disable()
    try:
        for i, end in enumerate([drafter.finish, drafter.abort] * 3):
            drafter.start(i, "t", [rng.randrange(4) for _ in range(300)])
            drafter.extend(i, [rng.randrange(4) for _ in range(5)])
            drafter.propose(i)
            end(i)
        assert gc.collect() == 0
    finally:
        gc.enable()
    tree = drafter._tenants["t"].tree
    tree.check_invariants()
    tree.clear()
    assert tree.num_stored_nodes == tree.num_nodes == tree.num_sequences == 0


def test_engine_drafter_indexes_a_long_prompt_whole():
    """``SuffixEngineDrafter`` indexes up to 131,072 prompt tokens: a repeat 5,000 tokens
    back is drafted (the former 2,048-token window missed it)."""
    rng = random.Random(14)
    head = [rng.randrange(50_000) for _ in range(40)]
    prompt = head + [rng.randrange(50_000) for _ in range(5000)] + head[:8]
    req = SimpleNamespace(rid="r", salt=b"tenant", prompt=prompt, output=[])
    drafter = SuffixEngineDrafter(4)
    assert drafter.propose(req, 4) == head[8:12]
    capped = SuffixEngineDrafter(4, max_prompt_tokens=2048)
    assert capped.propose(req, 4) == []
    req.output = head[8:11]
    assert drafter.propose(req, 4) == head[11:15]
    assert drafter.propose(req, 2) == head[11:13]
    drafter.finish(req)
    assert drafter.drafter.num_tenant_sequences(b"tenant".hex()) == 1


def test_engine_drafter_indexes_a_long_prompt_in_pieces():
    """A prompt indexed ``index_tokens_per_call`` tokens per proposal: nothing is proposed until
    all of it is in; from then on the proposals (after each output extension, with and without
    ``after``) equal those of a drafter that indexed it whole, and the finished output — not the
    prompt's later pieces — joins the tenant's tree. A request finished before its prompt was
    all in keeps nothing."""
    rng = random.Random(15)
    head = [rng.randrange(300) for _ in range(30)]
    prompt = head + [rng.randrange(300) for _ in range(200)] + head[:6]
    whole, pieces = SuffixEngineDrafter(4, index_tokens_per_call=None), SuffixEngineDrafter(4, index_tokens_per_call=64)
    a = SimpleNamespace(rid="r", salt=b"t", prompt=prompt, output=[])
    b = SimpleNamespace(rid="r", salt=b"t", prompt=prompt, output=[])
    assert whole.propose(a, 4) == head[6:10]
    assert [pieces.propose(b, 4) for _ in range(3)] == [[], [], []]  # 236 tokens: pieces 1..3 of 4
    assert pieces.propose(b, 4) == head[6:10]
    for out in (head[6:9], head[6:14], head[6:14] + [7, 8]):
        a.output = b.output = list(out)
        for after in ((), (head[14],), (1, 2)):
            assert pieces.propose(b, 5, after) == whole.propose(a, 5, after), (out, after)
    whole.finish(a)
    pieces.finish(b)
    t = b"t".hex()
    assert pieces.drafter.num_tenant_sequences(t) == whole.drafter.num_tenant_sequences(t) == 1
    assert pieces.drafter.num_tenant_nodes(t) == whole.drafter.num_tenant_nodes(t)
    c = SimpleNamespace(rid="c", salt=b"u", prompt=prompt, output=[])
    assert pieces.propose(c, 4) == []
    c.output = [1, 2]
    pieces.finish(c)  # finished with its prompt half indexed: nothing kept, nothing left behind
    assert pieces.drafter.num_tenant_sequences(b"u".hex()) == 0 and not pieces._prompt_left
    with pytest.raises(ValueError, match="index_tokens_per_call"):
        SuffixEngineDrafter(4, index_tokens_per_call=0)

