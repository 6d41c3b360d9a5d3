"""Suffix decoding (method "suffix"): drafts from suffix trees over the request's own tokens and
over the outputs of recent requests, as vLLM's SuffixDecodingProposer (Arctic Inference) does.

Two kinds of tree, both engine/spec_decode/suffix_tree.py:
- one *local* tree per running stream over its prompt and output (dropped on `release`);
- one *global* tree over the outputs of the last `suffix_decoding_max_cached_requests` streams
  (FIFO eviction; 0 turns it off). Each cached output is stored after the last
  `suffix_decoding_max_tree_depth` tokens of its prompt, its *key*: a request that repeats an
  earlier one (agentic loops, retries, the same tool call) then matches the earlier output from
  its very first decode step, not only once a few of its own output tokens exist.

Each step drafts from whichever tree scores higher (sum of the draft tokens' estimated
probabilities); a draft is at most `num_tokens` and at most `max_spec_factor` times the matched
length long, and stops where the estimated probability falls under `min_token_prob`. The cost per
step is O(depth * log depth) per stream plus O(depth) per new token, whatever the lengths.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.spec_decode.proposer import Proposer, ProposerContext, SpecRequestView
from kvserve.engine.spec_decode.registry import register_proposer
from kvserve.engine.spec_decode.suffix_tree import SuffixDraft, SuffixTree

_LOCAL_SEQ = 0  # a local tree holds one sequence


@dataclass
class _Stream:
    local: SuffixTree
    num_seen: int  # tokens of the stream already in its trees
    prompt_len: int


class SuffixCache:
    """Local trees of live streams plus the global tree of recent outputs, by stream id."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._global = SuffixTree(max_tree_depth)
        self._streams: dict[str, _Stream] = {}
        self._cached: OrderedDict[str, int] = OrderedDict()  # stream id -> global seq id (FIFO)
        self._next_seq = 0

    @property
    def active_streams(self) -> list[str]:
        return list(self._streams)

    @property
    def cached_streams(self) -> list[str]:
        return list(self._cached)

    def start(self, stream_id: str, token_ids: Sequence[int], prompt_len: int) -> None:
        """Begin (or restart) a stream whose prompt and output so far are ``token_ids``."""
        self.stop(stream_id)
        local = SuffixTree(self.max_tree_depth)
        local.extend(_LOCAL_SEQ, token_ids)
        self._streams[stream_id] = _Stream(local, len(token_ids), prompt_len)
        if self.max_cached_requests == 0:
            return
        if stream_id in self._cached:  # the same id again: its old output goes
            self._global.remove(self._cached.pop(stream_id))
        seq_id = self._next_seq
        self._next_seq += 1
        self._cached[stream_id] = seq_id
        key_start = max(0, prompt_len - self.max_tree_depth)
        self._global.extend(seq_id, token_ids[key_start:])
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self._global.remove(old)

    def add(self, stream_id: str, token_ids: Sequence[int]) -> None:
        """Append new tokens of a live stream to its local tree and its cached output."""
        stream = self._streams[stream_id]
        stream.local.extend(_LOCAL_SEQ, token_ids)
        stream.num_seen += len(token_ids)
        seq_id = self._cached.get(stream_id)
        if seq_id is not None:
            self._global.extend(seq_id, token_ids)

    def stop(self, stream_id: str) -> None:
        """Drop a stream's local tree; its output stays in the global tree until evicted."""
        self._streams.pop(stream_id, None)

    def num_seen(self, stream_id: str) -> int | None:
        stream = self._streams.get(stream_id)
        return None if stream is None else stream.num_seen

    def speculate(self, stream_id: str, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
        """The better of the local and the global tree's drafts (the local one on a tie)."""
        args = (context, max_spec_tokens, max_spec_factor, min_token_prob)
        best = self._streams[stream_id].local.speculate(*args)
        if self._cached:
            other = self._global.speculate(*args)
            if other.score > best.score:
                best = other
        return best


@register_proposer
class SuffixProposer(Proposer):
    """Suffix decoding over each stream's tokens and recent outputs (a CPU-only proposer)."""

    method = "suffix"

    def __init__(self, config, context: ProposerContext) -> None:
        super().__init__(config, context)
        self.cache = SuffixCache(config.suffix_decoding_max_tree_depth,
                                 config.suffix_decoding_max_cached_requests)
        self.max_spec_factor = float(config.suffix_decoding_max_spec_factor)
        self.min_token_prob = float(config.suffix_decoding_min_token_prob)

    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        drafts: list[list[int]] = []
        depth = self.cache.max_tree_depth
        for view in requests:
            n = len(view.token_ids)
            limit = min(num_tokens, self.context.max_model_len - n - 1)
            self._sync(view)
            if limit <= 0:
                drafts.append([])
                continue
            context = view.token_ids[max(0, n - depth):].tolist()
            draft = self.cache.speculate(view.request_id, context, limit, self.max_spec_factor,
                                         self.min_token_prob)
            drafts.append(draft.token_ids)
        return drafts

    def _sync(self, view: SpecRequestView) -> None:
        """Bring the stream's trees up to its current tokens (new stream: build them)."""
        seen = self.cache.num_seen(view.request_id)
        n = len(view.token_ids)
        if seen is None or seen > n:
            self.cache.start(view.request_id, view.token_ids.tolist(), view.num_prompt_tokens)
        elif seen < n:
            self.cache.add(view.request_id, view.token_ids[seen:].tolist())

    def release(self, request_id: str) -> None:
        self.cache.stop(request_id)
