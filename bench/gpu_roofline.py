"""The body of bench/gpu_roofline.sh: decode and prefill of kvserve's ModelRunner against the
device's measured bandwidth and GEMM peak, eager vs CUDA graphs, HF generate as the peer."""

from __future__ import annotations

import gc
import os
import time

import torch
from transformers import LlamaConfig

from kvserve.engine.models.llama import LlamaForCausalLM
from kvserve.engine.worker.model_runner import BlockMoves, ModelRunner, StepInput

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


def sync() -> None:
    if DEV.type == "cuda":
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


def bench_engine(config: LlamaConfig, bw: float, flops: float) -> None:
    width = -(-(CONTEXT + 1) // BS)
    runner, weight_bytes = build_runner(config, max(BATCHES) * width + 1)
    print(f"weights {weight_bytes / 1e9:.2f} GB, KV block {BS} tokens")
    results, check = {}, decode_step(max(BATCHES), CONTEXT)
    for mode in ("eager", "graphs"):
        if mode == "graphs":
            capture = (lambda fn: fn) if SMOKE else None  # the CPU has no CUDA graphs
            runner.capture_decode_graphs(max(BATCHES), CONTEXT + BS, capture=capture)
            err = (runner.run_step(check)[0].float() - want).abs().max().item()
            print(f"graphs vs eager logits, batch {max(BATCHES)}: max err {err:.3g}")
        else:
            want = runner.run_step(check)[0].float()
        for b in BATCHES:
            step = decode_step(b, CONTEXT)
            sec = timed(lambda: runner.run_step(step))
            roof = (weight_bytes + kv_bytes(config, b * (CONTEXT + 1))) / bw
            results[mode, b] = sec
            print(f"decode {mode:6} batch {b:4} ctx {CONTEXT}: {b / sec:10.1f} tok/s, "
                  f"{1e3 * sec:8.3f} ms/step, {roof / sec:6.1%} of the bandwidth roofline")
    for b in BATCHES:
        print(f"graphs vs eager, batch {b}: {results['eager', b] / results['graphs', b]:.2f}x")
    runner.graphs = None
    step = prefill_step(PREFILL)
    sec = timed(lambda: runner.run_step(step), max(1, REPS // 4))
    useful = 2 * (weight_bytes // (torch.finfo(DTYPE).bits // 8)) * PREFILL
    print(f"prefill {PREFILL} tokens: {PREFILL / sec:10.1f} tok/s, "
          f"{useful / sec / flops:6.1%} of the bf16 GEMM peak (weights' FLOPs only)")
    del runner
    gc.collect()


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


def main() -> None:
    config = LlamaConfig(**(TINY if SMOKE else LLAMA_8B))
    bw, flops = device_peaks()
    name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"device {name}: copy {bw / 1e9:.1f} GB/s, matmul {flops / 1e12:.1f} TFLOP/s")
    with torch.inference_mode():
        bench_engine(config, bw, flops)
        bench_hf(config)


if __name__ == "__main__":
    main()
