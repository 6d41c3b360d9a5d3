"""EAGLE speculation (methods "eagle" and "eagle3"): a one-layer head (eagle_head.py) drafts from
the target's hidden states, which the engine hands over after every target forward (`on_step`).

Alignment, as in EAGLE and vLLM: the head's row at position p reads the token at p + 1 and the
target's state at p, and predicts the token at p + 2. So when a stream has n tokens (the last
one not yet run by the target), the target states up to position n - 2 are known; the head runs
over the rows it has not seen (the prompt for a new stream; the last token and the accepted drafts
after a verification), then drafts one token per forward feeding back its own state.

Rows the head computed from its own states (positions >= n - 1) are never kept: the next step
recomputes them from the target's states, so only positions < n - 1 of its paged KV cache
(draft_kv.py, a pool of its own) are reused.

EAGLE-3 reads three intermediate states of the target: forward pre-hooks on the target's layers
(`AuxCapture`) keep the residual stream entering them during each target forward, unless the
step carries them itself (`StepHiddenStates.aux_hidden_states`). Hooks do not run when a CUDA
graph replays: a target captured in graphs must hand them over in the step instead.

A prefix the target did not compute (a prefix-cache hit) gives no states: the head's cache then
starts at the first position it has a state for (rotary positions stay the target's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvserve.engine.errors import ConfigError
from kvserve.engine.spec_decode.draft_kv import DraftKV
from kvserve.engine.spec_decode.eagle_head import EagleHead, read_head
from kvserve.engine.spec_decode.proposer import (Proposer, ProposerContext, SpecRequestView,
                                                 StepHiddenStates)
from kvserve.engine.spec_decode.registry import register_proposer


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's and EAGLE-3's default: the states entering layers 2, L/2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


class AuxCapture:
    """Keeps the residual stream entering some of the target's layers on each forward."""

    def __init__(self, target: torch.nn.Module, layer_ids: Sequence[int]) -> None:
        layers = target.model.layers
        bad = [i for i in layer_ids if not 0 <= i < len(layers)
               or type(layers[i]).__name__ == "PPMissingLayer"]
        if bad:
            raise ConfigError(f"EAGLE-3 reads the target's layers {list(layer_ids)}; this "
                              f"model (stage) does not hold {bad}")
        self.latest: list[Tensor | None] = [None] * len(layer_ids)
        self.handles = [layers[i].register_forward_pre_hook(self._hook(k))
                        for k, i in enumerate(layer_ids)]

    def _hook(self, k: int):
        def keep(_module, args):
            x, residual = args[0], args[1]
            self.latest[k] = x if residual is None else x + residual
        return keep

    def take(self, num_rows: int) -> Tensor | None:
        """The last forward's states [T, 3 * hidden], once; None when no forward ran the hooks
        since the last take (a CUDA graph replay) or it had another number of rows."""
        latest, self.latest = self.latest, [None] * len(self.latest)
        if any(t is None or t.shape[0] != num_rows for t in latest):
            return None
        return torch.cat(latest, dim=-1)  # type: ignore[arg-type]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class _Stream:
    base: int  # the first position the head's cache holds
    real_len: int  # positions [base, real_len) hold rows fed by target states
    chunks: list[tuple[int, Tensor]] = field(default_factory=list)  # (start, states) not run yet
    tail: Tensor | None = None  # the state at real_len - 1 (to rerun the last row)


@dataclass
class _Plan:
    index: int
    stream_id: str
    start: int  # first position fed
    ids: list[int]
    states: Tensor
    limit: int
    base: int


@register_proposer
class EagleProposer(Proposer):
    """An EAGLE-1 head over the target's last hidden states."""

    method = "eagle"
    uses_hidden_states = True
    eagle3 = False

    def __init__(self, config, context: ProposerContext) -> None:
        super().__init__(config, context)
        target = context.target_model
        if target is None:
            raise ConfigError(f"speculative method {self.method!r} needs the target model")
        if getattr(target, "tp", None) is not None:
            raise ConfigError(f"{self.method!r} runs with tensor_parallel_size 1 here (the head "
                              "shares the target's embedding and lm_head)")
        device = context.device or torch.device("cpu")
        dtype = context.dtype or torch.float32
        head_cfg, tensors = read_head(config.model)
        tcfg = context.hf_config or target.config
        self.head = EagleHead(head_cfg, self.eagle3, dtype, device,
                              target_hidden=int(getattr(head_cfg, "target_hidden_size", None)
                                                or tcfg.hidden_size),
                              max_model_len=context.max_model_len,
                              fc_bias="fc.bias" in tensors,
                              own_embedding="embed_tokens.weight" in tensors)
        self.head.to(device)
        self.head.load_checkpoint(tensors)
        self.head.eval()
        self.head.share(target.model.embed_tokens, target.compute_logits)
        d = self.head.dims
        self.kv = DraftKV(num_layers=1, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
                          dtype=dtype, device=device)
        self.capture: AuxCapture | None = None
        if self.eagle3:
            eagle_cfg = getattr(head_cfg, "eagle_config", None) or {}
            ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or \
                default_aux_layers(tcfg.num_hidden_layers)
            self.capture = AuxCapture(target, ids)
        self.streams: dict[str, _Stream] = {}

    @torch.inference_mode()
    def on_step(self, step: StepHiddenStates) -> None:
        states = self._target_states(step)
        if states is None or not sum(step.num_kept):
            return  # the streams see a gap and restart their head cache after it
        rows = [torch.arange(a, a + k) for a, k in zip(step.query_start_loc, step.num_kept)]
        index = torch.cat(rows).to(states.device)
        combined = self.head.combine(states.index_select(0, index).to(self.head.dtype))
        for rid, pos, piece in zip(step.request_ids, step.positions,
                                   combined.split(list(step.num_kept))):
            if piece.shape[0]:
                stream = self.streams.get(rid)
                if stream is None:
                    stream = self.streams[rid] = _Stream(pos, pos)
                stream.chunks.append((pos, piece))

    def _target_states(self, step: StepHiddenStates) -> Tensor | None:
        if not self.eagle3:
            return step.hidden_states
        aux = getattr(step, "aux_hidden_states", None)
        if aux is not None:
            return aux
        assert self.capture is not None
        return self.capture.take(step.hidden_states.shape[0])

    @torch.inference_mode()
    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        plans = [p for i, view in enumerate(requests)
                 if (p := self._plan(i, view, num_tokens)) is not None]
        if not plans:
            return drafts
        out = self._draft(plans)
        for p in plans:
            drafts[p.index] = [int(t) for t in out[: p.limit, p.index]]
        return drafts

    def _plan(self, index: int, view: SpecRequestView, num_tokens: int) -> _Plan | None:
        """The rows to run for a stream: its unseen target states up to position n - 2."""
        sid, tokens = view.request_id, view.token_ids
        n = len(tokens)
        limit = min(num_tokens, self.context.max_model_len - n - 1)
        stream = self.streams.get(sid)
        if stream is None or limit <= 0:
            return None
        states = self._take_states(sid, stream, n - 1)
        if states is None:
            return None
        start = stream.real_len - states.shape[0]
        if states.shape[0] == 0:  # nothing new since the last draft: rerun the last row
            if stream.tail is None:
                return None
            states, start = stream.tail[None], n - 2
        stream.tail = states[-1]
        self.kv.ensure(sid, n - 1 + limit - stream.base)
        ids = tokens[start + 1:n].tolist()
        return _Plan(index, sid, start, ids, states, limit, stream.base)

    def _take_states(self, sid: str, stream: _Stream, end: int) -> Tensor | None:
        """States for positions [real_len, end) from the stream's chunks (consumed); None when
        they do not reach `end` yet. A gap restarts the head's cache at the chunk after it."""
        parts: list[Tensor] = []
        pos = stream.real_len
        for start, states in stream.chunks:
            if start > pos:  # a gap: positions the head will never get states for
                self.kv.free(sid)
                stream.base, parts, pos = start, [], start
            skip = pos - start
            if skip < states.shape[0]:
                parts.append(states[skip:])
                pos = start + states.shape[0]
        if pos < end:
            return None
        stream.chunks = []
        merged = torch.cat(parts) if parts else stream.tail.new_zeros((0, stream.tail.shape[0])) \
            if stream.tail is not None else torch.zeros(0, self.head.dims.hidden)
        keep = merged.shape[0] - (pos - end)
        stream.real_len = end
        return merged[:keep]

    def _draft(self, plans: list[_Plan]) -> Tensor:
        """[k, B] drafts: one forward over every stream's unseen rows, then one per draft."""
        k = max(p.limit for p in plans)
        width = max(p.index for p in plans) + 1
        dev = self.kv.runner.device
        out = torch.zeros((k, width), dtype=torch.int64, device=dev)
        batch = self.kv.batch([p.stream_id for p in plans], [p.start - p.base for p in plans],
                              [p.ids for p in plans], [p.base for p in plans])
        states = torch.cat([p.states for p in plans])
        logit_states, feed = self.head(batch.input_ids, batch.positions, states,
                                       self.kv.kv_caches[0], batch.meta)
        index = torch.tensor([p.index for p in plans], device=dev)
        out[0, index] = self.head.draft_ids(logit_states[batch.last_rows])
        feed = feed[batch.last_rows]
        for j in range(1, k):
            live = [i for i, p in enumerate(plans) if p.limit > j]
            if not live:
                break
            lp = [plans[i] for i in live]
            index = torch.tensor([p.index for p in lp], device=dev)
            batch = self.kv.batch([p.stream_id for p in lp],
                                  [p.start + len(p.ids) - 1 + j - p.base for p in lp],
                                  [[0]] * len(lp), [p.base for p in lp])
            feed = feed[torch.tensor(live, device=feed.device)] if len(live) < len(feed) \
                else feed
            plans = lp
            logit_states, feed = self.head(out[j - 1, index], batch.positions, feed,
                                           self.kv.kv_caches[0], batch.meta)
            out[j, index] = self.head.draft_ids(logit_states)
        return out.cpu()

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.kv.free(request_id)


@register_proposer
class Eagle3Proposer(EagleProposer):
    """An EAGLE-3 head over three of the target's intermediate hidden states."""

    method = "eagle3"
    eagle3 = True
