"""Tensor parallelism at N = 1 and N ranks: per step, the time rank 0 spends in the collectives
(all-reduces + the logits gather, waiting for the other ranks included) against the rest, the
bytes moved per token, and throughput; then the arithmetic for when TP pays on GPUs.

    python bench/tensor_parallel.py                         # default model, N = 1 and 3, CPU
    python bench/tensor_parallel.py --random-weights --device cuda --tp 1 2 4 8
    python bench/tensor_parallel.py --smoke                 # tiny random model, N = 1 and 2

--random-weights builds a Llama of the default model's shape with random weights (no download:
GPU machines here reach no network). Greedy decoding, the same prompts at every N; the token ids
of each N are compared with N = 1's (random weights in bf16 may differ by rounding).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)


def random_model(shape: dict, folder: Path) -> Path:
    """A random-weight Llama of `shape` with a small byte-level tokenizer, saved as HF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["tensor parallel ranks share the work of one model"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, eos_token_id=0, bos_token_id=0, initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


class Timed:
    """Wraps rank 0's collectives with wall-clock timers (synchronising CUDA around them)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def install(self) -> None:
        from kvserve.engine.distributed import TPGroup

        for name in ("all_reduce", "gather_logits"):
            setattr(TPGroup, name, self._wrap(getattr(TPGroup, name)))

    def _wrap(self, fn):
        def timed(group, *args):
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t = time.perf_counter()
            out = fn(group, *args)
            sync()
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out
        return timed


def run(model: str, tp: int, args: argparse.Namespace, timer: Timed) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tp, dtype=args.dtype, device=args.device,
              max_model_len=512, **({"kv_cache_memory": 1 << 28} if args.device == "cpu" else {}))
    engine = llm.llm_engine
    try:
        prompts = [[(7 * i + 3 * j) % 250 + 20 for j in range(args.prompt_len)]
                   for i in range(args.prompts)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        tokens(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        timer.seconds, timer.calls = 0.0, 0
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        steps, outs = [], {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
            steps.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    new = args.prompts * args.max_tokens
    return {"tp": tp, "wall_s": wall, "steps": len(steps), "step_ms_median":
            1e3 * statistics.median(steps), "collective_s": timer.seconds,
            "collective_calls": timer.calls, "collective_share": timer.seconds / wall,
            "tok_per_s": new / wall, "tokens": [outs[f"r{i}"] for i in range(args.prompts)]}


def tokens(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def bytes_per_token(shape: dict, tp: int, act_bytes: int) -> tuple[int, float]:
    """(all-reduce payload per token, ring traffic per rank per token): 2 all-reduces a layer
    (after o_proj and down_proj) + 1 for the vocab-parallel embedding, of hidden x dtype each."""
    payload = (2 * shape["num_hidden_layers"] + 1) * shape["hidden_size"] * act_bytes
    return payload, payload * 2 * (tp - 1) / tp if tp > 1 else 0.0


def gpu_arithmetic(shape: dict, tp: int) -> str:
    """When decode TP pays on GPUs: the weight-read time saved per step against the collective
    latency added per step (small all-reduces are latency bound)."""
    params = (shape["num_hidden_layers"] * (4 * shape["hidden_size"] ** 2 // 1 + 3 *
              shape["hidden_size"] * shape["intermediate_size"]) + shape["vocab_size"] *
              shape["hidden_size"])
    weights = 2 * params  # bf16
    hbm, lat_us = 4.8e12, 12.0  # H200 HBM3e bytes/s; an NVLink NCCL all-reduce of a few KiB
    read_us = weights / hbm * 1e6
    saved = read_us * (1 - 1 / tp)
    added = (2 * shape["num_hidden_layers"] + 1) * lat_us
    return (f"GPU decode step at N={tp}: bf16 weights {weights / 1e9:.2f} GB read in {read_us:.0f} "
            f"us on one H200 ({hbm / 1e12:.1f} TB/s); N ranks save {saved:.0f} us and add "
            f"{2 * shape['num_hidden_layers'] + 1} all-reduces x ~{lat_us:.0f} us = {added:.0f} "
            f"us -> TP {'pays' if saved > added else 'does not pay'} for this shape (it pays "
            f"once weights / HBM bandwidth exceeds ~{added / (1 - 1 / tp) * hbm / 1e15:.2f} GB, "
            f"or when the model does not fit one GPU)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, N = 1 and 2")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    shape, model = DEFAULT_SHAPE, args.model
    if args.smoke:
        shape, args.tp, args.prompts, args.max_tokens = TINY_SHAPE, [1, 2], 4, 8
    if args.smoke or args.random_weights:
        model = str(random_model(shape, Path(tempfile.mkdtemp(prefix="kvserve-tp-bench-"))))
    timer = Timed()
    timer.install()
    act = 2 if args.dtype in ("bfloat16", "float16") else 4
    results = [run(model, tp, args, timer) for tp in args.tp]
    base = results[0]
    print(f"{'N':>2} {'tok/s':>8} {'step ms':>8} {'coll. share':>11} {'calls':>6} "
          f"{'payload B/tok':>13} {'ring B/tok/rank':>15} same-as-N1")
    for r in results:
        payload, ring = bytes_per_token(shape, r["tp"], act)
        same = r["tokens"] == base["tokens"]
        print(f"{r['tp']:>2} {r['tok_per_s']:>8.1f} {r['step_ms_median']:>8.1f} "
              f"{r['collective_share']:>10.1%} {r['collective_calls']:>6} {payload:>13} "
              f"{ring:>15.0f} {same}")
    for tp in sorted({max(args.tp), 2, 4, 8} - {1}):
        print(gpu_arithmetic(shape, tp))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "tokens"}
                                         for r in results], indent=1))


if __name__ == "__main__":
    main()
