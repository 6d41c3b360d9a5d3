"""vLLM's offline `LLM.generate` as a peer worker, run under the vLLM venv's Python by
bench/peers/vllm_peer.py: loads the model once, then runs the whole batch each time it reads
`run` on stdin and answers one `RESULT {json}` line (vLLM's own log lines go to stdout too).

    .venv-vllm/bin/python bench/peers/vllm_offline.py --model DIR --prompts prompts.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

MARK = "PEER "  # lines the driver reads; everything else is vLLM's log


def say(kind: str, payload: dict[str, Any]) -> None:
    print(f"{MARK}{kind} {json.dumps(payload)}", flush=True)


def run_batch(llm: Any, prompts: list[dict[str, list[int]]], params: Any) -> dict[str, Any]:
    """One timed pass over the batch from an empty prefix cache, as kvserve's side is run."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"seconds": seconds, "tokens": sum(map(len, tokens)), "outputs": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompt token-id lists")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in json.loads(Path(args.prompts).read_text())]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    say("READY", {"vllm": vllm.__version__, "torch": torch.__version__})
    for line in sys.stdin:
        if line.strip() == "run":
            say("RESULT", run_batch(llm, prompts, params))


if __name__ == "__main__":  # vLLM spawns its engine core: building LLM must sit under this guard
    main()
