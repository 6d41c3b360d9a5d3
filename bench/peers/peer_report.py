"""The vLLM peer bench's tables: each side's median (min-max) over the rounds, and kvserve / vLLM
taken round by round. Standard library only."""

from __future__ import annotations

from typing import Any

from peer_spread import ratio_spread, spread

Rounds = dict[str, list[dict[str, Any]]]  # {"kvserve": [one dict per round], "vllm": [...]}


def tok_s(run: dict[str, Any]) -> float:
    return run.get("tok_s") or run["tokens"] / run["seconds"]


def _cell(values: list[float], scale: float = 1, digits: int = 1) -> str:
    s = spread([v * scale for v in values])
    if s.rounds == 1:
        return f"{s.median:.{digits}f}"
    return f"{s.median:.{digits}f} ({s.lo:.{digits}f}-{s.hi:.{digits}f})"


def offline_table(rounds: Rounds) -> str:
    ours, theirs = [tok_s(r) for r in rounds["kvserve"]], [tok_s(r) for r in rounds["vllm"]]
    return "\n".join([
        "| offline LLM.generate | output tok/s, median (min-max) | rounds |",
        "| --- | ---: | ---: |",
        f"| kvserve | {_cell(ours)} | {len(ours)} |",
        f"| vLLM | {_cell(theirs)} | {len(theirs)} |",
        f"| kvserve / vLLM, per round | {ratio_spread(ours, theirs).text()} | {len(ours)} |"])


SERVER_COLUMNS = [("tok_s", "tok/s", 1), ("ttft_p50", "TTFT p50 ms", 1e3),
                  ("ttft_p99", "TTFT p99 ms", 1e3), ("itl_p50", "ITL p50 ms", 1e3),
                  ("itl_p99", "ITL p99 ms", 1e3)]


def server_table(rounds: Rounds) -> str:
    """Medians (min-max); the ratio row is kvserve / vLLM per round (for tok/s higher is better
    for kvserve, for the latencies lower is)."""
    head = "| server | " + " | ".join(name for _, name, _ in SERVER_COLUMNS) + " | rounds |"
    rows = [head, "| --- |" + " ---: |" * (len(SERVER_COLUMNS) + 1)]
    for who, label in (("kvserve", "kvserve serve"), ("vllm", "vLLM server")):
        runs = rounds[who]
        cells = [_cell([r[k] for r in runs], scale, 1 if k == "tok_s" else 0)
                 for k, _, scale in SERVER_COLUMNS]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {len(runs)} |")
    ratios = [ratio_spread([r[k] for r in rounds["kvserve"]], [r[k] for r in rounds["vllm"]])
              .text() for k, _, _ in SERVER_COLUMNS]
    rows.append("| kvserve / vLLM, per round | " + " | ".join(ratios)
                + f" | {len(rounds['kvserve'])} |")
    return "\n".join(rows)
