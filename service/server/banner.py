"""What the server prints once it listens: a curl line and the Python snippet to call it."""

from __future__ import annotations

import json
from typing import Any

from kvserve.service.server.config import ServerConfig


def banner(config: ServerConfig, model: str, defaults: dict[str, Any] | None = None) -> str:
    """How to call this server: a curl line and the Python snippet (and the default sampling
    from the model's generation config, when it sets any)."""
    host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    base = f"http://{host}:{config.port}"
    auth = " -H 'Authorization: Bearer $KVSERVE_API_KEY'" if config.api_key else ""
    body = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32})
    return "\n".join([
        f"kvserve is serving {model!r} at {base}/v1  (metrics: {base}/metrics)",
        *(["default sampling (generation_config.json; a request's own values win): " +
           ", ".join(f"{k} {v}" for k, v in defaults.items())] if defaults else []),
        "",
        "Try it:",
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        "",
        "  import openai",
        f"  client = openai.Client(base_url=\"{base}/v1\", api_key=\"dummy\")",
        "  response = client.chat.completions.create(",
        f"      model=\"{model}\",",
        "      messages=[{\"role\": \"user\", \"content\": \"Explain how the KV cache works\"}],",
        "      temperature=0.7, max_tokens=512, stream=True,",
        "  )",
        "  for chunk in response:",
        "      if chunk.choices[0].delta.content:",
        "          print(chunk.choices[0].delta.content, end=\"\")",
        "",
    ])

