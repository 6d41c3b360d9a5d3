"""The simulated replica's timing model: how long a step of continuous batching takes, and how
many KV blocks a replica has. Two calibrations, selectable by name (`CALIBRATIONS`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.engine.defaults import BLOCK_SIZE, MAX_NUM_SEQS
from kvserve.engine.sizing.memory import activation_peak_bytes, bytes_per_block, plan_memory


@dataclass(frozen=True)
class TimingModel:
    """One step costs `decode_step_s` (weights read once) + `decode_s_per_seq` per decoding
    sequence + `decode_s_per_ctx_token` per token of context those sequences attend to +
    `prefill_s_per_token` per prompt token computed (cache hits cost nothing)."""

    name: str
    prefill_s_per_token: float
    decode_step_s: float
    decode_s_per_seq: float
    decode_s_per_ctx_token: float
    num_blocks: int
    block_size: int = BLOCK_SIZE
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int = 8192  # prefill tokens per step (chunked prefill's budget)
    source: str = ""
    # The CPU swap pool (the engine's swap_space) and one block's copy, one way: a preempted
    # sequence is swapped out and back when the pool has room and ("auto") copying beats
    # recomputing its tokens, as the engine's SwapCostModel decides. 0 blocks: recompute only.
    num_cpu_blocks: int = 0
    swap_s_per_block: float = 0.0

    def __post_init__(self) -> None:
        for f in ("prefill_s_per_token", "decode_step_s", "decode_s_per_seq",
                  "decode_s_per_ctx_token", "swap_s_per_block", "num_cpu_blocks"):
            if getattr(self, f) < 0:
                raise ValueError(f"TimingModel.{f} must be >= 0, got {getattr(self, f)}")
        for f in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"TimingModel.{f} must be >= 1, got {getattr(self, f)}")

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """Seconds of one step computing `prefill_tokens` prompt tokens and one token for each of
        `decode_seqs` sequences whose contexts hold `context_tokens` in all."""
        if prefill_tokens <= 0 and decode_seqs <= 0:
            return 0.0
        return (self.decode_step_s + prefill_tokens * self.prefill_s_per_token
                + decode_seqs * self.decode_s_per_seq
                + context_tokens * self.decode_s_per_ctx_token)

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        """The engine's "auto" choice (engine/kv_offload/swap_cost.py) on this model's rates:
        copying the blocks out and back beats recomputing the tokens; with no recompute cost
        known (prefill_s_per_token 0) it swaps, as the engine does before it has measured one."""
        recompute = num_tokens * self.prefill_s_per_token
        return recompute == 0 or 2 * num_blocks * self.swap_s_per_block < recompute

    def scaled(self, time_scale: float = 1.0, num_blocks: int | None = None) -> TimingModel:
        """Every duration x `time_scale` (a slower fleet, so 2 cores can saturate it), and an
        optional other KV capacity."""
        if not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        return replace(self, prefill_s_per_token=self.prefill_s_per_token * time_scale,
                       decode_step_s=self.decode_step_s * time_scale,
                       decode_s_per_seq=self.decode_s_per_seq * time_scale,
                       decode_s_per_ctx_token=self.decode_s_per_ctx_token * time_scale,
                       swap_s_per_block=self.swap_s_per_block * time_scale,
                       num_blocks=num_blocks or self.num_blocks)


def _h100_llama3_8b() -> TimingModel:
    """Roofline of Llama-3.1-8B (8.03 B parameters, 32 layers, 8 KV heads x 128, bf16) on one
    H100 SXM from NVIDIA's datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB), at the
    efficiencies our H200 run measured (docs/perf.md: paged decode attention at 86-94% of HBM
    peak) and 50% model-FLOP utilisation for prefill, a figure vLLM and SGLang reach at long
    prompts. KV capacity from engine/sizing/memory.py's formula, as the operator sizes a replica."""
    params, flops, hbm = 8.03e9, 989e12, 3.35e12
    weight_bytes = int(2 * params)
    kv_token = bytes_per_block(32, 8, 128, 2, 1)  # 128 KiB a token
    act = activation_peak_bytes(4096, 14336, 128256, 32, 128, 8192, 256, 2)
    budget = plan_memory(total_bytes=80 * 10**9, gpu_memory_utilization=0.9,
                         weight_bytes=weight_bytes, activation_peak=act, num_layers=32,
                         num_kv_heads=8, head_dim=128, kv_dtype_bytes=2, block_size=16,
                         tokens_per_request=8192)
    return TimingModel(
        name="h100-llama3-8b",
        prefill_s_per_token=2 * params / (0.5 * flops),  # ~32 us a token, ~31k tok/s
        decode_step_s=weight_bytes / (0.8 * hbm),  # every weight read once a step: ~6 ms
        decode_s_per_seq=2 * params / (0.5 * flops),  # the step's GEMMs grow with the batch
        decode_s_per_ctx_token=kv_token / (0.86 * hbm),  # ~46 ns a context token
        num_blocks=budget.num_blocks,
        source="roofline: NVIDIA H100 SXM datasheet, Llama-3.1-8B shape, efficiencies as "
               "measured on our H200 (docs/perf.md)")


# Measured on this project's 2-core SPR machine (Intel Sapphire Rapids, AMX, bf16), 2026-12-06,
# code 8519e95, by `python bench/sim_calibrate.py` with one niced job beside it (load 1.0-1.5),
# three runs; the two that agree (the third's 1,024-token prefill took 445 ms) are averaged:
# prefill 256 / 1,024 tokens 101.0 / 290.7 ms (the slope: 0.248 ms a token, fresh prefills now
# through SDPA; the 2026-12-04 calibration, at load ~2 with the paged prefill, had 1.54 ms);
# decode batch 1 x 64 context 31.5 ms, batch 8 x 64 42.0 ms, batch 8 x 512 35.9 ms. The last
# is faster than 8 x 64 in every run, so the context cost fits to 0 (below the noise of a step)
# and the model predicts 42.0 ms there.
# KV blocks: the engine's CPU default for SmolLM2-135M-Instruct there.
_CPU_SMOLLM2 = TimingModel(
    name="cpu-smollm2", prefill_s_per_token=2.48e-4, decode_step_s=2.99e-2,
    decode_s_per_seq=1.51e-3, decode_s_per_ctx_token=0.0, num_blocks=11650, max_num_seqs=256,
    max_num_batched_tokens=2048,
    source="bench/sim_calibrate.py on SPR, 2 cores, SmolLM2-135M-Instruct bf16")

CALIBRATIONS: dict[str, TimingModel] = {m.name: m for m in (_CPU_SMOLLM2, _h100_llama3_8b())}


def timing_model(name: str) -> TimingModel:
    """A calibration by name; ValueError naming the choices otherwise."""
    try:
        return CALIBRATIONS[name]
    except KeyError:
        raise ValueError(f"unknown timing model {name!r}; choose one of "
                         f"{sorted(CALIBRATIONS)}") from None
