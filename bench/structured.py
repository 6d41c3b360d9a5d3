"""Structured outputs: what a JSON-schema constraint costs the engine, on the default model, with
each grammar backend (xgrammar and guidance = llguidance; the requests name theirs, so one engine
serves both and their figures come from the same run).

    python bench/structured.py [--num-requests 64] [--max-tokens 32] [--backends xgrammar,guidance]

Prints (and writes to bench/results/structured.json): throughput of one batch of chat requests
with 0 %, 50 % and 100 % of them under a JSON schema (0 % is the unconstrained baseline; every
request makes exactly --max-tokens tokens, `ignore_eos`, so the batches do the same work and only
the grammar's cost differs: a row whose JSON is complete takes EOS and runs on unconstrained);
how many constrained answers validate when they may stop (a separate batch); the
per-step cost of the grammar mask for a full batch of constrained rows (filling the bitmask and
applying it to the logits); the compile time of a schema, cold (the backend's first: its
vocabulary table too), new (a schema not seen before) and cached, and the time to first token of
one request including its compile, cold, new schema and cached.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.engine.config import DEFAULT_MODEL

QUESTIONS = ["Describe a person who lives in {}.", "Invent a character from {}.",
             "Give a short profile of someone from {}."]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Hanoi"]


def schema(tag: str = "person") -> dict:
    return {"title": tag, "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                    "maxItems": 3}},
        "required": ["name", "age", "city", "hobbies"]}


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % 3].format(CITIES[i % 8])}]
            for i in range(n)]


def constraint(backend: str, tag: str = "person") -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema(tag), backend=backend)


def run_batch(llm: LLM, n: int, fraction: float, max_tokens: int, backend: str) -> dict:
    every = {0.0: 0, 0.5: 2, 1.0: 1}[fraction]  # every k-th request is constrained
    params = [SamplingParams(temperature=0.2, top_p=0.9, seed=i, max_tokens=max_tokens,
                             ignore_eos=True, structured_outputs=constraint(backend)
                             if every and i % every == 0 else None) for i in range(n)]
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.chat(prompts(n), params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # CPU seconds (all of this process's threads) move far less than wall time when other
    # tenants share the cores; both are kept.
    return {"backend": backend if every else "-", "fraction": fraction,
            "constrained": sum(p.constraint is not None for p in params),
            "tokens": tokens, "seconds": wall, "cpu_seconds": cpu, "tok_per_s": tokens / wall,
            "tok_per_cpu_s": tokens / cpu}


def validity(llm: LLM, n: int, max_tokens: int, backend: str) -> dict:
    """Constrained answers that may stop: how many finish, and how many of those validate."""
    import jsonschema

    params = SamplingParams(temperature=0.2, top_p=0.9, seed=0, max_tokens=max_tokens,
                            structured_outputs=constraint(backend))
    outs = [o.outputs[0] for o in llm.chat(prompts(n), params, use_tqdm=False)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    valid = 0
    for o in finished:
        try:
            jsonschema.validate(json.loads(o.text), schema())
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"requests": n, "finished": len(finished), "valid": valid,
            "example": finished[0].text if finished else None}


def mask_cost(llm: LLM, rows: int, backend: str, reps: int = 20) -> dict:
    """ms per step for `rows` constrained rows: bitmask fill, then apply to [rows, vocab]."""
    from kvserve.engine.structured_output.grammar import apply_token_bitmask

    engine = llm.llm_engine
    compiled = engine.grammars.compile(constraint(backend))
    states = [engine.grammars.matcher(compiled) for _ in range(rows)]
    prefix = engine.tokenizer.encode('{"name": "A', add_special_tokens=False)
    for s in states:
        s.sync(prefix)  # inside a string: the widest mask, the costliest to fill
    logits = torch.randn(rows, engine.vocab_size)
    fill, apply = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        row_ids, bitmask = engine.grammars.token_bitmask(states)  # type: ignore[misc]
        t1 = time.perf_counter()
        apply_token_bitmask(logits, row_ids, bitmask)
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return {"rows": rows, "fill_ms": med(fill), "apply_ms": med(apply)}


def compile_ms(llm: LLM, backend: str, tag: str) -> float:
    """Milliseconds of one compile plus one matcher (what a request costs before its first
    step: guidance builds its parser in the matcher, xgrammar in the compile)."""
    grammars = llm.llm_engine.grammars
    start = time.perf_counter()
    grammars.matcher(grammars.compile(constraint(backend, tag)))
    return (time.perf_counter() - start) * 1e3


def ttft(llm: LLM, tag: str, backend: str) -> float:
    """Seconds from add_request (which compiles) to the first sampled token, alone."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2,
                            structured_outputs=constraint(backend, tag))
    start = time.perf_counter()
    engine.add_request(f"ttft-{backend}-{tag}-{start}", "Describe a person.", params)
    while True:
        outs = engine.step()
        if any(o.outputs[0].token_ids for o in outs):
            elapsed = time.perf_counter() - start
            break
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def per_backend(llm: LLM, backend: str) -> dict:
    """Compile and TTFT figures of one backend; the first call builds its vocabulary table."""
    out: dict = {"compile_cold_ms": compile_ms(llm, backend, "cold")}
    out["compile_new_ms"] = min(compile_ms(llm, backend, f"c{i}") for i in range(5))
    out["compile_cached_ms"] = min(compile_ms(llm, backend, "c0") for _ in range(5))
    out["ttft_new_schema_s"] = min(ttft(llm, f"new{i}", backend) for i in range(3))
    out["ttft_cached_s"] = min(ttft(llm, "new0", backend) for _ in range(3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--backends", default="xgrammar,guidance",
                    help="comma-separated structured-output backends to measure")
    ap.add_argument("--repeats", type=int, default=2,
                    help="rounds of the batches, interleaved; the best round of each counts "
                         "(a shared 2-core machine slows runs at random)")
    ap.add_argument("--skip-validity", action="store_true")
    ap.add_argument("--out", default="bench/results/structured.json")
    args = ap.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    n = args.num_requests
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=n)
    llm.chat(prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    result: dict = {"model": args.model, "num_requests": n, "max_tokens": args.max_tokens,
                    "backends": {b: per_backend(llm, b) for b in backends}}
    plan = [(0.0, "-")] + [(f, b) for b in backends for f in (0.5, 1.0)]
    rounds = [[run_batch(llm, n, f, args.max_tokens, b) for f, b in plan]
              for _ in range(args.repeats)]
    result["rounds"] = rounds
    result["batches"] = [max(runs, key=lambda b: b["tok_per_cpu_s"]) for runs in zip(*rounds)]
    for b in backends:
        result["backends"][b]["mask"] = mask_cost(llm, n, b)
        if not args.skip_validity:
            result["backends"][b]["validity"] = validity(llm, n, 256, b)
    report(result, n)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


def report(result: dict, n: int) -> None:
    base = result["batches"][0]
    for b in result["batches"]:
        print(f"{b['backend']:>9} {b['constrained']:3d}/{n} constrained: "
              f"{b['tok_per_cpu_s']:7.1f} tok per CPU-s "
              f"({b['tok_per_cpu_s'] / base['tok_per_cpu_s']:.2f}x of unconstrained), wall "
              f"{b['tok_per_s']:.1f} tok/s ({b['tok_per_s'] / base['tok_per_s']:.2f}x)")
    for name, r in result["backends"].items():
        m = r["mask"]
        print(f"{name}: compile+matcher cold {r['compile_cold_ms']:.0f} ms, new schema "
              f"{r['compile_new_ms']:.1f} ms, cached {r['compile_cached_ms']:.2f} ms; TTFT new "
              f"{r['ttft_new_schema_s'] * 1e3:.0f} ms, cached {r['ttft_cached_s'] * 1e3:.0f} ms; "
              f"mask per step ({m['rows']} rows) fill {m['fill_ms']:.2f} ms, apply "
              f"{m['apply_ms']:.2f} ms")
        v = r.get("validity")
        if v:
            print(f"  validity: {v['finished']}/{v['requests']} finished within 256 tokens, "
                  f"{v['valid']}/{v['finished']} valid; e.g. {v['example']}")


if __name__ == "__main__":
    main()
