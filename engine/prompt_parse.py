"""vLLM's prompt types (`vllm.inputs`: `TextPrompt`, `TokensPrompt`, `EmbedsPrompt`, the dicts
`LLM.generate` takes) and `parse_model_prompt`, which normalises any prompt to one of them.
kvserve serves decoder-only models, so this is vLLM's decoder-only path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # carried along, not tokenised again
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    prompt_embeds: Any  # a [seq_len, hidden] torch.Tensor (enable_prompt_embeds)
    prompt: NotRequired[str]
    prompt_token_ids: NotRequired[list[int]]
    prompt_is_token_ids: NotRequired[list[bool]]
    cache_salt: NotRequired[str]


SingletonPrompt = Union[str, list[int], TextPrompt, TokensPrompt, EmbedsPrompt]
PromptType = SingletonPrompt  # no encoder-decoder prompts: decoder-only models


def parse_model_prompt(model_config: Any, prompt: object) -> dict[str, Any]:
    """{"prompt": text} for a string, {"prompt_token_ids": ids} for a list of ints, the dict
    itself for a prompt dict; TypeError (vLLM's messages) for anything else."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list):
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("Token prompt should be a list of integers")
        return {"prompt_token_ids": prompt}
    if isinstance(prompt, dict):
        if "encoder_prompt" in prompt:
            raise TypeError("Cannot pass encoder-decoder prompt to decoder-only models")
        _validate_prompt_dict(prompt)
        if "prompt" in prompt or "prompt_token_ids" in prompt or "prompt_embeds" in prompt:
            return prompt
        raise TypeError("Prompt dictionary must contain text, tokens, or embeddings")
    raise TypeError("Prompt should be a string, list of tokens, or dictionary")


def _validate_prompt_dict(prompt: Mapping[str, object]) -> None:
    """Text alone must be a string (with ids or embeddings the text is only carried along)."""
    if "prompt" not in prompt or "prompt_token_ids" in prompt or "prompt_embeds" in prompt:
        return
    if not isinstance(prompt["prompt"], str):
        raise TypeError("Prompt text should be a string")
