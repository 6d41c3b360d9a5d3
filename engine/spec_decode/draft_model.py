"""Draft-model speculation (method "draft_model"): a smaller model with the target's tokenizer
drafts `k` tokens greedily, one batched forward per drafted token.

The draft is loaded by the engine's own loader (engine/worker/model_loader.py, any family the
engine runs) and keeps its KV in a paged cache of its own (engine/spec_decode/draft_kv.py: its
own block pool and block tables, beside the target's). Each stream's cache is reused across
steps: positions holding tokens the target accepted stay, the first rejected draft and what
follows are overwritten, so a step feeds the draft only the tokens it has not seen (the bonus
token, or the whole prompt for a new stream) and then one token per draft.

Greedy drafts are deterministic (q is one-hot), which is what the verification assumes; with the
target itself as the draft every greedy draft is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvserve.engine.errors import ConfigError
from kvserve.engine.spec_decode.draft_kv import DraftKV
from kvserve.engine.spec_decode.proposer import Proposer, ProposerContext, SpecRequestView
from kvserve.engine.spec_decode.registry import register_proposer


@dataclass
class _Stream:
    real_len: int = 0  # positions [0, real_len) of the draft's cache hold the stream's tokens
    drafted: list[int] = field(default_factory=list)  # drafts written at real_len, real_len+1...


@dataclass
class _Plan:
    """One stream's part of a step: where its new tokens go and how many drafts it wants."""

    index: int  # position in the propose() batch
    stream_id: str
    start: int
    feed: list[int]
    limit: int


@register_proposer
class DraftModelProposer(Proposer):
    """Greedy drafts from a small model with its own paged KV cache."""

    method = "draft_model"

    def __init__(self, config, context: ProposerContext) -> None:
        super().__init__(config, context)
        from kvserve.engine.worker.kv_sizing import model_shape
        from kvserve.engine.worker.model_loader import load_model, resolve_model

        if (config.draft_tensor_parallel_size or 1) > 1:
            raise ConfigError("the draft model runs unsharded on the driver: set "
                              "draft_tensor_parallel_size to 1 (or leave it out)")
        device = context.device or torch.device("cpu")
        dtype = context.dtype or torch.float32
        path = resolve_model(config.model)
        self.model, cfg = load_model(path, dtype, device, max_model_len=context.max_model_len)
        self.vocab = min(cfg.vocab_size, context.vocab_size)
        if cfg.vocab_size < context.vocab_size // 2:
            raise ConfigError(f"draft model {config.model!r} has a vocabulary of "
                              f"{cfg.vocab_size}, the target {context.vocab_size}: a draft needs "
                              "the target's tokenizer")
        layers, kv_heads, head_dim = model_shape(cfg)
        self.kv = DraftKV(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                          dtype=dtype, device=device)
        self.streams: dict[str, _Stream] = {}

    @torch.inference_mode()
    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        plans = [p for i, view in enumerate(requests)
                 if (p := self._plan(i, view, num_tokens)) is not None]
        if not plans:
            return drafts
        steps = self._draft(plans)
        for p in plans:
            out = [int(t) for t in steps[: p.limit, p.index]]
            drafts[p.index] = out
            stream = self.streams[p.stream_id]
            stream.real_len = p.start + len(p.feed)
            stream.drafted = out[:-1]
        return drafts

    def _plan(self, index: int, view: SpecRequestView, num_tokens: int) -> _Plan | None:
        """Sync the stream's cache with its tokens: keep what matches, feed the rest."""
        tokens = view.token_ids
        n = len(tokens)
        limit = min(num_tokens, self.context.max_model_len - n - 1)
        if limit <= 0:
            return None
        sid = view.request_id
        stream = self.streams.get(sid)
        if stream is None or stream.real_len > n:
            self.release(sid)
            stream = self.streams[sid] = _Stream()
        valid = stream.real_len
        for drafted, real in zip(stream.drafted, tokens[valid:n].tolist()):
            if drafted != real:
                break
            valid += 1
        valid = min(valid, n - 1)  # the last token is always fed: its logits give draft 1
        self.kv.ensure(sid, n + limit - 1)
        return _Plan(index, sid, valid, tokens[valid:n].tolist(), limit)

    def _draft(self, plans: list[_Plan]) -> torch.Tensor:
        """[k, B] greedy drafts (row j: the (j+1)-th draft of each batch index)."""
        k = max(p.limit for p in plans)
        width = max(p.index for p in plans) + 1
        out = torch.zeros((k, width), dtype=torch.int64, device=self.kv.runner.device)
        batch = self.kv.batch([p.stream_id for p in plans], [p.start for p in plans],
                              [p.feed for p in plans])
        index = torch.tensor([p.index for p in plans], device=out.device)
        out[0, index] = self._greedy(batch.input_ids, batch)
        for j in range(1, k):
            live = [p for p in plans if p.limit > j]
            if not live:
                break
            index = torch.tensor([p.index for p in live], device=out.device)
            batch = self.kv.batch([p.stream_id for p in live],
                                  [p.start + len(p.feed) + j - 1 for p in live],
                                  [[0]] * len(live))
            out[j, index] = self._greedy(out[j - 1, index], batch)
        return out.cpu()

    def _greedy(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        hidden = self.model(input_ids, batch.positions, self.kv.kv_caches, batch.meta)
        logits = self.model.compute_logits(hidden[batch.last_rows])
        return logits[:, : self.vocab].argmax(dim=-1)

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.kv.free(request_id)
