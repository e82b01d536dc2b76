"""Suffix decoding (the idea of arXiv 2411.04975, "SuffixDecoding"): drafts from suffix trees
over the request's own tokens and over the outputs of its tenant's recent finished requests.

:class:`SuffixTree` indexes every suffix of its sequences truncated to ``depth`` tokens: the
*window* ``tokens[p : p + depth]`` of each position ``p``. Seen as a trie (one node per
distinct substring of at most ``depth`` tokens, a node's *count* the number of windows that
pass through it, i.e. the substring's occurrences), it is path-compressed: a stored node is
a chain of trie nodes that each have one child and the same count, ending at a branch point,
at a node where some window ends (its count is larger than its child's), or at a leaf. A
node holds no tokens: it names one occurrence of its whole path (``tokens``, a sequence's
token list, and ``start``) and its bottom ``depth``, so its edge is ``tokens[start +
parent.depth : start + depth]``. Every window ends at a node's bottom.

Appending tokens to a sequence advances its windows one by one, each from where it ended to
its new length, a chain at a time (one slice comparison per chain). A window that reaches
text seen nowhere else gets a leaf of its own that stays *open*: its bottom is the window's
current end, ``min(depth, len(tokens) - start)``, so later tokens cost nothing for the
windows parked in their own leaves. Only the windows still inside shared text (none in
non-repeating text beyond the first token or two; up to ``depth - 1`` in text that repeats)
take steps: the boundary below their node moves down, a chain splits where they end or leave
it, or they leave into a new open leaf. Non-repeating text costs about 1.2 stored nodes per
token: about 250 bytes and 1.6-2 us per token at the drafter's depth of 25, against 6.8 KB
and 37-57 us for the plain trie this replaced, which had up to ``depth`` nodes per token
(``tools/suffix_cost.py``, CPython 3.11).

Counts are kept per stored node (uniform along its chain). The greedy continuation ranks a
node's children by count, then by recency: the tree's tick (one per appended token) when a
window last entered the child's first trie node. Only the first node of each chain keeps its
stamp. That is exact: a trie node that is a single child (the inside of a chain) is only
ever compared with siblings created after it, so any older stamp ranks it the same way.
Tokens appended in one call are stamped with their own ticks (one window at a time, oldest
first: at a given depth a later window enters later), so the stamps compare exactly as if
the tokens had been appended one at a time.

Removing a sequence walks its windows again, decrements the counts on their paths, deletes
the nodes left with no occurrence and merges a node back into its only child where no window
ends any more: a tree whose sequences are all removed has no node left. A node always names
the most recent occurrence that reached its bottom, so when sequences are added whole and
removed oldest first (the drafter's tenant trees) no node is left naming a removed sequence;
removing a newer one first may leave a leaf naming the removed token list, which then stays allocated while that
leaf exists (its tokens are still right). Recency stamps are not rolled back when a sequence
is removed, so after an eviction a tie may favour a child whose latest occurrence was the
evicted one.

A match is the longest suffix of a context (at most ``max_depth``, and at most ``depth - 1``
tokens) that occurs *followed by at least one token*: a suffix seen only at the very end of
an indexed sequence predicts nothing, and the request's own tree always holds the context
itself at its end. The continuation is greedy: from the matched trie node follow, step by
step, the child seen most often (ties: the one touched most recently); inside a chain that
is the chain's next token. When the walk reaches a node without children (the depth limit,
or the end of a sequence), it re-anchors on the longest matching suffix of context + tokens
proposed so far and goes on; it stops when no suffix matches.

:class:`SuffixDrafter` keeps one tree per live request (prompt + output so far) and one per
tenant (the outputs of its at most ``max_tenant_sequences`` most recently finished requests,
oldest evicted first). A proposal takes the longer of the two matches (a tie goes to the
request's own tree) and an adaptive length: none below ``min_match`` matched tokens, else
``min(max_tokens, ceil(length_factor * match_len))`` — a long match is strong evidence and
earns a long draft. Tenants never share a tree, so one tenant's text is never proposed to
another.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import operator
from collections.abc import Hashable, Iterable, Sequence

_OPEN = -1  # a node's depth while it is the open leaf of the window at its start


class _Tokens(list):
    """A sequence's tokens, with the windows of it still walking shared nodes."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        super().__init__()
        # start -> the node at whose bottom the window ends, for the windows shorter than
        # the depth that are not parked in an open leaf of their own (oldest start first)
        self.active: dict[int, _Node] | None = {}


class _Node:
    """A chain of trie nodes: ``tokens[start : start + depth]`` spells the path from the root
    to its bottom; the chain is the part below its parent's depth."""

    __slots__ = ("children", "count", "stamp", "depth", "tokens", "start")

    def __init__(self, count: int, stamp: int, depth: int, tokens: _Tokens, start: int,
                 children: dict[int, _Node] | None = None) -> None:
        self.children = children  # first token of the child's chain -> child; None: a leaf
        self.count = count  # windows (occurrences) passing through each trie node of the chain
        self.stamp = stamp  # the tree's tick when a window last entered the chain's first node
        self.depth = depth  # the bottom's depth (_OPEN: min(tree depth, len(tokens) - start))
        self.tokens = tokens
        self.start = start


_rank = operator.attrgetter("count", "stamp")  # how a child is preferred: most often, then latest


class SuffixTree:
    """Counted, path-compressed trie of all suffixes (truncated to ``depth`` tokens) of a set
    of sequences (see the module docstring)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._root = _Node(0, 0, 0, _Tokens(), 0, {})  # count 0: never merged, never moved
        self._sequences: dict[Hashable, _Tokens] = {}
        self._num_stored = 0
        self._tick = 0

    @property
    def num_nodes(self) -> int:
        """Nodes of the uncompressed trie, the root not counted (0 when it indexes nothing):
        the number of distinct substrings of at most ``depth`` tokens. O(stored nodes)."""
        total = 0
        stack = [(self._root, 0)]
        while stack:
            node, top = stack.pop()
            bottom = self._bottom(node)
            total += bottom - top
            if node.children:
                stack.extend((child, bottom) for child in node.children.values())
        return total

    @property
    def num_stored_nodes(self) -> int:
        """Nodes actually stored (chains), the root not counted: what the memory grows with."""
        return self._num_stored

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    def tokens(self, seq_id: Hashable) -> list[int]:
        """The indexed tokens of a sequence (the tree's own list: do not modify it)."""
        return self._get(seq_id)

    def add_sequence(self, seq_id: Hashable, tokens: Iterable[int] = ()) -> None:
        """Index a new sequence (it may be extended later)."""
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the tree")
        self._sequences[seq_id] = _Tokens()
        self.extend(seq_id, tokens)

    def extend(self, seq_id: Hashable, new_tokens: Iterable[int]) -> None:
        """Append tokens to an indexed sequence. Window by window: each window not parked in
        an open leaf walks from where it ended down to its new length, a chain at a time.
        O(1) per token for the windows that reach text seen nowhere else; up to one step per
        stored node on its path for a window inside shared text."""
        tokens = self._get(seq_id)
        new_tokens = [int(t) for t in new_tokens]  # all converted before any is indexed
        if not new_tokens:
            return
        old_len = len(tokens)
        tokens += new_tokens
        new_len = len(tokens)
        base = self._tick + 1 - old_len  # the tick of the token at position p is base + p
        self._tick += new_len - old_len
        active, depth, root = tokens.active, self.depth, self._root
        # oldest start first, so a trie node's stamp ends at its latest window's tick
        for start, node in list(active.items()):
            target = new_len - start if new_len - start < depth else depth
            node = self._advance(tokens, start, node, target, base)
            if node is None or target == depth:  # parked, or full
                del active[start]
            else:
                active[start] = node
        for start in range(old_len, new_len):
            target = new_len - start if new_len - start < depth else depth
            node = self._advance(tokens, start, root, target, base)
            if node is not None and target < depth:
                active[start] = node

    def _advance(self, tokens: _Tokens, start: int, node: _Node, target: int, base: int) -> _Node | None:
        """Walk the window at ``start``, which ends at ``node``'s bottom, down to ``target``
        tokens: the node at whose bottom it ends, or None once it is parked in an open leaf
        of its own. The trie nodes it enters are counted and their chains' first nodes
        stamped with the tick of the token that entered them (``base + position``)."""
        d = node.depth  # fixed: a window never ends inside an open leaf it does not own
        while d < target:
            token = tokens[start + d]
            children = node.children
            child = children.get(token) if children else None
            if child is None:  # the rest of the window is text seen nowhere else
                if not children and node.count == 1:
                    # the window alone reaches this leaf: the leaf becomes its open leaf
                    node.tokens, node.start, node.depth = tokens, start, _OPEN
                else:
                    leaf = _Node(1, base + start + d, _OPEN, tokens, start)
                    if children is None:
                        node.children = {token: leaf}
                    else:
                        children[token] = leaf
                    self._num_stored += 1
                return None
            ctokens, cstart = child.tokens, child.start
            bottom = child.depth
            if bottom < 0:
                bottom = min(self.depth, len(ctokens) - cstart)
            stop = bottom if bottom < target else target
            m = stop  # the depth down to which the window follows the child's chain
            if stop - d > 1 and ctokens[cstart + d + 1 : cstart + stop] != tokens[start + d + 1 : start + stop]:
                m = d + 1
                while ctokens[cstart + m] == tokens[start + m]:
                    m += 1
            if m == bottom:  # through the whole chain
                if child.depth < 0:
                    # another window's open leaf, as long as this one: that window ends here
                    # too now (only a full one can be of this sequence)
                    child.depth = bottom
                    if bottom < self.depth:
                        ctokens.active[cstart] = child
                child.count += 1
                child.stamp = base + start + d
                child.tokens, child.start = tokens, start  # the latest occurrence
                if node.count == child.count and len(children) == 1:
                    # the window was the last one ending at `node`: the child takes its place
                    # (only possible at the node the window ended at before this call)
                    self._merge_into_child(self._parent_of(node, tokens, start), node, child)
                node, d = child, m
            elif node.count == child.count + 1 and len(children) == 1:
                # the window was the only one ending at `node`: node's bottom moves down
                node.depth = m
                node.tokens, node.start = tokens, start
                del children[token]
                children[ctokens[cstart + m]] = child
                d = m
            else:  # the window ends or leaves the chain inside it: the chain splits there
                mid = _Node(child.count + 1, base + start + d, m, tokens, start, {ctokens[cstart + m]: child})
                children[token] = mid
                self._num_stored += 1
                node, d = mid, m
        return node

    def _parent_of(self, node: _Node, tokens: _Tokens, start: int) -> _Node:
        """The parent of ``node``, whose path ``tokens[start:]`` begins with."""
        parent = self._root
        while True:
            child = parent.children[tokens[start + parent.depth]]
            if child is node:
                return parent
            parent = child  # a node with children: its depth is fixed

    def _merge_into_child(self, parent: _Node, node: _Node, child: _Node) -> None:
        """``node`` (``parent``'s child) has the one child ``child`` with the same count: the
        child's chain grows up to take ``node``'s place."""
        parent.children[node.tokens[node.start + parent.depth]] = child
        child.stamp = node.stamp  # the merged chain's first trie node is node's
        node.children = None
        self._num_stored -= 1

    def clear(self) -> None:
        """Forget every sequence at once, without walking their windows."""
        for tokens in self._sequences.values():
            tokens.active = None  # no reference cycle (tokens -> node -> tokens) is left behind
        self._sequences.clear()
        self._root = _Node(0, 0, 0, _Tokens(), 0, {})
        self._num_stored = 0

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Forget a sequence: its windows' counts are taken back, nodes left with no
        occurrence are deleted and chains merged where no window ends any more. O(len *
        stored nodes on a window's path)."""
        tokens = self._get(seq_id)
        del self._sequences[seq_id]
        tokens.active = None
        size, depth, root = len(tokens), self.depth, self._root
        for start in range(size):
            length = min(depth, size - start)
            path = [root]
            node, bottom = root, 0
            while bottom < length:
                node = node.children[tokens[start + bottom]]
                node.count -= 1
                path.append(node)
                bottom = node.depth
                if bottom < 0:
                    bottom = min(depth, len(node.tokens) - node.start)
            alive = len(path)
            while alive > 1 and path[alive - 1].count == 0:
                alive -= 1
            if alive < len(path):  # the rest of the path has no occurrence left
                parent = path[alive - 1]
                del parent.children[tokens[start + parent.depth]]
                if not parent.children and parent is not root:
                    parent.children = None
                self._num_stored -= len(path) - alive
            # a node left naming this sequence names an occurrence below it instead
            for i in range(alive - 1, 0, -1):
                node = path[i]
                if node.tokens is tokens and node.children:
                    child = next(iter(node.children.values()))
                    node.tokens, node.start = child.tokens, child.start
            last = path[alive - 1]
            if last is not root and last.children and len(last.children) == 1:
                child = next(iter(last.children.values()))
                if child.count == last.count:
                    self._merge_into_child(path[alive - 2], last, child)

    def match(self, context: Sequence[int], max_depth: int, max_tokens: int) -> tuple[int, list[int]]:
        """``(match_len, continuation)``: the length of the longest suffix of ``context`` (at
        most ``max_depth``) that occurs followed by a token, and the greedy continuation of
        at most ``max_tokens`` tokens (``(0, [])`` without a match)."""
        if max_depth < 0 or max_tokens < 0:
            raise ValueError(f"max_depth and max_tokens must be >= 0, got {max_depth}, {max_tokens}")
        context = list(context[max(0, len(context) - self.depth) :])  # all that a match can use
        match_len, position = self._longest_match(context, max_depth)
        if match_len == 0:
            return 0, []
        return match_len, self._continuation(position, context, max_tokens)

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """Every trie node as ``path -> count`` (for inspection and tests: O(trie nodes *
        depth))."""
        out: dict[tuple[int, ...], int] = {}
        stack = [(self._root, 0)]
        while stack:
            node, top = stack.pop()
            bottom = self._bottom(node)
            for d in range(top + 1, bottom + 1):
                out[tuple(node.tokens[node.start : node.start + d])] = node.count
            if node.children:
                stack.extend((child, bottom) for child in node.children.values())
        return out

    def check_invariants(self) -> None:
        """Assert the structure against a recount from the sequences (for tests: O(total
        length * depth)): counts, minimal chains, labels, the windows' places, the node count."""
        depth = self.depth
        live = {id(t) for t in self._sequences.values()}
        expected: dict[tuple[int, ...], int] = {}
        ends: dict[tuple[int, ...], int] = {}
        for tokens in self._sequences.values():
            for start in range(len(tokens)):
                window = tuple(tokens[start : start + depth])
                ends[window] = ends.get(window, 0) + 1
                for d in range(1, len(window) + 1):
                    expected[window[:d]] = expected.get(window[:d], 0) + 1
        assert self.path_counts() == expected
        stored, parked = 0, set()
        stack = [(self._root, 0)]
        while stack:
            node, top = stack.pop()
            bottom = self._bottom(node)
            if node is not self._root:
                stored += 1
                assert bottom > top and node.count > 0
                path = tuple(node.tokens[node.start : node.start + bottom])
                assert len(path) == bottom
                if node.depth == _OPEN:
                    assert id(node.tokens) in live and node.count == 1 and not node.children
                    parked.add((id(node.tokens), node.start))
                if node.children is not None:
                    assert node.children and node.depth != _OPEN
                # a boundary only where the trie branches, a window ends, or at a leaf
                assert (not node.children or len(node.children) > 1 or ends.get(path, 0) > 0)
            for key, child in (node.children or {}).items():
                assert child.tokens[child.start + bottom] == key
                stack.append((child, bottom))
        assert stored == self._num_stored
        for tokens in self._sequences.values():
            for start in range(max(0, len(tokens) - depth + 1), len(tokens)):  # windows not full
                assert (start in tokens.active) != ((id(tokens), start) in parked), start
            for start, node in tokens.active.items():
                assert len(tokens) - start < depth and node.depth >= 0
                length = len(tokens) - start
                assert node.depth == length
                assert tuple(node.tokens[node.start : node.start + length]) == tuple(tokens[start:])

    def _get(self, seq_id: Hashable) -> _Tokens:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not in the tree") from None

    def _bottom(self, node: _Node) -> int:
        return node.depth if node.depth >= 0 else min(self.depth, len(node.tokens) - node.start)

    def _position_with_next(self, context: list[int], length: int) -> tuple[_Node, int] | None:
        """``(node, depth)`` of the trie node spelling the last ``length`` tokens of
        ``context`` if it exists and has a child, else None."""
        node, d = self._root, 0
        base = len(context) - length
        while d < length:
            children = node.children
            if not children:
                return None
            child = children.get(context[base + d])
            if child is None:
                return None
            bottom = child.depth
            if bottom < 0:
                bottom = min(self.depth, len(child.tokens) - child.start)
            stop = bottom if bottom < length else length
            if stop - d > 1:
                s = child.start
                if child.tokens[s + d + 1 : s + stop] != context[base + d + 1 : base + stop]:
                    return None
            node, d = child, stop
        if d == bottom and not node.children:
            return None
        return node, d

    def _longest_match(self, context: list[int], max_depth: int, floor: int = 1) -> tuple[int, tuple[_Node, int]]:
        """``(match_len, (node, depth))`` of the longest suffix of ``context`` with a
        continuation, ``(0, (root, 0))`` if it is shorter than ``floor``.

        If a suffix occurs followed by a token, so does each of its own suffixes, so the
        lengths that match are exactly ``0..match_len``: the longest allowed length is tried
        first (a repeat usually matches in full), then ``floor``, then a binary search
        between. O(log(depth)) walks from the root, one dictionary lookup per stored node."""
        none = 0, (self._root, 0)
        low = max(floor, 1)
        high = min(max_depth, self.depth - 1, len(context))
        if high < low:
            return none
        position = self._position_with_next(context, high)
        if position is not None:
            return high, position
        found = self._position_with_next(context, low) if low < high else None
        if found is None:
            return none
        found_len = low
        low, high = low + 1, high - 1
        while low <= high:
            mid = (low + high) // 2
            position = self._position_with_next(context, mid)
            if position is not None:
                found_len, found, low = mid, position, mid + 1
            else:
                high = mid - 1
        return found_len, found

    def _continuation(self, position: tuple[_Node, int], context: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens greedily from ``position`` (which matched
        ``context``'s tail), re-anchoring on the longest matching suffix where the trie runs
        out."""
        out: list[int] = []
        tail = list(context[max(0, len(context) - self.depth) :])
        node, d = position
        while len(out) < max_tokens:
            bottom = self._bottom(node)
            if d < bottom:  # inside a chain: its next tokens
                s = node.start + d
                chunk = node.tokens[s : s + min(bottom - d, max_tokens - len(out))]
                out += chunk
                tail += chunk
                d += len(chunk)
            elif node.children:
                child = max(node.children.values(), key=_rank)
                token = child.tokens[child.start + d]
                out.append(token)
                tail.append(token)
                node, d = child, d + 1
            else:
                match_len, anchor = self._longest_match(tail, self.depth - 1)
                if match_len == 0:
                    break
                node, d = anchor
            if len(tail) > 2 * self.depth:
                del tail[: -self.depth]
        return out


@dataclasses.dataclass
class _Request:
    tenant: str
    prompt_len: int
    tokens: list[int]  # prompt + output so far: the tree's own list
    tree: SuffixTree  # over prompt + output so far


@dataclasses.dataclass
class _TenantHistory:
    tree: SuffixTree  # over the outputs in `finished`
    finished: collections.deque[int]  # tree sequence ids, oldest first


class SuffixDrafter:
    """Suffix-decoding drafts for many requests of many tenants (see the module docstring)."""

    def __init__(self, max_depth: int = 24, max_tokens: int = 16, max_tenant_sequences: int = 256,
                 min_match: int = 2, length_factor: float = 1.0) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if max_tenant_sequences < 0:
            raise ValueError(f"max_tenant_sequences must be >= 0, got {max_tenant_sequences}")
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        if not length_factor > 0:
            raise ValueError(f"length_factor must be > 0, got {length_factor}")
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        self.max_tenant_sequences = max_tenant_sequences
        self.min_match = min_match
        self.length_factor = length_factor
        self._requests: dict[Hashable, _Request] = {}
        self._tenants: dict[str, _TenantHistory] = {}
        self._sequence_ids = itertools.count()  # tenant-tree ids: request ids may be reused

    def _new_tree(self) -> SuffixTree:
        # one more level than the longest match, so that a full-length match still has a child
        return SuffixTree(self.max_depth + 1)

    def start(self, request_id: Hashable, tenant: str, prompt: Sequence[int]) -> None:
        """Begin tracking a request with its prompt."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already started")
        tree = self._new_tree()
        tree.add_sequence(request_id, prompt)
        tokens = tree.tokens(request_id)  # shared with the tree: extended through it
        self._requests[request_id] = _Request(tenant, len(tokens), tokens, tree)

    def extend(self, request_id: Hashable, new_tokens: Iterable[int], prompt: bool = False) -> None:
        """Append a request's newly accepted output tokens; ``prompt``: more of its prompt
        (indexed in pieces: only before any output)."""
        request = self._get(request_id)
        if prompt and request.prompt_len != len(request.tokens):
            raise ValueError(f"request {request_id!r} already has output: its prompt cannot grow")
        before = len(request.tokens)
        request.tree.extend(request_id, new_tokens)  # request.tokens is the tree's list
        if prompt:
            request.prompt_len += len(request.tokens) - before

    def finish(self, request_id: Hashable) -> None:
        """End a request: its output joins its tenant's tree (the oldest output there is
        evicted beyond ``max_tenant_sequences``). An empty output is not kept."""
        request = self._get(request_id)
        del self._requests[request_id]
        output = request.tokens[request.prompt_len :]
        request.tree.clear()
        if self.max_tenant_sequences == 0 or not output:
            return
        history = self._tenants.get(request.tenant)
        if history is None:
            history = _TenantHistory(self._new_tree(), collections.deque())
            self._tenants[request.tenant] = history
        sequence_id = next(self._sequence_ids)
        history.tree.add_sequence(sequence_id, output)
        history.finished.append(sequence_id)
        while len(history.finished) > self.max_tenant_sequences:
            history.tree.remove_sequence(history.finished.popleft())

    def abort(self, request_id: Hashable) -> None:
        """End a request without keeping its output."""
        self._get(request_id).tree.clear()
        del self._requests[request_id]

    def propose(self, request_id: Hashable, max_tokens: int | None = None, after: Sequence[int] = ()) -> list[int]:
        """The draft for a request's next tokens (``[]`` when no match is long enough).
        ``after``: tokens not appended yet (an in-flight step's drafts): the draft after the
        request's tokens followed by them (matched as context; the trees do not hold them)."""
        request = self._get(request_id)
        limit = self.max_tokens if max_tokens is None else max_tokens
        if limit < 0:
            raise ValueError(f"max_tokens must be >= 0, got {limit}")
        context = request.tokens[-self.max_depth :]
        if after:
            context = (context + [int(t) for t in after])[-self.max_depth :]
        # a match shorter than min_match proposes nothing, and the tenant's tree wins only
        # with a longer match: neither search needs to look below that
        best_len, best_position = request.tree._longest_match(context, self.max_depth, self.min_match)
        best_tree = request.tree
        history = self._tenants.get(request.tenant)
        if history is not None:
            tenant_len, tenant_position = history.tree._longest_match(
                context, self.max_depth, max(self.min_match, best_len + 1))
            if tenant_len > best_len:
                best_len, best_position, best_tree = tenant_len, tenant_position, history.tree
        if best_len < self.min_match:
            return []
        length = min(limit, math.ceil(self.length_factor * best_len))
        return best_tree._continuation(best_position, context, length)

    def num_tenant_sequences(self, tenant: str) -> int:
        """Finished outputs kept for ``tenant``."""
        history = self._tenants.get(tenant)
        return 0 if history is None else history.tree.num_sequences

    def num_tenant_nodes(self, tenant: str) -> int:
        """Nodes of ``tenant``'s tree as an uncompressed trie (distinct substrings of at most
        ``max_depth + 1`` tokens); :meth:`SuffixTree.num_stored_nodes` is what it stores."""
        history = self._tenants.get(tenant)
        return 0 if history is None else history.tree.num_nodes

    def _get(self, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: not started, or already finished "
                           "or aborted") from None
