"""Workloads and drafts for bench/spec_decode.py's suffix and draft-model rows.

- `agentic_requests`: an agent loop's requests: the same tool definitions and the same kind of
  history (tool calls as JSON, tool results), a new task each (other cities, dates, ids). Their
  answers share structure across requests, which suffix decoding's cache of recent outputs
  drafts from; each round gets tasks of its own (`seed`), so no round repeats another's.
- `layer_skip_draft`: a draft model with the target's tokenizer made from the target itself:
  its first `layers` decoder layers, its final norm and lm_head (self-speculation without
  training, as LayerSkip's early exit; acceptance is whatever that gives).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

TOOLS = [
    {"name": "get_weather", "description": "Current weather for a city",
     "parameters": {"city": "string", "unit": "celsius|fahrenheit"}},
    {"name": "search_flights", "description": "Flights between two cities on a date",
     "parameters": {"origin": "string", "destination": "string", "date": "YYYY-MM-DD"}},
    {"name": "book_hotel", "description": "Book a hotel room",
     "parameters": {"city": "string", "check_in": "YYYY-MM-DD", "nights": "integer"}},
]
SYSTEM = ("You are a travel agent that acts only through tools. Answer every turn with exactly "
          "one tool call as JSON: {\"tool\": <name>, \"arguments\": {...}}. Tools:\n"
          + "\n".join(json.dumps(t) for t in TOOLS))
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin",
          "Athens", "Warsaw", "Zurich", "Brussels", "Helsinki", "Budapest", "Copenhagen"]


def _call(tool: str, **arguments: object) -> str:
    return json.dumps({"tool": tool, "arguments": arguments})


def agentic_requests(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`n` agent turns: a trip to plan, two tool calls already made, the third to write."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        origin, dest = rng.sample(CITIES, 2)
        date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        nights = rng.randint(1, 9)
        history = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Plan my trip from {origin} to {dest} on {date} for "
                                        f"{nights} nights: check the weather, find a flight, "
                                        "book a hotel."},
            {"role": "assistant", "content": _call("get_weather", city=dest, unit="celsius")},
            {"role": "user", "content": f"Tool result: {rng.randint(5, 30)} C, clear."},
            {"role": "assistant", "content": _call("search_flights", origin=origin,
                                                   destination=dest, date=date)},
            {"role": "user", "content": f"Tool result: flight KV{rng.randint(100, 999)} found. "
                                        "Next tool call?"},
        ]
        out.append(history)
    return out


def layer_skip_draft(model_dir: str | Path, layers: int, dest: str | Path) -> Path:
    """The target's first `layers` layers + final norm + lm_head, saved as a model folder."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(model_dir), Path(dest)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    keep = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                continue
            keep[name] = t
    save_file(keep, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return dst
