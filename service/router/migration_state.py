"""The client's side of a migratable stream: the tokens each choice has delivered, and every
upstream SSE event rewritten so that the legs of a migrated request (the original replica's,
then continuations on others) read as one stream with one id. service/router/migration.py
drives it; this file does no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Error types of a replica that failed while it generated (engine death, a dying process, a
# drain hand-back): another replica can go on. Client errors and deadlines would repeat.
_MIGRATABLE_ERRORS = {"server_error", "service_unavailable", "upstream_error"}
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class StreamBroken(Exception):
    """The upstream leg ended before its choices finished; `reason` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class ChoiceState:
    """What the client has of one choice."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0  # characters of text delivered (completions' logprob text offsets)
    finished: bool = False
    base_chars: int = 0  # `chars` when the current continuation leg of this choice began


@dataclass
class SpliceState:
    """One streamed request as the client sees it, across its upstream legs."""

    n: int
    chat: bool
    keep_token_ids: bool  # the client asked for return_token_ids itself
    want_usage: bool  # the client asked for stream_options.include_usage
    head: dict[str, Any] | None = None  # id, object, created, model of the first chunk
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    usage: dict[str, Any] | None = None  # the latest usage chunk's usage
    migrations: int = 0
    ended_by_error: bool = False  # an error event the client got: the stream is over

    def __post_init__(self) -> None:
        self.choices = {i: ChoiceState() for i in range(self.n)}

    def unfinished(self) -> list[int]:
        return [i for i, c in self.choices.items() if not c.finished]

    def delivered(self) -> int:
        """The most tokens any choice has delivered."""
        return max((len(c.token_ids) for c in self.choices.values()), default=0)

    def start_continuation(self, index: int) -> None:
        c = self.choices[index]
        c.base_chars = c.chars

    def event(self, payload: str, continuation: bool) -> str | None:
        """The `data:` event to send the client for one upstream payload (None: nothing).
        StreamBroken on an error event another replica can mend; other errors pass through."""
        data = json.loads(payload)
        if "error" in data:
            err = data["error"] if isinstance(data["error"], dict) else {}
            if err.get("kvserve_migrate"):
                raise StreamBroken("drain", str(err.get("message")))
            if err.get("type") in _MIGRATABLE_ERRORS:
                raise StreamBroken("error_event", str(err.get("message")))
            self.ended_by_error = True
            return f"data: {payload}\n\n"
        self._rewrite_head(data)
        prompt_ids = data.pop("prompt_token_ids", None)  # a chat stream's, on its first chunk
        if prompt_ids is not None and self.keep_token_ids and not continuation:
            data["prompt_token_ids"] = prompt_ids
        choices = [c for c in (self._choice(c, continuation) for c in data.get("choices") or [])
                   if c is not None]
        if data.get("usage") is not None:
            self.usage = data["usage"]
            if not data.get("choices"):
                return None  # the usage chunk: `final_events` sends the request's own
            data["usage"] = self.total_usage() if self.migrations else data["usage"]
        if not choices and data.get("choices"):
            return None  # only a continuation's repeated role chunk was left
        data["choices"] = choices
        return f"data: {_dumps(data)}\n\n"

    def _rewrite_head(self, data: dict[str, Any]) -> None:
        if self.head is None:
            self.head = {k: data.get(k) for k in ("id", "object", "created", "model")}
        else:  # a continuation's chunk: the client keeps the first replica's identity
            for key in ("id", "created", "model"):
                data[key] = self.head[key]

    def _choice(self, choice: dict[str, Any], continuation: bool) -> dict[str, Any] | None:
        """Book one streamed choice; None when it carries nothing for the client."""
        ids = choice.pop("token_ids", None) or []
        prompt_ids = choice.pop("prompt_token_ids", None)
        state = self.choices.setdefault(int(choice.get("index", 0)), ChoiceState())
        state.token_ids += ids
        delta = choice.get("delta") if self.chat else None
        text = (delta or {}).get("content") if self.chat else choice.get("text")
        if continuation:
            if delta is not None:
                delta.pop("role", None)  # said once, by the first leg
            self._shift_offsets(choice, state)
        state.chars += len(text or "")
        if choice.get("finish_reason") is not None:
            state.finished = True
        if continuation and not ids and not text and choice.get("finish_reason") is None \
                and not any(v for v in (delta or {}).values()):
            return None
        if self.keep_token_ids:
            choice["token_ids"] = ids
            if prompt_ids is not None and not continuation:
                choice["prompt_token_ids"] = prompt_ids
        return choice

    @staticmethod
    def _shift_offsets(choice: dict[str, Any], state: ChoiceState) -> None:
        """A continuation counts text offsets from its own start: the client's count from the
        choice's."""
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list) and state.base_chars:
            lp["text_offset"] = [o + state.base_chars for o in lp["text_offset"]]

    def total_usage(self) -> dict[str, Any]:
        """Usage of the whole generation: the prompt once, every delivered token."""
        usage = dict(self.usage or {})
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        usage.update(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
        return usage

    def final_events(self) -> str:
        """The usage chunk (when the client asked for it) and [DONE]."""
        out = ""
        if self.want_usage and self.head is not None and self.usage is not None:
            usage = self.total_usage() if self.migrations else self.usage
            out = f"data: {_dumps({**self.head, 'choices': [], 'usage': usage})}\n\n"
        return out + "data: [DONE]\n\n"


def split_events(buffer: bytes) -> tuple[list[str], bytes]:
    """Whole SSE events' `data:` payloads in `buffer`, and the incomplete rest."""
    *events, rest = buffer.split(b"\n\n")
    payloads = []
    for event in events:
        # Lines end at "\n" alone: JSON leaves U+2028, U+0085 and the like unescaped in text,
        # and str.splitlines would cut an event there.
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip().decode())
    return payloads, rest
