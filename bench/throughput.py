"""Engine throughput on the default model (or any model folder) vs HF transformers static
batching, same run.

64 chat requests sharing a ~200-token system prompt, 64 new tokens each (greedy, ignore_eos),
in fp32 and bf16: kvserve output tok/s vs HF `generate` (batch 32, left padding), the ratio,
KV slot utilisation (real tokens / allocated slots, sampled every step) next to a contiguous
cache reserving max_model_len per request, and a second run with output lengths drawn from
16..256 where static batching waits for its longest member. llama.cpp is no peer here: its
figure in docs/perf/engine.md is from another run (llama-cpp-python 0.3.36 segfaulted in its AMX
path, and it takes ~14 min to build on 2 cores).

    python bench/throughput.py [--requests 64] [--dtypes float32,bfloat16] [--skip-hf]
                               [--block-size 16] [--model default|gemma3-tiny|DIR | --tiny ARCH]
                               [--quantization int8,fp8,FOLDER] [--quant-dtype bfloat16]

--quantization adds runs of quantised weights after the dense ones, in the same process: int8
and fp8 quantise the model at load (`quantization=`), a folder is a quantised checkpoint
(bench/make_quantized.py writes one). Each prints tok/s against the first dense run, the
resident weight bytes (parameters and buffers: packed, quantised, scales, embedding), and greedy
agreement with the first dense run: requests with identical output, and the mean share of each
output before its first differing token. HF and the varied-length run are for dense runs only.

--model gemma3-tiny runs the same workload on a random-weight Gemma 3 built here from
transformers' Gemma3TextConfig with the default model's tokenizer (6 layers, 5 sliding over 128
tokens : 1 full, GeGLU, q/k norms): the families' layers against HF on one config. --model DIR
takes any HF model folder (or known name). --tiny ARCH builds a tiny random checkpoint of that
architecture (bench/tiny_models.py: Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM)
with the default model's tokenizer, once, and runs on it.

Per-sequence utilisation is bounded by the half-filled last block of each sequence: about
1 - (block_size / 2) / mean length (96.9% for block_size 16 and this workload's ~245 tokens);
--block-size 8 shows what smaller blocks buy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tiny_models import build_tiny  # bench/ is sys.path[0] when run as a script
from workload import chat_requests, output_lengths

from kvserve import LLM, SamplingParams
from kvserve.engine.worker.model_loader import fetch_model, resolve_model
from kvserve.paths import cache_root

MAX_MODEL_LEN = 2048
DEFAULT_MODEL = "smollm2-135m-instruct"


def build_gemma3_tiny(folder: Path) -> Path:
    """A random Gemma 3 (text) with the default model's tokenizer and chat template, built once."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(fetch_model(DEFAULT_MODEL))
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, sliding_window=128,
        max_position_embeddings=MAX_MODEL_LEN, query_pre_attn_scalar=64,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id or 0, architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_kvserve(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> dict:
    engine = llm.llm_engine
    stamp = time.monotonic_ns()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(f"b{stamp}-{i}", p,
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    util, seq_util, contiguous = [], [], []
    outputs: dict[int, list[int]] = {}
    q0, h0 = engine.get_stats().prefix_cache_queries, engine.get_stats().prefix_cache_hits
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                outputs[int(out.request_id.rpartition("-")[2])] = list(out.outputs[0].token_ids)
        s = engine.get_stats()
        if s.kv_slots_allocated:
            util.append(s.kv_slot_utilization)
            seq_util.append(s.kv_seq_slot_utilization)
            contiguous.append(s.kv_slots_used / (max(s.num_running, 1) * MAX_MODEL_LEN))
    dt = time.perf_counter() - t0
    s = engine.get_stats()
    hit = (s.prefix_cache_hits - h0) / max(s.prefix_cache_queries - q0, 1)
    return {"tok_s": tokens / dt, "seconds": dt, "tokens": tokens,
            "kv_util": statistics.mean(util), "kv_seq_util": statistics.mean(seq_util),
            "contiguous_util": statistics.mean(contiguous),
            "hit_rate": hit, "outputs": [outputs[i] for i in range(len(prompts))]}


def weight_bytes(model: torch.nn.Module) -> int:
    """Resident bytes of the model's parameters and buffers (each storage once), without the
    rotary tables: what the weights cost in memory as loaded (packed, quantised, scales)."""
    seen, total = set(), 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or "rotary" in name:
            continue
        try:
            key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # opaque oneDNN tensors
            key, size = id(t), t.numel() * t.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of identical outputs, mean share of each output before its first difference)."""
    same, prefix = 0, []
    for a, b in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        prefix.append(n / max(len(a), 1))
    return same / len(ref), statistics.mean(prefix)


def run_hf(model_dir: Path, dtype: torch.dtype, prompts: list[list[int]], lengths: list[int],
           batch: int = 32) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = model.generation_config.pad_token_id or 0
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        chunk, lens = prompts[i:i + batch], lengths[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                           min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
        useful += sum(lens)  # static batching runs every row to the longest; only these count
    dt = time.perf_counter() - t0
    return {"tok_s": useful / dt, "seconds": dt, "tokens": useful}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-varied", action="store_true")
    ap.add_argument("--block-size", type=int, default=16)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", default="default")
    which.add_argument("--tiny", metavar="ARCH")
    ap.add_argument("--quantization", default="",
                    help="comma list of int8, fp8 (online), gguf (the model folder's GGUF) or "
                         "quantised checkpoint folders")
    ap.add_argument("--quant-dtype", default="float32", help="activation dtype of those runs")
    args = ap.parse_args()

    model_dir, model = fetch_model(DEFAULT_MODEL), DEFAULT_MODEL
    if args.tiny:
        model_dir = build_tiny(args.tiny, cache_root() / "bench-models" / f"tiny-{args.tiny}",
                               model_dir)
        model = str(model_dir)
    elif args.model == "gemma3-tiny":
        model_dir = build_gemma3_tiny(cache_root() / "bench" / "gemma3-tiny")
        model = str(model_dir)
    elif args.model not in ("default", DEFAULT_MODEL):
        model_dir = resolve_model(args.model)
        model = str(model_dir)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {model}")
    runs = [(d, model, None) for d in args.dtypes.split(",") if d]
    for q in filter(None, args.quantization.split(",")):
        online = q in ("int8", "fp8", "gguf")  # gguf: the default model's own GGUF file
        runs.append((args.quant_dtype, model if online else q, q if online else None))
    baseline: dict | None = None
    for dtype_name, run_model, quantization in runs:
        dtype = getattr(torch, dtype_name)
        extra = {"quantization": quantization} if quantization else {}
        llm = LLM(run_model, dtype=dtype_name, device="cpu", max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=256, block_size=args.block_size, **extra)
        dense = run_model == model and not quantization
        label = dtype_name if dense else \
            f"{quantization or Path(run_model).name} ({dtype_name} activations)"
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True,
                                           return_dict=False) for c in chat_requests(args.requests)]
        prompts = [list(p) for p in prompts]
        print(f"\n== {label}: {len(prompts)} requests, "
              f"{sum(map(len, prompts))} prompt tokens, {args.new_tokens} new tokens each, "
              f"block_size {args.block_size}")
        run_kvserve(llm, prompts[:2], [4, 4])  # warm-up (also clears nothing from the cache)
        llm.llm_engine.reset_prefix_cache()
        fixed = [args.new_tokens] * len(prompts)
        ours = run_kvserve(llm, prompts, fixed)
        print(f"kvserve: {ours['tok_s']:.1f} tok/s ({ours['seconds']:.1f}s), prefix hit rate "
              f"{ours['hit_rate']:.1%}, KV slot utilisation {ours['kv_util']:.1%} physical "
              f"(shared blocks once), {ours['kv_seq_util']:.1%} per sequence, vs contiguous "
              f"{ours['contiguous_util']:.1%}")
        mib = weight_bytes(llm.llm_engine.runner.model) / 2**20
        if baseline is None:
            baseline = dict(ours, mib=mib, label=label)
            print(f"weights resident: {mib:.1f} MiB")
        else:
            same, prefix = agreement(baseline["outputs"], ours["outputs"])
            print(f"vs {baseline['label']}: {ours['tok_s'] / baseline['tok_s']:.2f}x tok/s, "
                  f"weights {mib:.1f} MiB ({mib / baseline['mib']:.2f}x), greedy outputs "
                  f"identical {same:.0%}, mean agreeing prefix {prefix:.0%}")
        if not dense:
            del llm
            continue
        if not args.skip_hf:
            hf = run_hf(model_dir, dtype, prompts, fixed)
            print(f"HF static batch 32: {hf['tok_s']:.1f} tok/s ({hf['seconds']:.1f}s) -> "
                  f"kvserve/HF = {ours['tok_s'] / hf['tok_s']:.2f}x")
        if not args.skip_varied:
            lens = output_lengths(len(prompts), 16, 256, seed=1)
            llm.llm_engine.reset_prefix_cache()
            ours_v = run_kvserve(llm, prompts, lens)
            line = (f"varied 16..256: kvserve {ours_v['tok_s']:.1f} tok/s, KV utilisation "
                    f"{ours_v['kv_util']:.1%} physical, {ours_v['kv_seq_util']:.1%} per sequence, "
                    f"vs contiguous {ours_v['contiguous_util']:.1%}")
            if not args.skip_hf:
                hf_v = run_hf(model_dir, dtype, prompts, lens)
                line += (f"; HF static {hf_v['tok_s']:.1f} useful tok/s -> "
                         f"{ours_v['tok_s'] / hf_v['tok_s']:.2f}x")
            print(line)
        del llm


if __name__ == "__main__":
    main()
