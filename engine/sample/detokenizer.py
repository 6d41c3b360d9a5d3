"""Incremental detokenization and stop-string detection for one output stream (in the engine, or
in the engine core's client when the core runs in its own process)."""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context so the first output tokens decode with the right spacing.
_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time.

    Decodes only a small window each step: text of tokens[prefix:] minus text of
    tokens[prefix:read]; a trailing U+FFFD (half a multi-byte character) waits for more tokens.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.context = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = self.read_offset = len(self.context)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, output_token_ids: list[int]) -> str | None:
        """Add the newest tokens; returns the stop string that matched, if any."""
        ids = self.context + output_token_ids
        prefix = self._decode(ids[self.prefix_offset : self.read_offset])
        full = self._decode(ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        before = len(self.text)
        self.text += delta
        return self._check_stop(before)

    def flush(self, output_token_ids: list[int]) -> None:
        """At the end of the stream: emit what was held back (an incomplete character)."""
        ids = self.context + output_token_ids
        prefix = self._decode(ids[self.prefix_offset : self.read_offset])
        full = self._decode(ids[self.prefix_offset :])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(ids)

    def _check_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        start = max(before - self.max_stop_len + 1, 0)
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx >= 0:
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return s
        return None


class NoText:
    """The detokenizer of a request whose text the engine core leaves to its client: no text,
    no stop strings (the client checks them and aborts the request)."""

    text = ""

    def update(self, output_token_ids: list[int]) -> str | None:
        return None

    def flush(self, output_token_ids: list[int]) -> None:
        pass


def core_makes_text(params: Any) -> bool:
    """Requests whose text the engine core makes even when its client detokenises: best_of (the
    ranking sees whole candidates) and n > 1 with stop strings (one sample cannot be aborted
    alone). `params` as the caller sent them (before best_of expands n)."""
    return bool(params.stop_strings and params.n > 1) or (params.best_of or 0) > params.n
