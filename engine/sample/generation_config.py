"""Default sampling from the model's generation_config.json, as vLLM's `--generation-config auto`:
the values a model's authors wrote there (temperature, top_p, ...) replace the OpenAI defaults for
a request that leaves them out. "vllm" turns this off; a folder reads that folder's file."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvserve.engine.errors import ConfigError

logger = logging.getLogger("kvserve.engine")

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_path: Path | str, mode: str = "auto") -> dict[str, Any]:
    """{SamplingParams field: value} from the file (only the keys it sets); {} for "vllm"."""
    if mode == "vllm":
        return {}
    folder = Path(model_path) if mode == "auto" else Path(mode)
    if mode != "auto" and not folder.is_dir():
        raise ConfigError(f"--generation-config must be 'auto', 'vllm' or a folder holding "
                          f"generation_config.json; {mode!r} is none of them")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    defaults = {field: data[key] for key, field in _KEYS.items()
                if isinstance(data.get(key), (int, float)) and not isinstance(data[key], bool)}
    if defaults:
        logger.info("default sampling from %s: %s (a request's own values win; "
                    "--generation-config vllm turns this off)", path, defaults)
    return defaults
