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
                add_generation_prompt: bool = True, chat_template: str | None = None) -> str:
    """The chat template applied to OpenAI-style messages, as text."""
    if getattr(tokenizer, "chat_template", None) is None and chat_template is None:
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions with a plain prompt",
            param="messages")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template)
    except Exception as exc:  # jinja errors: a message the template cannot render
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", "messages") from exc


def chat_token_ids(tokenizer: Any, messages: list[dict[str, Any]],
                   add_generation_prompt: bool = True, chat_template: str | None = None) -> list[int]:
    """Token ids of a chat conversation; the template already holds the special tokens."""
    text = render_chat(tokenizer, messages, add_generation_prompt, chat_template)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
