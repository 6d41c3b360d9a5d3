"""A request body's prompt as token ids, exactly as the engine computes them (same chat template,
same tokenizer helpers), so the router's block hashes match the replicas'."""

from __future__ import annotations

import functools
from typing import Any


def _message_text(content: Any) -> Any:
    if isinstance(content, list):  # OpenAI content parts: the text parts, concatenated
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def prompt_tokens_for(tokenizer: Any, path: str, body: dict[str, Any],
                      chat_encoder: Any = None) -> list[int] | None:
    """Token ids of a chat or completion request body, via the engine's own tokenizer helpers
    (`chat_encoder`: an engine.tokenizer.ChatEncoder over the same tokenizer, for speed). A
    migrated request's continuation follows its prompt: the replica's sequence, whose blocks
    decide where it continues (service/router/migration.py)."""
    tokens = _prompt_tokens(tokenizer, path, body, chat_encoder)
    cont = body.get("continuation")
    if tokens is not None and isinstance(cont, dict) and isinstance(cont.get("token_ids"), list):
        tokens = tokens + [t for t in cont["token_ids"] if isinstance(t, int)]
    return tokens


def _prompt_tokens(tokenizer: Any, path: str, body: dict[str, Any],
                   chat_encoder: Any = None) -> list[int] | None:
    from kvserve.engine.sample.tokenizer import chat_token_ids, prompt_token_ids

    if path.endswith("/chat/completions"):
        if body.get("chat_template") is not None or body.get("chat_template_kwargs"):
            # A request's own template is code: only a replica that trusts it runs it (sandboxed,
            # time-limited). The router routes such a request by load instead.
            return None
        messages = [{"role": m["role"], "content": _message_text(m.get("content")) or ""}
                    for m in body["messages"]]
        encode = chat_encoder or functools.partial(chat_token_ids, tokenizer)
        return encode(messages, add_generation_prompt=body.get("add_generation_prompt", True))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return prompt_token_ids(tokenizer, prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None
