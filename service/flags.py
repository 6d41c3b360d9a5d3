"""The `kvserve serve` flags: argparse value types (sizes, lists, caps) and the flag groups of the
engine, the HTTP server and the request limits (shared with `kvserve router`). Engine flags have
vLLM's spelling and map onto EngineConfig fields of the same name."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from kvserve.engine.config import (
    DEFAULT_MODEL,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MODEL_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    STRUCTURED_OUTPUTS_BACKENDS,
    EngineConfig,
)
from kvserve.engine.defaults import BLOCK_SIZES
from kvserve.service.limits import RequestLimits
from kvserve.service.reasoning import REASONING_PARSERS
from kvserve.service.server.lora_models import lora_module
from kvserve.service.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The --redis-url forms, as the replica's and the router's help give them.
REDIS_URL_FORMS = ("redis://HOST:PORT/DB, redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME or "
                   "redis+cluster://HOST:PORT[,HOST:PORT...]; password in the URL or env "
                   "KVSERVE_REDIS_PASSWORD")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'4GiB', '512M', '1073741824' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4GiB, 512MiB or bytes)")
    unit = (match.group(2) or "").lower()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


def string_list(text: str) -> list[str]:
    """A JSON list ('["*"]', as vLLM takes it) or a comma-separated list."""
    text = text.strip()
    if text.startswith("["):
        try:
            return [str(x) for x in json.loads(text)]
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"bad JSON list {text!r}: {exc}") from exc
    return [x.strip() for x in text.split(",") if x.strip()]


def json_object(text: str) -> dict[str, Any]:
    """A JSON object ('{"backend": "guidance"}', as vLLM's --*-config flags take)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"bad JSON {text!r}: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def chat_template(text: str) -> str:
    """--chat-template: a file's text, or the template given inline (as vLLM takes it)."""
    path = Path(text).expanduser()
    if any(c in text for c in "{}\n") or not path.exists():
        if not any(c in text for c in "{}"):
            raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a jinja template")
        return text
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {text!r}: {exc}") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def waiting_limit(text: str) -> int | str | None:
    """--max-waiting: a count of at least 1, `auto` or `none`."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    return positive_int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def logprobs_cap(text: str) -> int:
    value = int(text) if text.strip().lstrip("-").isdigit() else -1
    if not 0 <= value <= 20:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 20], got {text!r}")
    return value


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """Caps on one request (docs/guides/operations.md, "Request limits"); the server and router share
    them, so a body the router accepts is one the replicas accept."""
    d = RequestLimits()
    g = parser.add_argument_group("request limits (over a cap: 400 naming the field)")
    g.add_argument("--max-body-bytes", type=byte_size, default=1 << 20,
                   help="largest request body; larger ones get 413 before they are read")
    g.add_argument("--max-json-depth", type=positive_int, default=d.max_json_depth,
                   help="deepest nesting of arrays and objects in a request body")
    g.add_argument("--max-prompts-per-request", type=positive_int, default=d.max_prompts,
                   help="prompts in one /v1/completions request")
    g.add_argument("--max-prompt-tokens-per-request", type=positive_int,
                   default=d.max_prompt_tokens, help="prompt tokens of one request, all prompts")
    g.add_argument("--max-n", type=positive_int, default=d.max_n,
                   help="largest `n` (choices per prompt)")
    g.add_argument("--max-stop", type=positive_int, default=d.max_stop,
                   help="entries of `stop`, and of `stop_token_ids`")
    g.add_argument("--max-stop-length", type=positive_int, default=d.max_stop_len,
                   help="characters of one stop string")
    g.add_argument("--max-logprobs", type=logprobs_cap, default=d.max_logprobs,
                   help="largest `logprobs` / `top_logprobs` (at most 20)")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_json_depth=args.max_json_depth, max_prompts=args.max_prompts_per_request,
        max_prompt_tokens=args.max_prompt_tokens_per_request, max_n=args.max_n,
        max_stop=args.max_stop, max_stop_len=args.max_stop_length,
        max_logprobs=args.max_logprobs)


def _default(name: str) -> Any:
    field = next(f for f in fields(EngineConfig) if f.name == name)
    return field.default if field.default is not MISSING else None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig knob, with vLLM's flag names; defaults come from EngineConfig."""
    g = parser.add_argument_group("engine")
    d = _default
    g.add_argument("--model", default=None, help=f"model name ({DEFAULT_MODEL} is embedded), "
                   "local HF folder or hub id; default " + DEFAULT_MODEL)
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument("--revision", default=None, help="hub revision of the model")
    g.add_argument("--dtype", default=d("dtype"), choices=MODEL_DTYPES,
                   help="weights/activations dtype; auto = float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default=d("device"), choices=("auto", "cpu", "cuda"),
                   help="where the model runs; auto = cuda when a GPU is visible, else cpu")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d("tensor_parallel_size"),
                   help="GPUs per replica: one process per GPU, each holding 1/N of the weights "
                        "and of the KV heads (scale out with replicas)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int,
                   default=d("pipeline_parallel_size"),
                   help="pipeline stages per replica: the layers split over P stages of "
                        "--tensor-parallel-size ranks each (P x N processes, on one host or, "
                        "from LWS_* / MASTER_ADDR + RANK, several); VLLM_PP_LAYER_PARTITION "
                        "(e.g. 12,10) overrides the balanced split")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's")
    g.add_argument("--max-num-seqs", type=int, default=d("max_num_seqs"),
                   help="most requests in one running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (default: max(2048, max_model_len))")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d("enable_chunked_prefill"), help="split long prompts across steps")
    g.add_argument("--block-size", type=int, default=d("block_size"), choices=BLOCK_SIZES,
                   help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=d("gpu_memory_utilization"),
                   help="share of GPU memory for weights + activations + KV cache")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="KV-cache size on CPU for the whole server, split across the "
                        "tensor-parallel ranks, e.g. 2GiB (default: a quarter of the memory "
                        "available, at most 4 GiB)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="use exactly this many KV blocks (testing)")
    g.add_argument("--swap-space", type=float, default=d("swap_space"),
                   help="GiB of CPU memory for swapped-out KV blocks, for the whole server "
                        "(split across the tensor-parallel ranks, at most the KV cache; "
                        "allocated as blocks are swapped)")
    g.add_argument("--preemption-mode", default=d("preemption_mode"), choices=PREEMPTION_MODES,
                   help="what to do with a preempted request (auto: swap when the CPU pool has "
                        "room and copying is cheaper than recomputing)")
    g.add_argument("--kv-offloading-size", type=float, default=d("kv_offloading_size"),
                   help="GiB of host memory (all ranks) keeping prefix-cache blocks evicted from "
                        "the device; a hit copies them back instead of recomputing (0: off)")
    g.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                   help="directory keeping blocks the host tier evicts (needs "
                        "--kv-offloading-size and --kv-offloading-disk-size; one per engine; "
                        "kept across restarts of the same model)")
    g.add_argument("--kv-offloading-disk-size", type=float, default=d("kv_offloading_disk_size"),
                   help="GiB cap of --kv-offloading-disk-path")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d("enable_prefix_caching"), help="reuse KV blocks of shared prefixes")
    g.add_argument("--kv-cache-dtype", default=d("kv_cache_dtype"), choices=KV_CACHE_DTYPES,
                   help="dtype of the KV cache (fp8 halves it vs bf16)")
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="int8 or fp8: quantise an unquantised checkpoint's linears per channel "
                        "at load (int8 runs W8A8 on the CPU's int8 units); a quantised "
                        "checkpoint is read from its own quantization_config without the flag; "
                        "gguf: serve the model folder's .gguf file (Q8_0/Q4_0/Q4_1/Q4_K kept "
                        "quantised; the default model's own GGUF is fetched on first use)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="compute fp8 KV scales from the first batch")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer: sliding-window layers (Gemma 2/3, "
                        "gpt-oss) keep all their blocks instead of freeing those out of the window")
    g.add_argument("--attention-backend", default=d("attention_backend"),
                   choices=("auto", "cpu", "torch", "triton", "reference"),
                   help="paged attention: triton on CUDA, cpu (C++ kernels, built on first use) "
                        "or torch on CPU; auto picks; reference is the slow, exact one for tests")
    g.add_argument("--hf-overrides", default=d("hf_overrides"), metavar="JSON",
                   help="a JSON object merged into the model's HF config before it is built "
                        "(nested objects into sub-configs), on every rank")
    g.add_argument("--logits-processors", nargs="+", default=d("logits_processors"),
                   metavar="MODULE:CLASS",
                   help="vLLM v1 custom logits processors by import name, each applied to the "
                        "whole batch's logits once per step")
    g.add_argument("--enforce-eager", action="store_true", default=d("enforce_eager"),
                   help="never capture CUDA graphs: every decode step runs eagerly")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   default=d("async_scheduling"),
                   help="schedule and launch each step before the previous step's tokens are "
                        "read, so the host's work overlaps the device's (default: on for a "
                        "single-rank GPU engine, off on a CPU)")
    g.add_argument("--seed", type=int, default=d("seed"), help="random seed of the engine")
    g.add_argument("--scheduling-policy", default=d("scheduling_policy"),
                   choices=("fcfs", "priority"),
                   help="fcfs, or priority: lower `priority` values first, preempted last")
    g.add_argument("--generation-config", default=d("generation_config"),
                   help="default sampling: 'auto' (the model's generation_config.json), 'vllm' "
                        "(OpenAI's defaults) or a folder holding a generation_config.json")
    g.add_argument("--structured-outputs-config", type=json_object, default=None,
                   metavar="JSON", help='vLLM\'s JSON form, e.g. \'{"backend": "guidance"}\'')
    g.add_argument("--structured-outputs-config.backend", "--guided-decoding-backend",
                   dest="structured_outputs_backend", default=d("structured_outputs_backend"),
                   choices=STRUCTURED_OUTPUTS_BACKENDS,
                   help="structured outputs: xgrammar, guidance (llguidance), or auto (xgrammar, "
                        "guidance for what xgrammar refuses); --guided-decoding-backend is the "
                        "older spelling")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='vLLM\'s KV events over ZMQ for external schedulers (llm-d, GIE EPPs), '
                   'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                   '"replay_endpoint": "tcp://*:5558"}\'')
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='vLLM\'s KV connector, e.g. prefill/decode disaggregation: '
                   '\'{"kv_connector": "KVServeConnector", "kv_role": "kv_producer", '
                   '"kv_connector_extra_config": {"kv_port": 5600}}\' (docs/guides/'
                   'disaggregation.md)')
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative decoding, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": '
                   '2}\' (methods ngram, suffix, draft_model, eagle, eagle3; docs/guides/'
                   'speculative-decoding.md)')
    g.add_argument("--profiler-config", default=None, metavar="JSON",
                   help='vLLM\'s profiler config: torch.profiler traces of the engine, e.g. '
                   '\'{"profiler": "torch", "torch_profiler_dir": "./traces"}\'')
    g.add_argument("--load-format", default=d("load_format"), choices=LOAD_FORMATS,
                   help="auto (the checkpoint's safetensors or GGUF), safetensors, or "
                        "sharded_state (each tensor-parallel rank reads the shard "
                        "LLM.save_sharded_state wrote)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow model code from the hub (off: only built-in architectures)")
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument("--enable-lora", action="store_true", default=d("enable_lora"),
                      help="serve PEFT LoRA adapters of the model, requests of several adapters "
                           "and the base model batched in one step")
    lora.add_argument("--max-loras", type=positive_int, default=d("max_loras"),
                      help="adapters resident on the device at once (the batch mixes up to "
                           "this many; the least recently used idle one makes room)")
    lora.add_argument("--max-lora-rank", type=int, default=d("max_lora_rank"),
                      help="largest adapter rank served (1, 8, 16, 32, 64, ...); sizes the "
                           "device buffers")
    lora.add_argument("--max-cpu-loras", type=positive_int, default=None,
                      help="adapters kept in host memory (default: --max-loras); others are "
                           "read from disk again when next used")


def parse_additional_model(text: str) -> tuple[str, str]:
    """`NAME=PATH` of --additional-model."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--headless", action="store_true",
                   help="a worker host of a multi-host replica: run this host's ranks (from "
                        "LWS_GROUP_SIZE / LWS_WORKER_INDEX / LWS_LEADER_ADDRESS or MASTER_ADDR "
                        "+ RANK / WORLD_SIZE) with no API server; the leader serves the API")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients use for the model (the first is reported)")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (env KVSERVE_API_KEY)")
    g.add_argument("--public-paths", type=string_list,
                   default=["/health", "/metrics", "/version", "/ping"],
                   help="paths open without the API key (comma-separated)")
    g.add_argument("--max-waiting", type=waiting_limit, default="auto",
                   help="answer 429 + Retry-After once this many requests wait; auto = "
                   "4 x --max-num-seqs, none = no limit")
    g.add_argument("--request-timeout", type=positive_seconds, default=None,
                   help="seconds a request may take from arrival before it is aborted (504; "
                   "a client may ask for less with the X-Request-Timeout header)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="run a chat_template sent in a request (sandboxed jinja, time-limited); "
                   "refused with 400 otherwise")
    g.add_argument("--chat-template-time-limit", type=positive_seconds, default=5.0,
                   help="seconds a request's own chat template may take to render")
    g.add_argument("--chat-template", type=chat_template, default=None, metavar="FILE_OR_TEXT",
                   help="jinja chat template (a file, or the template itself) used instead of "
                   "the tokenizer's")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='vLLM\'s switch for tool_choice "auto" (needs --tool-call-parser; here '
                   "auto tool choice is on either way, parsed as hermes by default)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls read in the model's text: hermes (<tool_call>{...}"
                   "</tool_call>; the default), mistral ([TOOL_CALLS][...]), llama3_json or xlam (a JSON "
                   "list of calls)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a reasoning model's output into message.reasoning_content and "
                   "content: deepseek_r1 (text before </think> is reasoning, <think> or not), "
                   "qwen3 (<think>...</think>; off with chat_template_kwargs enable_thinking "
                   "false)")
    g.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompt_embeds (base64 torch.save'd [seq_len, hidden] tensors) "
                   "in /v1/completions; such prompts skip the prefix cache")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (tells a client what "
                   "is in the prefix cache, so off by default)")
    g.add_argument("--allowed-origins", type=string_list, default=[],
                   help="CORS origins (comma-separated or JSON list); CORS is off when empty")
    g.add_argument("--shutdown-grace-period", "--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM; those still "
                        "running then are handed back to the router to migrate (a 503 with "
                        "kvserve_migrate; streams end with it as an SSE event)")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="log level of kvserve and uvicorn")
    g.add_argument("--lora-modules", nargs="+", type=lora_module, default=[],
                   metavar="NAME=PATH",
                   help='LoRA adapters loaded at start, each a model name: name=path or vLLM\'s '
                   'JSON {"name": ..., "path": ..., "base_model_name": ...} (needs '
                   "--enable-lora)")
    g.add_argument("--additional-model", action="append", type=parse_additional_model,
                   default=[], metavar="NAME=PATH",
                   help="serve another model on the same port under NAME (repeatable), all "
                   "models in one process over one shared KV pool; list the model with the "
                   "largest KV block first (docs/guides/multi-model.md)")
    g.add_argument("--engine-core", default="auto", choices=["thread", "process", "auto"],
                   help="auto (default): process; process: the engine in its own process, this "
                   "one tokenising, detokenising and streaming (vLLM v1's split); thread: the "
                   "engine steps in a thread of the server's process (one process, for tests "
                   "and debugging)")
    add_limit_args(parser)
    r = parser.add_argument_group("prefix index (Redis, read by the router)")
    r.add_argument("--redis-url", default=None,
                   help="publish KV block hashes to this Redis: " + REDIS_URL_FORMS)
    r.add_argument("--service-name", default="default", help="the service's key namespace")
    r.add_argument("--advertise-url", default=None,
                   help="URL the router uses to reach this replica (default http://HOST:PORT)")
    r.add_argument("--replica-id", default=None, help="this replica's id (default HOST-PORT)")


