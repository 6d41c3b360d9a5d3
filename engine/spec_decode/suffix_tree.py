"""A depth-bounded, frequency-counting suffix tree over many token sequences.

Every suffix of every sequence, cut at ``max_depth`` tokens, is a path from the root; a node's
``count`` is how many such suffixes pass through or end at it, i.e. how often the string it spells
occurs. Edges are compressed (a node holds a run of tokens by reference into one of the sequences),
so the tree has O(total tokens) nodes. Appending a token touches at most ``max_depth`` "active"
nodes (the ends of the sequence's last ``max_depth`` suffixes), and removing a sequence walks its
suffixes once, so both cost O(max_depth) per token whatever the sequence length. Speculation
matches the context's suffixes (binary search on the match length: a suffix of a present string is
present) and walks the most frequent child while the estimated probability stays above a floor.

The semantics follow Arctic Inference's suffix decoding (arXiv 2411.04975) as vLLM uses it; the
code is our own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


class _Node:
    """One edge-compressed node; its incoming edge's tokens are seqs[ref_seq][ref_idx:+length]."""

    __slots__ = ("children", "count", "endpoints", "length", "parent", "ref_idx", "ref_seq",
                 "token")

    def __init__(self, token: int = -1, parent: _Node | None = None, count: int = 0,
                 length: int = 0, ref_seq: int = -1, ref_idx: int = -1) -> None:
        self.token = token
        self.parent = parent
        self.count = count
        self.length = length
        self.ref_seq = ref_seq
        self.ref_idx = ref_idx
        self.children: dict[int, _Node] = {}
        # seq_id -> end index (exclusive) of that sequence's suffix that ends at this node.
        self.endpoints: dict[int, int] = {}


@dataclass
class SuffixDraft:
    """The best continuation found: tokens, their estimated probabilities and the sum of them."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Suffix tree over sequences identified by int ids, with incremental append and removal."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"suffix tree max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node()
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[_Node]] = {}

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(seq_id, int(token))

    def append(self, seq_id: int, token: int) -> None:
        """Append one token to a (new or existing) sequence, updating every active suffix."""
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        root = self._root
        active.append(root)
        root.endpoints[seq_id] = len(seq)
        root.count += 1
        if len(active) > self.max_depth:
            active.popleft()
        seq.append(token)
        end = len(seq)
        for i, node in enumerate(active):
            child = node.children.get(token)
            if child is None:
                active[i] = self._grow(node, seq_id, token, end)
            elif node.count == child.count + 1 and node is not root:
                active[i] = self._slide_into(node, child, seq_id, token, end)
            else:
                active[i] = self._descend(node, child, seq_id, token, end)

    def _grow(self, node: _Node, seq_id: int, token: int, end: int) -> _Node:
        """No child for ``token``: lengthen a leaf only we end at, else branch a new leaf."""
        if node.count == 1 and node is not self._root:
            node.length += 1
            node.endpoints[seq_id] += 1
            return node
        leaf = _Node(token, node, 1, 1, seq_id, end - 1)
        leaf.endpoints[seq_id] = end
        node.children[token] = leaf
        del node.endpoints[seq_id]
        return leaf

    def _slide_into(self, node: _Node, child: _Node, seq_id: int, token: int, end: int) -> _Node:
        """Only our suffix ends at ``node`` and all others continue into ``child``: move the
        boundary between them one token down (or fuse them when ``child`` is one token long)."""
        if child.length == 1:
            parent = node.parent
            assert parent is not None
            child.token = node.token
            child.count += 1
            child.length = node.length + 1
            child.endpoints[seq_id] = end
            child.ref_seq, child.ref_idx = seq_id, end - child.length
            child.parent = parent
            parent.children[child.token] = child
            return child
        node.length += 1
        node.endpoints[seq_id] += 1
        node.ref_seq, node.ref_idx = seq_id, end - node.length
        child.length -= 1
        child.ref_idx += 1
        child.token = self._seqs[child.ref_seq][child.ref_idx]
        if child.token != token:
            del node.children[token]
            node.children[child.token] = child
        return node

    def _descend(self, node: _Node, child: _Node, seq_id: int, token: int, end: int) -> _Node:
        """A child starts with ``token``: step into it, splitting its edge after one token."""
        del node.endpoints[seq_id]
        if child.length == 1:
            child.count += 1
            child.endpoints[seq_id] = end
            child.ref_seq, child.ref_idx = seq_id, end - 1
            return child
        mid = _Node(token, node, child.count + 1, 1, seq_id, end - 1)
        mid.endpoints[seq_id] = end
        child.ref_idx += 1
        child.length -= 1
        child.token = self._seqs[child.ref_seq][child.ref_idx]
        child.parent = mid
        mid.children[child.token] = child
        node.children[token] = mid
        return mid

    def remove(self, seq_id: int) -> None:
        """Remove a sequence and every suffix of it from the tree."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not in the suffix tree")
        for start in range(len(seq)):
            self._remove_suffix(seq_id, seq, start)
        del self._seqs[seq_id]
        del self._active[seq_id]

    def _remove_suffix(self, seq_id: int, seq: list[int], start: int) -> None:
        node = self._root
        node.count -= 1
        node.endpoints.pop(seq_id, None)
        idx = start
        path: list[_Node] = []
        while idx < len(seq):
            child = node.children.get(seq[idx])
            if child is None:
                break
            child.count -= 1
            if child.count == 0:
                del node.children[seq[idx]]
                break
            child.endpoints.pop(seq_id, None)
            idx += child.length
            node = child
            path.append(node)
        if node is not self._root and len(node.children) == 1:
            only = next(iter(node.children.values()))
            if only.count == node.count:  # nothing ends at node any more: fuse it into its child
                only.token = node.token
                only.length += node.length
                only.ref_idx -= node.length
                only.parent = node.parent
                assert node.parent is not None
                node.parent.children[only.token] = only
                path[-1] = node = only
        self._rebase_refs(seq_id, node, path)

    def _rebase_refs(self, seq_id: int, node: _Node, path: list[_Node]) -> None:
        """Point the path's nodes that referenced the removed sequence at another sequence."""
        leaf, distance = node, 0
        while leaf.children:
            leaf = next(iter(leaf.children.values()))
            distance += leaf.length
        if not leaf.endpoints or seq_id in leaf.endpoints:
            return  # this leaf is visited again by a later suffix of the same sequence
        ref_seq, ref_end = next(iter(leaf.endpoints.items()))
        ref_idx = ref_end - distance
        for n in reversed(path):
            ref_idx -= n.length
            if n.ref_seq == seq_id:
                n.ref_seq, n.ref_idx = ref_seq, ref_idx

    def count(self, pattern: Sequence[int]) -> int:
        """How many times ``pattern`` (at most max_depth tokens) occurs over all sequences."""
        if not pattern:
            return self._root.count
        found = self._match(pattern)
        return 0 if found is None else found[0].count

    def _match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """The node and offset inside its edge where ``pattern`` ends, or None if absent."""
        node, idx = self._root, 0
        seqs = self._seqs
        for tok in pattern:
            if idx >= node.length:
                nxt = node.children.get(tok)
                if nxt is None:
                    return None
                node, idx = nxt, 1  # the child's first token is its key
                continue
            if seqs[node.ref_seq][node.ref_idx + idx] != tok:
                return None
            idx += 1
        return node, idx

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1) -> SuffixDraft:
        """Best-scoring greedy continuation over the matches of the context's suffixes.

        A match of length m may propose at most ``min(max_spec_tokens, m * max_spec_factor)``
        tokens; a draft's score is the sum of its tokens' estimated probabilities; ties go to
        the longer match. Matches are tried longest first and stop once no shorter one can win.
        """
        context = list(context[-self.max_depth:])
        longest = self._longest_match(context)
        best = SuffixDraft()
        for match_len in range(longest, 0, -1):
            limit = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6))
            if limit <= best.score:
                break
            found = self._match(context[len(context) - match_len:])
            assert found is not None
            draft = self._walk(found[0], found[1], limit, min_token_prob)
            if draft.score > best.score:
                draft.match_len = match_len
                best = draft
        return best

    def _longest_match(self, context: list[int]) -> int:
        """Length of the longest suffix of ``context`` present in the tree (binary search)."""
        lo, hi = 0, len(context)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._match(context[len(context) - mid:]) is not None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _walk(self, node: _Node, idx: int, limit: int, min_token_prob: float) -> SuffixDraft:
        draft = SuffixDraft()
        prob = 1.0
        seqs = self._seqs
        while len(draft.token_ids) < limit:
            if idx < node.length:
                draft.token_ids.append(seqs[node.ref_seq][node.ref_idx + idx])
                draft.probs.append(prob)
                draft.score += prob
                idx += 1
                continue
            if not node.children:
                break
            child = max(node.children.values(), key=_child_rank)
            prob *= child.count / node.count
            if prob < min_token_prob:
                break
            node, idx = child, 0
        return draft

    def check_integrity(self) -> None:
        """Raise AssertionError if a node's counts, refs or links are inconsistent (for tests)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            assert node.count >= sum(c.count for c in node.children.values()), "count"
            for tok, child in node.children.items():
                assert child.parent is node, "parent link"
                assert child.token == tok, "child key"
                assert child.length > 0 and child.count > 0, "empty node"
                assert child.ref_seq in self._seqs, "reference to a removed sequence"
                ref = self._seqs[child.ref_seq]
                assert ref[child.ref_idx] == tok, "edge reference"
                assert child.ref_idx + child.length <= len(ref), "edge range"
                stack.append(child)


def _child_rank(node: _Node) -> tuple[int, int]:
    # Most frequent child first; among equals the smallest token id, so results are reproducible.
    return node.count, -node.token
