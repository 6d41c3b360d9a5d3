"""Two models whose loads peak at different times (alternating bursts) on ONE shared KV pool vs
TWO separate pools of the same total size, in the same run (engine/multi_model.py):

- peak KV pages needed to serve the bursts without preemption: the shared pool needs the peak of
  the SUM of the pages both models hold; separate pools need the SUM of each model's own peak
  (measured in one unbounded run, the same steps);
- at a total size below that sum: requests finished without ever being preempted, preemptions,
  and generated tokens per second, shared vs separate, over several rounds (median and spread).

    python bench/shared_pool.py [--rounds 3] [--phases 6] [--burst 12] [--trickle 2]
                                [--prompt 96] [--tokens 48] [--mixed]

The two models are tiny random Llamas (hidden 256, 4 layers, 4 KV heads x 64) with different
weights: the same KV block, so the figures isolate pooling. `--mixed` gives the second model
1 layer instead of 4 (a quarter of the KV block): a page holds one block of the largest layout,
so 3/4 of each of its pages stay empty (docs/perf/multi-model.md)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve import SamplingParams
from kvserve.engine.multi_model import MultiModelLLM


def build_model(folder: Path, seed: int, layers: int, kv_heads: int) -> Path:
    """A random Llama with the tiny test tokenizer (tests/conftest.py's, rebuilt here)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import build_tiny_llama

    return build_tiny_llama(folder, seed=seed, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=kv_heads, max_position_embeddings=1024)


@dataclass
class Run:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time: steadier than wall time on shared cores
    tokens: int = 0
    requests: int = 0
    preempted: set = field(default_factory=set)
    preemptions: int = 0
    peak_sum: int = 0  # max over steps of the pages both models hold
    peak_each: dict = field(default_factory=dict)  # each model's own max


def workload(args: argparse.Namespace, phase: int, model: str) -> int:
    """Requests `model` gets at the start of `phase`: the burst on its turn, a trickle else."""
    on_turn = (phase % 2 == 0) == (model == "a")
    return args.burst if on_turn else args.trickle


def run(args: argparse.Namespace, llms: dict[str, MultiModelLLM], prompt_base: int) -> Run:
    """Drive the alternating bursts; `llms` maps model -> the MultiModelLLM serving it (one
    shared, or one per model)."""
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    out, sets = Run(), {id(m): m.models for m in llms.values()}
    engines = {name: llm.models.engines[name] for name, llm in llms.items()}
    for name, engine in engines.items():  # record who gets preempted (the bench's only hook)
        sched = engine.scheduler
        orig = sched._preempt

        def spy(seq, o, _orig=orig, _name=name):
            out.preempted.add((_name, seq.request_id))
            _orig(seq, o)
        sched._preempt = spy
    start, cpu, rid = time.perf_counter(), time.process_time(), 0
    for phase in range(args.phases):
        for name, engine in engines.items():
            for _ in range(workload(args, phase, name)):
                rid += 1
                prompt = [prompt_base + rid % 50 + 3] * 8 + [(rid * 7 + k) % 300 + 3
                                                           for k in range(args.prompt - 8)]
                engine.add_request(f"{name}-{rid}", prompt, params)
                out.requests += 1
        for _ in range(args.phase_steps):
            for ms in sets.values():
                for outs in ms.step().values():
                    out.tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
            held = {n: e.kv.num_held_blocks() for n, e in engines.items()}
            out.peak_sum = max(out.peak_sum, sum(held.values()))
            for n, h in held.items():
                out.peak_each[n] = max(out.peak_each.get(n, 0), h)
    while any(ms.has_unfinished_requests() for ms in sets.values()):
        for ms in sets.values():
            for outs in ms.step().values():
                out.tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    out.seconds = time.perf_counter() - start
    out.cpu_seconds = time.process_time() - cpu
    out.preemptions = sum(e.scheduler.num_preemptions for e in engines.values())
    return out


def make(paths: dict[str, Path], total_bytes: int, blocks: dict[str, int] | None,
         shared: bool) -> dict[str, MultiModelLLM]:
    """One pool of `total_bytes` (pages of the largest block), or two of half each, each in
    pages of its own model's block (`blocks`: bytes per block by model)."""
    kw = dict(dtype="float32", device="cpu", enable_prefix_caching=False, max_num_seqs=64,
              kv_cache_memory=1 << 24)  # the pools are sized by num_pages, not by this
    if shared:
        page = max(blocks.values()) if blocks else PAGE_GUESS
        llm = MultiModelLLM({n: str(p) for n, p in paths.items()},
                            num_pages=total_bytes // page, **kw)
        return {n: llm for n in paths}
    return {n: MultiModelLLM({n: str(p)}, num_pages=total_bytes // 2 // blocks[n], **kw)
            for n, p in paths.items()}


PAGE_GUESS = 2 * 4 * 16 * 4 * 64 * 4  # the first model's fp32 block (4 layers x 4 x 64)


def close(llms: dict[str, MultiModelLLM]) -> None:
    for llm in {id(v): v for v in llms.values()}.values():
        llm.shutdown()


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phases", type=int, default=6)
    ap.add_argument("--phase-steps", type=int, default=None,
                    help="engine steps per phase (default: --tokens + 8, a burst's life)")
    ap.add_argument("--burst", type=int, default=12)
    ap.add_argument("--trickle", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--fraction", type=float, default=0.6,
                    help="total pool size as a fraction of the separate pools' no-preemption need")
    ap.add_argument("--mixed", action="store_true",
                    help="the second model with a quarter of the first one's KV block")
    args = ap.parse_args()
    if args.phase_steps is None:  # long enough for a burst to finish inside its phase
        args.phase_steps = args.tokens + 8
    tmp = Path(tempfile.mkdtemp(prefix="shared-pool-"))
    paths = {"a": build_model(tmp / "a", 0, 4, 4),
             "b": build_model(tmp / "b", 1, 1 if args.mixed else 4, 4)}
    # 1. Unbounded (512 pages): what each arrangement needs with no preemption. The steps are
    # deterministic (greedy, fixed lengths, phases counted in steps): one run says it.
    llms = make(paths, 512 * PAGE_GUESS, None, shared=True)
    blocks = {n: llm.models.engines[n].memory_budget.bytes_per_block for n, llm in llms.items()}
    page = llms["a"].models.shared.pool.page_bytes
    free = run(args, llms, 0)
    close(llms)
    need_shared = free.peak_sum * page
    own = sum(free.peak_each[n] * blocks[n] for n in blocks)  # pools sized to each peak
    equal = 2 * max(free.peak_each[n] * blocks[n] for n in blocks)  # two equal halves
    mib = 1 / (1 << 20)
    print(f"blocks: {', '.join(f'{n} {b} B' for n, b in blocks.items())}; page {page} B")
    print(f"peak pages held: both together {free.peak_sum}, "
          f"{', '.join(f'{n} alone {p}' for n, p in free.peak_each.items())}")
    print(f"KV memory to serve the bursts without preemption: shared {need_shared * mib:.2f} "
          f"MiB, separate {own * mib:.2f} MiB (each sized to its peak) / {equal * mib:.2f} MiB "
          f"(two equal pools); shared / separate = {need_shared / own:.2f} / "
          f"{need_shared / equal:.2f}")
    # 2. Both at one total size below the separate pools' need.
    total = int(own * args.fraction)
    rows: dict[str, list[Run]] = {"shared": [], "separate": []}
    for r in range(args.rounds):
        for mode in (("shared", "separate") if r % 2 == 0 else ("separate", "shared")):
            llms = make(paths, total, blocks, shared=mode == "shared")
            rows[mode].append(run(args, llms, 100 * (r + 1)))
            close(llms)
    print(f"total KV {total * mib:.2f} MiB ({args.fraction:.0%} of the separate pools' need), "
          f"{args.rounds} rounds, median [min-max]:")
    for mode, runs in rows.items():
        clean = [1 - len(x.preempted) / x.requests for x in runs]
        print(f"  {mode:8s} requests never preempted {spread([100 * c for c in clean])} %, "
              f"preemptions {spread([x.preemptions for x in runs])}, "
              f"tok/s {spread([x.tokens / x.seconds for x in runs])}, "
              f"tok per CPU-s {spread([x.tokens / x.cpu_seconds for x in runs])}")
    for label, attr in (("wall", "seconds"), ("CPU", "cpu_seconds")):
        ratio = [s.tokens / getattr(s, attr) / (p.tokens / getattr(p, attr))
                 for s, p in zip(rows["shared"], rows["separate"])]
        print(f"  throughput shared / separate ({label} time): {spread(ratio)}")


if __name__ == "__main__":
    main()
