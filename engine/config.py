"""EngineConfig: every engine knob in one frozen dataclass (vLLM's names), checked on creation."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvserve.engine.defaults import (BLOCK_SIZE, BLOCK_SIZES, GPU_MEMORY_UTILIZATION,
                                     MAX_LORA_RANK, MAX_NUM_SEQS, SWAP_SPACE_GIB)
from kvserve.engine.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "float32", "float16", "bfloat16")
MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")
PREEMPTION_MODES = ("auto", "recompute", "swap")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
# int8 | fp8 quantise a dense checkpoint at load; the others name a checkpoint's own format
QUANTIZATION_METHODS = ("int8", "fp8", "compressed-tensors", "gptq", "awq", "gguf")
LOAD_FORMATS = ("auto", "safetensors", "sharded_state")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    tensor_parallel_size: int = 1
    # Pipeline stages (engine/worker/pipeline.py): the layers split over P stages of N ranks
    # each, P x N ranks in all; VLLM_PP_LAYER_PARTITION (a comma list) overrides the split.
    pipeline_parallel_size: int = 1
    max_model_len: int | None = None  # None = the model's own context length
    max_num_seqs: int = MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None  # None = max(2048, max_model_len) capped by it
    enable_chunked_prefill: bool = True
    block_size: int = BLOCK_SIZE
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    kv_cache_memory: int | None = None  # CPU KV bytes, whole server (None = safe share of RAM)
    num_gpu_blocks_override: int | None = None
    swap_space: float = SWAP_SPACE_GIB  # GiB of CPU memory for swapped-out blocks
    preemption_mode: str = "auto"  # "auto" (swap where cheaper) | "recompute" | "swap"
    kv_offloading_size: float = 0.0  # GiB of host memory for evicted prefix blocks (0 = none)
    kv_offloading_disk_path: str | None = None  # directory for blocks the host tier evicts
    kv_offloading_disk_size: float = 0.0  # GiB cap of that directory
    enable_prefix_caching: bool = True
    # True: one block table for every layer, so sliding-window layers keep all their blocks
    # (vLLM's flag of the same name); False: blocks leave the cache with the window.
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    attention_backend: str = "auto"  # "auto" | "cpu" | "torch" | "triton" | "reference"
    enforce_eager: bool = False  # True: no CUDA graphs; decode steps run eagerly (GPU only)
    # Launch step N+1 before reading step N's tokens (engine/async_scheduling.py): None = on a
    # single-rank GPU engine, off on a CPU (where nothing overlaps); True / False force it.
    async_scheduling: bool | None = None
    seed: int = 0
    trust_remote_code: bool = False
    revision: str | None = None
    # Default sampling: "auto" = the model's generation_config.json, "vllm" = OpenAI's defaults,
    # or a folder holding a generation_config.json (engine/sample/generation_config.py).
    generation_config: str = "auto"
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower value first)
    # Structured outputs (structured_output/): "auto" (xgrammar, guidance for what it refuses),
    # "xgrammar" or "guidance". LLM(...) also takes vLLM's structured_outputs_config={"backend":
    # ...} and the older guided_decoding_backend=...; the server
    # --structured-outputs-config.backend.
    structured_outputs_backend: str = "auto"
    # None: the checkpoint's own quantization_config (or dense); "int8" | "fp8": quantise a dense
    # checkpoint's linears per channel at load (engine/layers/quantization/); "gguf": load the
    # model folder's .gguf file, its quantised linears kept quantised.
    quantization: str | None = None
    # vLLM's hf_overrides: a dict merged into the HF config (a JSON object string from the CLI),
    # or a callable taking and returning it; applied before the model is built, on every rank.
    hf_overrides: Any = None
    # vLLM v1's custom logits processors: LogitsProcessor subclasses (or "module:Class" / dotted
    # names), each applied to the whole batch's logits once per step (sample/logits_processor.py).
    logits_processors: Any = ()
    # Multi-LoRA (kvserve/lora/): adapters batched in one step; max_loras resident on the
    # device, max_cpu_loras (None: max_loras) in host memory, ranks up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = MAX_LORA_RANK
    max_cpu_loras: int | None = None
    # vLLM's kv_events_config (JSON text, a dict or a KVEventsConfig): publish prefix-cache
    # changes in vLLM's wire format over ZMQ for external schedulers (engine/kv_events_zmq.py).
    kv_events_config: Any = None
    # vLLM's kv_transfer_config (JSON text, a dict or a KVTransferConfig): a KV connector moving
    # blocks between replicas, e.g. prefill -> decode (engine/kv_transfer/).
    kv_transfer_config: Any = None
    # vLLM's speculative_config (a dict, JSON text or a SpeculativeConfig): draft tokens with
    # ngram / suffix / draft_model / eagle / eagle3 and verify them exactly (engine/spec_decode/).
    speculative_config: Any = None
    # vLLM's enable_prompt_embeds: prompts may be [seq_len, hidden] embeddings in place of token
    # ids (engine/prompt_embeds.py); such prompts skip the prefix cache.
    enable_prompt_embeds: bool = False
    # vLLM's profiler_config ({"profiler": "torch", "torch_profiler_dir": ...}, JSON text or a
    # ProfilerConfig): what LLM.start_profile() records and where (engine/profiler.py).
    profiler_config: Any = None
    # vLLM's load_format: "auto" (the checkpoint's safetensors or GGUF) or "sharded_state" (each
    # tensor-parallel rank reads its own shard, written by LLM.save_sharded_state).
    load_format: str = "auto"

    def __post_init__(self) -> None:
        from kvserve.engine.profiler import parse_profiler_config

        object.__setattr__(self, "profiler_config", parse_profiler_config(self.profiler_config))
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got "
                              f"{self.load_format!r}")
        if self.kv_events_config is not None:
            from kvserve.engine.kv_events_zmq import parse_kv_events_config

            object.__setattr__(self, "kv_events_config",
                               parse_kv_events_config(self.kv_events_config))
        if self.kv_transfer_config is not None:
            from kvserve.engine.kv_transfer.config import parse_kv_transfer_config

            object.__setattr__(self, "kv_transfer_config",
                               parse_kv_transfer_config(self.kv_transfer_config))
        self._check_speculative()
        if isinstance(self.hf_overrides, str):
            object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        if self.hf_overrides is not None and not (isinstance(self.hf_overrides, dict)
                                                  or callable(self.hf_overrides)):
            raise ConfigError("hf_overrides must be a dict (merged into the HF config) or a "
                              f"callable taking and returning the config, got "
                              f"{type(self.hf_overrides).__name__}")
        # Whether N splits the model (heads, KV heads, MLP) is checked where the model's config
        # is known, before any worker starts (engine/worker/kv_sizing.py).
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        self._check_pipeline()
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.async_scheduling and self.world_size > 1:
            raise ConfigError("async scheduling runs on one rank: every tensor-parallel rank "
                              "would need the sampled ids it reads on the device; drop "
                              "--async-scheduling or use tensor_parallel_size=1")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                              f"{self.scheduling_policy!r}")
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ConfigError(
                f"the structured outputs backend (--structured-outputs-config.backend) must be "
                f"one of {STRUCTURED_OUTPUTS_BACKENDS}, got {self.structured_outputs_backend!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got "
                              f"{self.preemption_mode!r}")
        if not self.kv_offloading_size >= 0:
            raise ConfigError(
                f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size keeps evicted prefix-cache blocks, so it needs "
                              "enable_prefix_caching=True (or set kv_offloading_size=0)")
        self._check_disk_tier()
        if self.attention_backend not in ("auto", "cpu", "torch", "triton", "reference"):
            raise ConfigError(f"unknown attention_backend {self.attention_backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_METHODS}, got "
                              f"{self.quantization!r}")
        if self.enable_lora:
            self.lora_config()  # raises ConfigError on bad sizes
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")

    def lora_config(self) -> Any:
        """The LoRAConfig of enable_lora=True (None without LoRA)."""
        if not self.enable_lora:
            return None
        from kvserve.lora.config import LoRAConfig

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _check_disk_tier(self) -> None:
        """The disk tier holds what the host tier evicts, so it needs one; its path and size come
        together. Whether the path is writable and the size holds a block is checked at start."""
        path, size = self.kv_offloading_disk_path, self.kv_offloading_disk_size
        if not size >= 0:
            raise ConfigError(f"kv_offloading_disk_size must be >= 0 GiB, got {size}")
        if path is None and not size:
            return
        if not path or not size:
            raise ConfigError("the KV disk tier needs both kv_offloading_disk_path (a directory) "
                              f"and kv_offloading_disk_size (GiB > 0); got path {path!r}, size "
                              f"{size}")
        if not self.kv_offloading_size:
            raise ConfigError("kv_offloading_disk_path keeps blocks the host tier evicts, so it "
                              "needs kv_offloading_size > 0 (GiB of host memory) too")
        if self.world_size > 1:
            raise ConfigError("the KV disk tier supports one rank only (tensor_parallel_size="
                              "pipeline_parallel_size=1); drop kv_offloading_disk_path or use "
                              "one rank")

    @property
    def world_size(self) -> int:
        """Ranks of one replica: pipeline stages x tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_pipeline(self) -> None:
        """pipeline_parallel_size: an integer >= 1, and what pipeline stages cannot do yet
        refused by name (whether the layers split is checked with the model's config)."""
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ConfigError(f"pipeline_parallel_size must be an integer >= 1, got {pp!r}")
        if pp == 1:
            return
        if self.calculate_kv_scales:
            raise ConfigError("calculate_kv_scales runs one calibration batch through the whole "
                              "model in one rank; with pipeline_parallel_size > 1 give the fp8 "
                              "scales in the checkpoint or use kv_cache_dtype='auto'")
        if self.speculative_config is not None:
            raise ConfigError("speculative decoding with pipeline_parallel_size > 1 is not "
                              "supported yet; drop speculative_config or use one stage")
        if self.load_format == "sharded_state":
            raise ConfigError("load_format='sharded_state' holds one shard per tensor-parallel "
                              "rank of a single stage; load the checkpoint itself with "
                              "pipeline_parallel_size > 1")

    def _check_speculative(self) -> None:
        """speculative_config parsed (SpeculativeConfig), and what it cannot run with refused."""
        from kvserve.engine.spec_decode.config import HOST_METHODS, parse_speculative_config

        spec = parse_speculative_config(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is None:
            return
        if self.async_scheduling and spec.method not in HOST_METHODS:
            raise ConfigError(f"async scheduling with speculative decoding runs with the "
                              f"host-side proposers {HOST_METHODS} only ({spec.method!r} drafts "
                              f"from each step's forward); drop --async-scheduling or use one "
                              f"of them")
        tp = spec.draft_tensor_parallel_size
        if tp is not None and tp not in (1, self.tensor_parallel_size):
            raise ConfigError(f"draft_tensor_parallel_size must be 1 or the target's "
                              f"tensor_parallel_size ({self.tensor_parallel_size}), got {tp}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown ones with the list of known names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


def structured_outputs_backend(config: Any, old: str | None = None) -> str | None:
    """The backend of vLLM's `structured_outputs_config` ({"backend": ...}, or an object with
    that attribute) and of its older `guided_decoding_backend`; None when neither names one."""
    backend = None
    if config is not None:
        values = config if isinstance(config, dict) else vars(config)
        unknown = sorted(set(values) - {"backend"})
        if unknown:
            raise ConfigError(f"structured_outputs_config: only 'backend' is supported, got "
                              f"{unknown}")
        backend = values.get("backend")
    if old is not None:
        if backend is not None and backend != old:
            raise ConfigError("structured_outputs_config['backend'] and guided_decoding_backend "
                              "disagree; give one of them")
        backend = old
    return backend


def parse_hf_overrides(text: str) -> dict[str, Any]:
    """`--hf-overrides '{"rope_theta": 1e6}'`: a JSON object."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"hf_overrides must be a JSON object, got {text!r}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"hf_overrides must be a JSON object, got {text!r}")
    return value


def apply_hf_overrides(config: Any, overrides: Any) -> Any:
    """The HF config with vLLM's hf_overrides applied (dict: set each key; callable: its result;
    a nested dict merges into a sub-config such as text_config)."""
    if overrides is None:
        return config
    if callable(overrides):
        return overrides(config)
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)
    return config
