"""Tokenizer loading and prompt -> token ids, shared by the engine, the server and the router.

The router must tokenize exactly as the engine does (same chat template, same special tokens) or
its block hashes will not match the replica's; both call these functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve.engine.errors import InvalidRequestError


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def prompt_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a plain-text prompt (special tokens as the tokenizer adds them)."""
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, chat_template: str | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template applied to OpenAI-style messages, as text; `template_kwargs` are extra
    variables the template sees (vLLM's `chat_template_kwargs`)."""
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions with a plain prompt",
            param="messages")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **(template_kwargs or {}))
    except Exception as exc:  # jinja errors: a message the template cannot render
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", "messages") from exc


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]],
                   add_generation_prompt: bool = True, chat_template: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a chat conversation; the template already holds the special tokens."""
    text = render_chat(tokenizer, messages, add_generation_prompt, chat_template, template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ChatEncoder:
    """`chat_token_ids` with each piece of text between special tokens tokenized once.

    A fast tokenizer cuts its added tokens (`<|im_start|>`, ...) out of the text before the
    normaliser, pre-tokeniser and model see it, so the pieces between them are tokenized
    independently and concatenating per-piece ids gives the ids of the whole text. A chat's
    pieces repeat across requests (a tenant's system prompt, the earlier turns), so with an LRU
    of piece -> ids the router tokenizes only the new message (the saving: docs/perf.md). Where
    that independence does not hold (added tokens that strip whitespace, a Metaspace
    pre-tokeniser that marks only the first piece, ...) a probe at construction sees the
    difference and every call tokenizes the whole text, as `chat_token_ids` does.
    """

    PROBE = [{"role": "system", "content": " Be brief.\n"},
             {"role": "user", "content": "Hello there,  how are you?"},
             {"role": "assistant", "content": "Fine. And you?"},
             {"role": "user", "content": "\n\tGreat!"}]

    def __init__(self, tokenizer: Any, cache_size: int = 4096) -> None:
        import functools
        import re

        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._ids = {tok.content: tid for tid, tok in added.items()}
        risky = any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False)
                    or getattr(t, "single_word", False) for t in added.values())
        pattern = "|".join(re.escape(c) for c in sorted(self._ids, key=len, reverse=True) if c)
        self._split = re.compile(f"({pattern})").split if pattern else None
        self._piece = functools.lru_cache(maxsize=cache_size)(self._encode_piece)
        self.segmented = (self._split is not None and not risky
                          and getattr(tokenizer, "is_fast", False)
                          and not getattr(tokenizer, "split_special_tokens", False))
        if self.segmented:
            try:
                text = render_chat(tokenizer, self.PROBE)
                self.segmented = self._segmented_ids(text) == self._whole_ids(text)
            except InvalidRequestError:
                self.segmented = False

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 chat_template: str | None = None) -> list[int]:
        text = render_chat(self.tokenizer, messages, add_generation_prompt, chat_template)
        return self._segmented_ids(text) if self.segmented else self._whole_ids(text)

    def _whole_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _segmented_ids(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._split(text)):  # type: ignore[misc]
            if i % 2:  # the captured separators: added tokens
                ids.append(self._ids[piece])
            elif piece:
                ids.extend(self._piece(piece))
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
