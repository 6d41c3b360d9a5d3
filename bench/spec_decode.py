"""Speculative decoding against the same engine without it, in the same run: generated tokens
per second on an input-grounded workload (summaries of a given text that reuse its words)
and on free chat (bench/workload.py), at concurrency 1, 8 and 64, greedy and T=0.7.

    python bench/spec_decode.py [--method ngram] [--k 4] [--rounds 3] [--batches 1,8,64]

Each round runs plain and speculative decoding (the order turns each round) on the same
requests; the ratio is taken per round, and the median and min-max over the rounds are printed
with the acceptance figures of the speculative runs. Sampled requests are seeded (request i of
round r: seed 1000 r + i), so both engines draw the same answers. `--control` times a second plain engine in
the same rounds: its ratio to the first is what chance alone moves a ratio by. `--waves N`
submits N x concurrency requests to engines of max_num_seqs = concurrency: the concurrency
stays in flight (a finished request's slot is taken by the next), as on a loaded server,
instead of a closed batch whose time is its slowest request's. Concurrency 1 runs the requests one after
another; 8 and 64 submit them all at once."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from spec_workloads import agentic_requests, layer_skip_draft
from workload import chat_requests

from kvserve import LLM, SamplingParams

TEXT = (
    "Paged attention stores the key and value vectors of every request in fixed-size blocks, "
    "so the cache of a long conversation does not need one contiguous region of memory. The "
    "scheduler allocates blocks as tokens arrive, shares the blocks of a common prefix between "
    "requests, and frees them when a request ends. When memory runs out, the newest request is "
    "preempted and its blocks are either copied to host memory or dropped and recomputed later. "
    "Prefix caching keeps finished blocks indexed by a hash of their tokens, so a second "
    "request with the same system prompt skips most of its prefill."
)
# Summaries that reuse the text's own words: SmolLM2-135M copies long runs of the input here
# (it does not follow "repeat exactly" or "return the whole code" instructions)
EDITS = ["Summarise this text in three sentences, reusing its own words:",
         "Summarise this paragraph for an engineer, keeping its wording:",
         "Give a short summary of this text, quoting its key sentences:",
         "Summarise the text below in two sentences, in its own words:"]


def grounded_requests(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{EDITS[i % len(EDITS)]}\n\n{TEXT}"}]
            for i in range(n)]


def run(llm: LLM, chats: list, params: SamplingParams, concurrency: int,
        seed: int | None = None) -> tuple[int, float]:
    """(generated tokens, seconds) of the requests at this concurrency. `seed`: a sampled
    request i draws with seed + i, so plain and speculative decoding draw the same tokens
    (speculation keeps a seeded request's tokens; bf16 batches may still part them at a near
    tie) and a round's ratio compares the same work."""
    each = [params] * len(chats) if seed is None or params.temperature == 0 else \
        [dataclasses.replace(params, seed=seed + i) for i in range(len(chats))]
    t0 = time.perf_counter()
    if concurrency == 1:
        outs = [o for c, p in zip(chats, each) for o in llm.chat([c], p, use_tqdm=False)]
    else:
        outs = llm.chat(chats, each, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def spec_figures(llm: LLM) -> tuple[int, int, int]:
    s = llm.llm_engine.get_stats()
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens)


def compare(base: LLM, spec: LLM, chats: list, params: SamplingParams, concurrency: int,
            rounds: int, control: LLM | None = None) -> str:
    """One table row. `control`: a second plain engine timed in the same rounds; its ratio to
    the first (the same code: 1.00x but for noise) shows how far a ratio moves by chance."""
    engines = [base, spec] + ([control] if control is not None else [])
    rates: dict[int, list[float]] = {id(e): [] for e in engines}
    first = chats(-1) if callable(chats) else chats  # agentic: a task set of its own
    # First calls of new shapes (oneDNN primitives, the allocator's arenas) are not timed: each
    # engine runs the cell's requests once at its concurrency, 8 tokens each (the speculative
    # engine's drafting/plain choice sees one epoch of it; it learns the rest in the rounds)
    warm = SamplingParams(temperature=params.temperature, max_tokens=8)
    for llm in engines:
        run(llm, first[:1] if concurrency == 1 else first, warm, concurrency)
    before = spec_figures(spec)
    for r in range(rounds):
        round_chats = chats(r) if callable(chats) else chats  # agentic: new tasks each round
        shift = r % len(engines)  # each engine runs first, second, ... in turn
        for llm in engines[shift:] + engines[:shift]:
            tokens, seconds = run(llm, round_chats, params, concurrency, seed=1000 * r)
            rates[id(llm)].append(tokens / seconds)
    ratio = [s / b for s, b in zip(rates[id(spec)], rates[id(base)])]
    drafts, drafted, accepted = (a - b for a, b in zip(spec_figures(spec), before))
    rate = accepted / drafted if drafted else 0.0
    mean_len = 1 + accepted / drafts if drafts else 1.0
    row = (f"{statistics.median(rates[id(base)]):.1f} | {statistics.median(rates[id(spec)]):.1f}"
           f" | **{statistics.median(ratio):.2f}x** | {min(ratio):.2f}-{max(ratio):.2f} | "
           f"{rate:.0%} | {mean_len:.2f}")
    if control is not None:
        noise = [c / b for c, b in zip(rates[id(control)], rates[id(base)])]
        row += f" | {statistics.median(noise):.2f}x ({min(noise):.2f}-{max(noise):.2f})"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--workloads", default="grounded,free")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens per request")
    ap.add_argument("--serial", type=int, default=2, help="requests run one by one at batch 1")
    ap.add_argument("--draft", default="self",
                    help="draft_model: 'self' (the target drafts for itself: every draft is "
                         "accepted at T=0, at the cost of a second forward) or 'skip:N' (the "
                         "target's first N layers + its head, bench/spec_workloads.py)")
    ap.add_argument("--control", action="store_true",
                    help="time a second plain engine too: its ratio to the first is the noise")
    ap.add_argument("--waves", type=int, default=1,
                    help="requests per slot: 1 submits `concurrency` requests at once (a closed "
                         "batch, timed until the last ends); N > 1 submits N x concurrency with "
                         "max_num_seqs = concurrency, so that many stay in flight as in serving")
    args = ap.parse_args()
    config = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "draft_model":
        from kvserve.engine.worker.model_loader import resolve_model

        target = resolve_model(args.model)
        if args.draft.startswith("skip:"):
            n = int(args.draft.split(":")[1])
            target = layer_skip_draft(target, n, f"/tmp/kvserve-skip-draft-{n}")
        config["model"] = str(target)
    if args.method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    built: dict[int, tuple[LLM, LLM, LLM | None]] = {}

    def engines(slots: int) -> tuple[LLM, LLM, LLM | None]:
        """plain, speculative and control engines of `slots` max_num_seqs (one set at a time)."""
        if slots not in built:
            for old in built.values():
                for llm in old:
                    if llm is not None:
                        llm.shutdown()
            built.clear()
            common = dict(max_model_len=2048, max_num_seqs=slots)
            built[slots] = (LLM(args.model, **common),
                            LLM(args.model, speculative_config=config, **common),
                            LLM(args.model, **common) if args.control else None)
        return built[slots]

    print(f"model {args.model}, speculative_config {config}, {args.rounds} rounds; tok/s = "
          "generated tokens per second (median), ratio = speculative / plain per round" +
          (f"; {args.waves} requests per slot, max_num_seqs = concurrency" if args.waves > 1
           else ""))
    print("| workload | concurrency | T | plain tok/s | spec tok/s | ratio | spread | "
          "acceptance | mean accepted length |" + (" plain / plain (spread) |"
                                                   if args.control else ""))
    print("| --- " * (10 if args.control else 9) + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        base, spec, control = engines(batch if args.waves > 1 and batch > 1 else 64)
        for workload in args.workloads.split(","):
            n = args.serial if batch == 1 else batch * args.waves
            chats = grounded_requests(n) if workload == "grounded" else chat_requests(n)
            if workload == "agentic":  # an agent loop's next tool call, new tasks each round
                chats = (lambda r, n=n: agentic_requests(n, seed=r))
            for t in (float(x) for x in args.temperatures.split(",")):
                params = SamplingParams(temperature=t, max_tokens=args.tokens, seed=None)
                row = compare(base, spec, chats, params, batch, args.rounds, control)
                print(f"| {workload} | {batch} | {t:g} | {row} |", flush=True)

if __name__ == "__main__":
    main()
