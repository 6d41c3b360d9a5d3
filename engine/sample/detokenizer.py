"""Incremental detokenization and stop-string detection for one output stream (in the engine, or
in the engine core's client when the core runs in its own process). `new_detokenizer` picks the
fast path (the Rust tokenizer's DecodeStream) when the tokenizer has one, else the generic one."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens kept as left context, so the first output token decodes as it does after the
# prompt (a SentencePiece "▁word" keeps its space) and the generated text continues the prompt.
_CONTEXT = 5
# Where decode() and the Rust tokenizer's decode may differ: transformers' clean-up of spaces
# before punctuation, which DecodeStream does not do.
_PROBE = "a . b , c ! d ? e 's f n't"
_BACKEND_ATTR = "_kvserve_decode_stream_backend"


def new_detokenizer(tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                    stop: list[str], include_stop: bool) -> IncrementalDetokenizer:
    """The fastest detokenizer that gives `tokenizer.decode`'s text for this tokenizer."""
    backend = decode_stream_backend(tokenizer)
    cls = IncrementalDetokenizer if backend is None else FastIncrementalDetokenizer
    return cls(tokenizer, prompt_token_ids, skip_special_tokens, stop, include_stop)


def decode_stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The Rust `tokenizers.Tokenizer` of a HF fast tokenizer whose decode() is that Rust
    tokenizer's decode (checked once on a probe text, remembered on the tokenizer), else None."""
    cached = getattr(tokenizer, _BACKEND_ATTR, None)
    if cached is not None:
        return cached or None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or not isinstance(backend, Tokenizer):
        backend = None
    else:
        ids = backend.encode(_PROBE, add_special_tokens=False).ids
        for skip in (True, False):
            if tokenizer.decode(ids, skip_special_tokens=skip) != \
                    backend.decode(ids, skip_special_tokens=skip):
                backend = None
                break
    try:
        setattr(tokenizer, _BACKEND_ATTR, backend or False)
    except AttributeError:  # a tokenizer with __slots__: probe again next time
        pass
    return backend


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time, with any tokenizer.

    Decodes only a small window each step: text of tokens[prefix:] minus text of
    tokens[prefix:read]; a trailing U+FFFD (half a multi-byte character) waits for more tokens.
    Token positions count the prompt context first, then the output tokens.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.context = self._prompt_context(prompt_token_ids)
        self.prefix_offset, self.read_offset = 0, len(self.context)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, or none when the prompt ends inside a character (the
        output's first bytes then decode on their own, as in decode(output ids))."""
        tail = list(prompt_token_ids[-_CONTEXT:])
        return tail if tail and not self._decode(tail).endswith("\ufffd") else []

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


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """The same text through the Rust tokenizer's DecodeStream, primed with the prompt context:
    one call into Rust per step instead of two Python-level decode() calls.

    The window offsets are kept as the stream keeps its own, so `flush` (held-back bytes at the
    end) and the fallback after a DecodeStream error (its "invalid prefix", when a decoder's
    output is not monotonic) continue with the generic algorithm on the Rust decode.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop: bool) -> None:
        self.backend: Tokenizer = tokenizer._tokenizer
        super().__init__(tokenizer, prompt_token_ids, skip_special_tokens, stop, include_stop)
        self.stream: DecodeStream | None = DecodeStream(
            ids=self.context, skip_special_tokens=skip_special_tokens)
        self.context_len = len(self.context)
        self.seen = 0  # output tokens given to the stream

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip)

    def update(self, output_token_ids: list[int]) -> str | None:
        n = len(output_token_ids)
        if n <= self.seen:
            return None
        new = output_token_ids[-1] if n == self.seen + 1 else output_token_ids[self.seen :]
        self.seen = n
        if self.stream is None:
            return super().update(output_token_ids)
        try:
            piece = self.stream.step(self.backend, new)
        except Exception:  # noqa: BLE001 - the stream's state is unknown now: leave it
            self.stream = None
            return super().update(output_token_ids)
        if not piece:
            return None
        self.prefix_offset, self.read_offset = self.read_offset, self.context_len + n
        before = len(self.text)
        self.text += piece
        return self._check_stop(before) if self.stop else None

    def flush(self, output_token_ids: list[int]) -> None:
        if self.context_len + len(output_token_ids) > self.read_offset:
            super().flush(output_token_ids)
        self.stream = None  # any later update goes through the generic path


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
    return bool(params.stop_strings and params.n > 1) or (params.best_of or 0) > params.n \
        or hasattr(params, "beam_width")  # a beam search: the core ranks whole beams
