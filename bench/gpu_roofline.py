"""The body of bench/gpu_roofline.sh: decode and prefill of kvserve's ModelRunner against the
device's measured bandwidth and GEMM peak, eager vs CUDA graphs, with the profiler's device-busy
share of each configuration; the default model's shape at batch 64 (the runner) and as a whole
engine run of 64 requests; HF generate as the peer."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.worker.model_runner import BlockMoves, ModelRunner, StepInput
from tensor_parallel import DEFAULT_SHAPE, random_model  # bench/ is sys.path[0]

SMOKE = os.environ.get("KV_BENCH_SMOKE") == "1"
DEV = torch.device("cpu" if SMOKE else "cuda")
DTYPE = torch.float32 if SMOKE else torch.bfloat16
BS = 16
CONTEXT = 20 if SMOKE else 1024
BATCHES = (1, 3) if SMOKE else (1, 32, 256)
PREFILL = 16 if SMOKE else 4096
REPS = 1 if SMOKE else 20
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            tie_word_embeddings=False)
# The default model's shape (SmolLM2-135M) at 64 requests: the runner's decode at batch 64, and an
# engine run (64 prompts of ENGINE_PROMPT tokens, ENGINE_NEW new tokens each).
DEFAULT_BATCH = 2 if SMOKE else 64
ENGINE_PROMPT, ENGINE_NEW = (8, 2) if SMOKE else (256, 128)
PROFILE_REPS = 1 if SMOKE else 5


def sync() -> None:
    if torch.cuda.is_available():  # bench/gpu_quant.py times with `timed` on either device
        torch.cuda.synchronize()


def timed(fn, reps: int = REPS) -> float:
    """Seconds per call, after one warm-up call."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def busy_share(fn, reps: int = PROFILE_REPS) -> float:
    """The profiler's device time over the wall time of `reps` calls of fn (already warm):
    how much of a run the GPU spends in kernels. CUDA activity only, so the host side is not
    slowed by recording each op (CUPTI still costs a little). On the CPU (--smoke): the CPU ops'
    self time over the wall, which only checks the code path."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if DEV.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    if DEV.type == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e6
    else:
        busy = sum(e.self_cpu_time_total for e in events) / 1e6
    return busy / wall


def device_peaks() -> tuple[float, float]:
    """(bytes/s of a device copy, read + write; bf16 matmul FLOP/s)."""
    n = (1 << 16) if SMOKE else (1 << 30)
    a, b = torch.empty(n, dtype=torch.uint8, device=DEV), torch.empty(n, dtype=torch.uint8,
                                                                        device=DEV)
    bw = 2 * n / timed(lambda: b.copy_(a))
    m = 64 if SMOKE else 8192
    x = torch.randn(m, m, dtype=DTYPE, device=DEV)
    flops = 2 * m ** 3 / timed(lambda: x @ x)
    return bw, flops


def build_runner(config: LlamaConfig, num_blocks: int) -> tuple[ModelRunner, int]:
    """kvserve's model with random weights made on the device, and its runner."""
    model = LlamaForCausalLM(config, DTYPE, DEV, max_model_len=CONTEXT + BS)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    runner = ModelRunner(model.eval(), num_layers=config.num_hidden_layers,
                         num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
                         num_blocks=num_blocks, block_size=BS, kv_dtype=DTYPE, device=DEV,
                         attention_backend="triton")
    return runner, weight_bytes


def decode_step(batch: int, context: int) -> StepInput:
    """`batch` sequences of `context` cached tokens, each decoding its next one."""
    width = -(-(context + 1) // BS)
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    pos = torch.full((batch,), context, dtype=torch.int64)
    slots = tables[:, context // BS].long() * BS + context % BS
    # one KV-cache group (every layer full attention): a leading group axis of 1
    return StepInput(torch.randint(0, 100, (batch,)), pos, slots[None], tables[None],
                     torch.full((batch,), context + 1, dtype=torch.int32),
                     torch.arange(batch + 1, dtype=torch.int32), 1, context + 1,
                     list(range(batch)), BlockMoves())


def prefill_step(n: int) -> StepInput:
    width = -(-n // BS)
    tables = torch.arange(width, dtype=torch.int32)[None]
    return StepInput(torch.randint(0, 100, (n,)), torch.arange(n), torch.arange(n)[None],
                     tables[None],
                     torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                     n, n, [0], BlockMoves())


def kv_bytes(config: LlamaConfig, tokens: int) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return (tokens * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
            * torch.finfo(DTYPE).bits // 8)


def bench_runner(config: LlamaConfig, bw: float, flops: float, batches=BATCHES,
                 prefill: int = PREFILL, label: str = "") -> None:
    """The runner's decode at `batches` (eager, then from CUDA graphs) and a prefill; rows
    prefixed with `label`."""
    width = -(-(CONTEXT + 1) // BS)
    runner, weight_bytes = build_runner(config, max(batches) * width + 1)
    print(f"weights {weight_bytes / 1e9:.2f} GB, KV block {BS} tokens")
    results, check = {}, decode_step(max(batches), CONTEXT)
    for mode in ("eager", "graphs"):
        if mode == "graphs":
            capture = (lambda fn: fn) if SMOKE else None  # the CPU has no CUDA graphs
            runner.capture_decode_graphs(max(batches), CONTEXT + BS, capture=capture)
            check.graph_size = runner.decode_graph_size(check)  # the driver's choice
            err = (runner.run_step(check)[0].float() - want).abs().max().item()
            print(f"{label}graphs vs eager logits, batch {max(batches)}: max err {err:.3g}")
        else:
            want = runner.run_step(check)[0].float()
        for b in batches:
            step = decode_step(b, CONTEXT)
            step.graph_size = runner.decode_graph_size(step)  # None while eager
            sec = timed(lambda: runner.run_step(step))
            roof = (weight_bytes + kv_bytes(config, b * (CONTEXT + 1))) / bw
            results[mode, b] = sec
            busy = busy_share(lambda: runner.run_step(step))
            print(f"{label}decode {mode:6} batch {b:4} ctx {CONTEXT}: {b / sec:10.1f} tok/s, "
                  f"{1e3 * sec:8.3f} ms/step, {roof / sec:6.1%} of the bandwidth roofline, "
                  f"busy {busy:6.1%}")
    for b in batches:
        print(f"{label}graphs vs eager, batch {b}: "
              f"{results['eager', b] / results['graphs', b]:.2f}x")
    runner.graphs = None
    step = prefill_step(prefill)
    sec = timed(lambda: runner.run_step(step), max(1, REPS // 4))
    busy = busy_share(lambda: runner.run_step(step), max(1, PROFILE_REPS // 2))
    useful = 2 * (weight_bytes // (torch.finfo(DTYPE).bits // 8)) * prefill
    print(f"{label}prefill {prefill} tokens: {prefill / sec:10.1f} tok/s, "
          f"{useful / sec / flops:6.1%} of the bf16 GEMM peak (weights' FLOPs only), "
          f"busy {busy:6.1%}")
    del runner
    gc.collect()
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


def bench_hf(config: LlamaConfig) -> None:
    """HF generate on the same shape and random weights, batch 1 and 32: the same-run peer."""
    from transformers import LlamaForCausalLM as HFLlama

    torch.set_default_dtype(DTYPE)
    with torch.device(DEV):
        hf = HFLlama(config).eval()
    torch.set_default_dtype(torch.float32)
    new = 4 if SMOKE else 64
    for b in (1, min(32, max(BATCHES))):
        ids = torch.randint(0, 100, (b, CONTEXT), device=DEV)

        def gen():
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                        pad_token_id=0)
        sec = timed(gen, 1 if SMOKE else 3)
        print(f"hf generate batch {b:4} ctx {CONTEXT}: {b * new / sec:10.1f} tok/s "
              f"(prefill included)")


def bench_engine_run(folder: Path, vocab: int) -> None:
    """The whole engine (scheduler, runner, sampler) on the default model's shape: DEFAULT_BATCH
    requests at once, greedy, eager and with CUDA graphs (each step read before the next is
    scheduled), then graphs with async scheduling (step N+1 launched while step N runs): output
    tok/s and the device-busy share of the run (the goal: >= 80%; 11% before the graphs and
    fused kernels), and async over sync in the same run."""
    import random

    from kvserve import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(20, min(vocab, 300))
                                     for _ in range(ENGINE_PROMPT)]}
               for _ in range(DEFAULT_BATCH)]
    params = SamplingParams(temperature=0, max_tokens=ENGINE_NEW, ignore_eos=True)
    rates: dict[str, float] = {}
    for eager, overlap in ((True, False), (False, False), (False, True)):
        extra = {"kv_cache_memory": 1 << 26} if SMOKE else {"gpu_memory_utilization": 0.5}
        llm = LLM(str(folder), dtype="float32" if SMOKE else "bfloat16", device=DEV.type,
                  max_model_len=ENGINE_PROMPT + ENGINE_NEW + BS, enable_prefix_caching=False,
                  max_num_seqs=DEFAULT_BATCH, enforce_eager=eager, attention_backend="triton",
                  async_scheduling=overlap, **extra)
        graphs = llm.llm_engine.runner.graphs is not None

        def run():
            llm.generate(prompts, params, use_tqdm=False)
        sec = timed(run, 1)
        busy = busy_share(run, 1)
        mode = "eager" if eager else "graphs" if graphs else "graphs (capture off: eager)"
        mode += ", async scheduling" if overlap else ""
        rates[mode] = DEFAULT_BATCH * ENGINE_NEW / sec
        print(f"engine default shape, {DEFAULT_BATCH} requests x {ENGINE_PROMPT} + {ENGINE_NEW}"
              f" tokens, {mode}: {DEFAULT_BATCH * ENGINE_NEW / sec:10.1f} output tok/s, "
              f"busy {busy:6.1%}")
        llm.shutdown()
        del llm
        gc.collect()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    modes = list(rates)
    print(f"engine default shape: async scheduling vs sync ({modes[1]}): "
          f"{rates[modes[2]] / rates[modes[1]]:.2f}x")


def main() -> None:
    config = LlamaConfig(**(TINY if SMOKE else LLAMA_8B))
    bw, flops = device_peaks()
    name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"device {name}: copy {bw / 1e9:.1f} GB/s, matmul {flops / 1e12:.1f} TFLOP/s")
    print("busy: the profiler's device (kernel) time / wall time of the same calls")
    default = dict(DEFAULT_SHAPE, **({k: TINY[k] for k in TINY} if SMOKE else {}))
    with torch.inference_mode():
        bench_runner(config, bw, flops)
        bench_runner(LlamaConfig(**default), bw, flops, (DEFAULT_BATCH,), PREFILL,
                     label="default shape: ")
    folder = random_model(default, Path(tempfile.mkdtemp(prefix="kvserve-roofline-")))
    bench_engine_run(folder, default["vocab_size"])
    with torch.inference_mode():
        bench_hf(config)


if __name__ == "__main__":
    main()
