"""Helpers for the speculative-decoding tests: the same chats through a plain engine and through
an n-gram speculative one of the same model (fp32, built one after the other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def plain_and_ngram(model_dir: Path, chats: list, params: SamplingParams
                    ) -> tuple[list[Any], list[Any], LLM]:
    """(the plain engine's outputs, the speculative engine's outputs, the speculative LLM);
    the plain engine is dropped before the speculative one is built (one KV pool at a time)."""
    common = dict(dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20)
    plain = LLM(str(model_dir), **common)
    ref = plain.chat(chats, params, use_tqdm=False)
    del plain
    spec = LLM(str(model_dir), speculative_config=dict(NGRAM), **common)
    return ref, spec.chat(chats, params, use_tqdm=False), spec
