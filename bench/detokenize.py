"""Incremental detokenizing's CPU time per streamed token: the generic path (two
`tokenizer.decode` calls a step) against the DecodeStream fast path, on the default model's
tokenizer, over streams of real text, in the same run.

    python bench/detokenize.py [--streams 64] [--tokens 64] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kvserve.engine.sample.detokenizer import (FastIncrementalDetokenizer, IncrementalDetokenizer,
                                               decode_stream_backend)
from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.engine.worker.model_loader import fetch_model

ROOT = Path(__file__).resolve().parent.parent


def real_streams(tokenizer, streams: int, tokens: int, prompt: int = 200
                 ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) pairs cut from the project's own docs (prose, tables, code)."""
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    step = (len(ids) - prompt - tokens) // streams
    return [(ids[i * step : i * step + prompt], ids[i * step + prompt : i * step + prompt + tokens])
            for i in range(streams)]


def run_once(cls, tokenizer, pairs, stop: list[str]) -> tuple[float, float]:
    """CPU seconds to create every stream's detokenizer, and to feed all their tokens (token by
    token, round-robin over the streams as the output processor does each step)."""
    t0 = time.process_time()
    dets = [cls(tokenizer, p, True, stop, False) for p, _ in pairs]
    t1 = time.process_time()
    outs: list[list[int]] = [[] for _ in pairs]
    for t in range(len(pairs[0][1])):
        for det, out, (_, ids) in zip(dets, outs, pairs):
            out.append(ids[t])
            det.update(out)
    for det, out in zip(dets, outs):
        det.flush(out)
    return t1 - t0, time.process_time() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    tokenizer = load_tokenizer(fetch_model("smollm2-135m-instruct"))
    assert decode_stream_backend(tokenizer) is not None
    pairs = real_streams(tokenizer, args.streams, args.tokens)
    n_tok = args.streams * args.tokens
    print(f"{args.streams} streams x {args.tokens} tokens, median of {args.repeat} (CPU time)")
    print("| stop strings | path | per token (us) | per request setup (us) | vs generic |")
    print("| --- | --- | ---: | ---: | ---: |")
    for stop in ([], ["\n\n\n", "</answer>"]):
        res: dict[str, list[tuple[float, float]]] = {"generic": [], "DecodeStream": []}
        for _ in range(args.repeat):  # alternate, so load changes hit both alike
            res["generic"].append(run_once(IncrementalDetokenizer, tokenizer, pairs, stop))
            res["DecodeStream"].append(run_once(FastIncrementalDetokenizer, tokenizer, pairs, stop))
        base = statistics.median(r[1] for r in res["generic"]) / n_tok
        for name, runs in res.items():
            per_tok = statistics.median(r[1] for r in runs) / n_tok
            setup = statistics.median(r[0] for r in runs) / args.streams
            print(f"| {len(stop)} | {name} | {per_tok * 1e6:.1f} | {setup * 1e6:.1f} | "
                  f"{base / per_tok:.1f}x |")
    texts = [(IncrementalDetokenizer, []), (FastIncrementalDetokenizer, [])]
    for cls, acc in texts:
        for p, out in pairs:
            det = cls(tokenizer, p, True, [], False)
            for t in range(len(out)):
                det.update(out[: t + 1])
            det.flush(out)
            acc.append(det.text)
    assert texts[0][1] == texts[1][1] == [tokenizer.decode(o, skip_special_tokens=True)
                                          for _, o in pairs]
    print("texts: both paths equal decode(output ids) on every stream")


if __name__ == "__main__":
    main()
