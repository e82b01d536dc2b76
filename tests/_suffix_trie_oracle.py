"""The suffix drafter as it was before the path-compressed tree (``server/spec/suffix.py``):
a plain trie with one node per token of every suffix, truncated to ``depth`` tokens. Kept only
as the oracle of ``tests/test_suffix_equivalence.py`` (and ``tools/suffix_cost.py --oracle``):
the product code proposes exactly what this does, for every call sequence.

Its original description follows.

Suffix decoding (the idea of arXiv 2411.04975, "SuffixDecoding"): drafts from suffix trees
over the request's own tokens and over the outputs of its tenant's recent finished requests.

:class:`SuffixTree` is a trie of every suffix of its sequences, truncated to ``depth`` tokens:
the window ``tokens[p : p + depth]`` of each position ``p`` is a path from the root, and a
node's ``count`` is how many windows pass through it — the number of occurrences of the
substring it spells. That is the simplest structure that is plainly correct and
incremental: appending a token extends the at most ``depth - 1`` windows still shorter than
``depth`` and starts a new one, O(depth) per token (a sequence keeps those windows' nodes).
Memory is bounded by the depth, not by repetition: at most ``depth`` nodes per indexed token
(about that many when the text never repeats; far fewer when it does), each node a slotted
object (count, recency stamp, a dict of children: about 270 bytes on CPython 3.11, so about
7 KB per token of non-repeating text at the drafter's default depth of 25), plus the tokens
themselves; inserting costs about 75 us per token there. Removing a sequence walks its
windows again and decrements, deleting nodes whose count reaches zero, so a tree whose
sequences are all removed has no node left. A real suffix tree would take at most two nodes
per token; the truncated trie is kept for its simplicity.

A match is the longest suffix of a context (at most ``max_depth``, and at most ``depth - 1``
tokens) that occurs *followed by at least one token*: a suffix seen only at the very end of
an indexed sequence predicts nothing, and the request's own tree always holds the context
itself at its end. The continuation is greedy: from the matched node follow, step by step,
the child seen most often (ties: the one touched most recently). When the walk reaches a
node without children (the depth limit, or the end of a sequence), it re-anchors on the
longest matching suffix of context + tokens proposed so far and goes on; it stops when no
suffix matches. Recency stamps are not rolled back when a sequence is removed, so after an
eviction a tie may favour a child whose latest occurrence was the evicted one.

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
from collections.abc import Hashable, Iterable, Sequence


class _Node:
    __slots__ = ("children", "count", "stamp")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # windows (occurrences) passing through this node
        self.stamp = 0  # the tree's tick when a window last passed through it


def _rank(item: tuple[int, _Node]) -> tuple[int, int]:
    """How a child is preferred: seen most often, then touched most recently."""
    return item[1].count, item[1].stamp


@dataclasses.dataclass
class _Sequence:
    tokens: list[int]
    open_windows: list[_Node]  # the last nodes of the windows shorter than depth, oldest start first


class SuffixTree:
    """Counted trie of all suffixes (truncated to ``depth`` tokens) of a set of sequences."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._root = _Node()
        self._sequences: dict[Hashable, _Sequence] = {}
        self._num_nodes = 0
        self._tick = 0

    @property
    def num_nodes(self) -> int:
        """Nodes in the trie, the root not counted (0 when it indexes nothing)."""
        return self._num_nodes

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    def add_sequence(self, seq_id: Hashable, tokens: Iterable[int] = ()) -> None:
        """Index a new sequence (it may be extended later)."""
        if seq_id in self._sequences:
            raise ValueError(f"sequence {seq_id!r} is already in the tree")
        self._sequences[seq_id] = _Sequence([], [])
        self.extend(seq_id, tokens)

    def extend(self, seq_id: Hashable, new_tokens: Iterable[int]) -> None:
        """Append tokens to an indexed sequence: O(depth) per token."""
        seq = self._get(seq_id)
        root, depth = self._root, self.depth
        for token in new_tokens:
            token = int(token)
            self._tick += 1
            extended = []
            for node in (*seq.open_windows, root):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self._num_nodes += 1
                child.count += 1
                child.stamp = self._tick
                extended.append(child)
            if len(extended) > depth - 1:  # the oldest window has reached the depth
                del extended[0]
            seq.open_windows = extended
            seq.tokens.append(token)

    def remove_sequence(self, seq_id: Hashable) -> None:
        """Forget a sequence: its windows' counts are taken back and nodes left with no
        occurrence are deleted. O(len * depth)."""
        tokens = self._get(seq_id).tokens
        del self._sequences[seq_id]
        size = len(tokens)
        for start in range(size):
            node, end = self._root, min(size, start + self.depth)
            for pos in range(start, end):
                child = node.children[tokens[pos]]
                child.count -= 1
                if child.count == 0:
                    # only this window passed through it: the rest of the window is a chain
                    # of end - pos nodes below `node`, all gone with it
                    del node.children[tokens[pos]]
                    self._num_nodes -= end - pos
                    break
                node = child

    def match(self, context: Sequence[int], max_depth: int, max_tokens: int) -> tuple[int, list[int]]:
        """``(match_len, continuation)``: the length of the longest suffix of ``context`` (at
        most ``max_depth``) that occurs followed by a token, and the greedy continuation of
        at most ``max_tokens`` tokens (``(0, [])`` without a match)."""
        if max_depth < 0 or max_tokens < 0:
            raise ValueError(f"max_depth and max_tokens must be >= 0, got {max_depth}, {max_tokens}")
        match_len, node = self._longest_match(context, max_depth)
        if match_len == 0:
            return 0, []
        return match_len, self._continuation(node, context, max_tokens)

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """Every node as ``path -> count`` (for inspection and tests: O(nodes * depth))."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self._root)]
        while stack:
            path, node = stack.pop()
            for token, child in node.children.items():
                out[path + (token,)] = child.count
                stack.append((path + (token,), child))
        return out

    def _get(self, seq_id: Hashable) -> _Sequence:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not in the tree") from None

    def _node_of(self, context: Sequence[int], length: int) -> _Node | None:
        """The node spelling the last ``length`` tokens of ``context``, if any."""
        node: _Node | None = self._root
        for i in range(len(context) - length, len(context)):
            node = node.children.get(context[i])
            if node is None:
                return None
        return node

    def _longest_match(self, context: Sequence[int], max_depth: int) -> tuple[int, _Node]:
        """``(match_len, node)`` of the longest suffix of ``context`` with a continuation.

        Binary search on the length: if a suffix occurs followed by a token, so does each of
        its own suffixes, so the lengths that match are exactly ``0..match_len``.
        O(depth * log(depth)) dict lookups."""
        found, found_node = 0, self._root
        low, high = 1, min(max_depth, self.depth - 1, len(context))
        while low <= high:
            mid = (low + high) // 2
            node = self._node_of(context, mid)
            if node is not None and node.children:
                found, found_node, low = mid, node, mid + 1
            else:
                high = mid - 1
        return found, found_node

    def _continuation(self, node: _Node, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens greedily from ``node`` (which matched ``context``'s
        tail), re-anchoring on the longest matching suffix where the trie runs out."""
        out: list[int] = []
        tail = list(context[max(0, len(context) - self.depth) :])
        while len(out) < max_tokens:
            if not node.children:
                match_len, node = self._longest_match(tail, self.depth - 1)
                if match_len == 0:
                    break
            token, node = max(node.children.items(), key=_rank)
            out.append(token)
            tail.append(token)
            if len(tail) > 2 * self.depth:
                del tail[: -self.depth]
        return out


@dataclasses.dataclass
class _Request:
    tenant: str
    prompt_len: int
    tokens: list[int]
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
        self._requests[request_id] = _Request(tenant, len(prompt), [int(t) for t in prompt], tree)

    def extend(self, request_id: Hashable, new_tokens: Iterable[int]) -> None:
        """Append a request's newly accepted output tokens."""
        request = self._get(request_id)
        new_tokens = [int(t) for t in new_tokens]
        request.tree.extend(request_id, new_tokens)
        request.tokens.extend(new_tokens)

    def finish(self, request_id: Hashable) -> None:
        """End a request: its output joins its tenant's tree (the oldest output there is
        evicted beyond ``max_tenant_sequences``). An empty output is not kept."""
        request = self._get(request_id)
        del self._requests[request_id]
        output = request.tokens[request.prompt_len :]
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
        self._get(request_id)
        del self._requests[request_id]

    def propose(self, request_id: Hashable, max_tokens: int | None = None) -> list[int]:
        """The draft for a request's next tokens (``[]`` when no match is long enough)."""
        request = self._get(request_id)
        limit = self.max_tokens if max_tokens is None else max_tokens
        if limit < 0:
            raise ValueError(f"max_tokens must be >= 0, got {limit}")
        context = request.tokens[-self.max_depth :]
        best_len, best_node = request.tree._longest_match(context, self.max_depth)
        best_tree = request.tree
        history = self._tenants.get(request.tenant)
        if history is not None:
            tenant_len, tenant_node = history.tree._longest_match(context, self.max_depth)
            if tenant_len > best_len:
                best_len, best_node, best_tree = tenant_len, tenant_node, history.tree
        if best_len < self.min_match:
            return []
        length = min(limit, math.ceil(self.length_factor * best_len))
        return best_tree._continuation(best_node, context, length)

    def num_tenant_sequences(self, tenant: str) -> int:
        """Finished outputs kept for ``tenant``."""
        history = self._tenants.get(tenant)
        return 0 if history is None else history.tree.num_sequences

    def num_tenant_nodes(self, tenant: str) -> int:
        """Nodes in ``tenant``'s tree (its memory, in units of trie nodes)."""
        history = self._tenants.get(tenant)
        return 0 if history is None else history.tree.num_nodes

    def _get(self, request_id: Hashable) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}: not started, or already finished "
                           "or aborted") from None
