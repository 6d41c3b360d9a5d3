"""`kvserve` command line: `serve`, `fetch-model`, plus `router`, `plan` and `operator` from their
modules. Engine flags have vLLM's spelling and map onto EngineConfig fields of the same name."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any

from kvserve.engine.config import DEFAULT_MODEL, KV_CACHE_DTYPES, MODEL_DTYPES, PREEMPTION_MODES, \
    EngineConfig
from kvserve.engine.errors import ConfigError, KVServeError
from kvserve.service.limits import RequestLimits

logger = logging.getLogger("kvserve.cli")

# Modules that add their own subcommands with `register(subparsers)`, if installed.
EXTERNAL_COMMANDS = ("kvserve.service.router.cli", "kvserve.operator.cli")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
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
    """Caps on one request (docs/operations.md, "Request limits"); the server and router share
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
    g.add_argument("--device", default=d("device"), choices=("auto", "cpu", "cuda"))
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d("tensor_parallel_size"),
                   help="GPUs per replica (only 1 is supported; scale out with replicas)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default: the model's")
    g.add_argument("--max-num-seqs", type=int, default=d("max_num_seqs"),
                   help="most requests in one running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (default: max(2048, max_model_len))")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d("enable_chunked_prefill"), help="split long prompts across steps")
    g.add_argument("--block-size", type=int, default=d("block_size"), choices=(8, 16, 32),
                   help="tokens per KV-cache block")
    g.add_argument("--gpu-memory-utilization", type=float, default=d("gpu_memory_utilization"),
                   help="share of GPU memory for weights + activations + KV cache")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="KV-cache size on CPU, e.g. 2GiB (default: a safe share of RAM)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="use exactly this many KV blocks (testing)")
    g.add_argument("--swap-space", type=float, default=d("swap_space"),
                   help="GiB of CPU memory for swapped-out KV blocks")
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
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="compute fp8 KV scales from the first batch")
    g.add_argument("--attention-backend", default=d("attention_backend"),
                   choices=("auto", "cpu", "torch", "triton", "reference"))
    g.add_argument("--seed", type=int, default=d("seed"), help="random seed of the engine")
    g.add_argument("--scheduling-policy", default=d("scheduling_policy"),
                   choices=("fcfs", "priority"),
                   help="fcfs, or priority: lower `priority` values first, preempted last")
    g.add_argument("--generation-config", default=d("generation_config"),
                   help="default sampling: 'auto' (the model's generation_config.json), 'vllm' "
                        "(OpenAI's defaults) or a folder holding a generation_config.json")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="allow model code from the hub (off: only built-in architectures)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
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
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (tells a client what "
                   "is in the prefix cache, so off by default)")
    g.add_argument("--allowed-origins", type=string_list, default=[],
                   help="CORS origins (comma-separated or JSON list); CORS is off when empty")
    g.add_argument("--shutdown-grace-period", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    add_limit_args(parser)
    r = parser.add_argument_group("prefix index (Redis, read by the router)")
    r.add_argument("--redis-url", default=None, help="publish KV block hashes to this Redis")
    r.add_argument("--service-name", default="default", help="the service's key namespace")
    r.add_argument("--advertise-url", default=None,
                   help="URL the router uses to reach this replica (default http://HOST:PORT)")
    r.add_argument("--replica-id", default=None, help="this replica's id (default HOST-PORT)")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"model to serve (same as --model; default {DEFAULT_MODEL})")
    add_engine_args(parser)
    add_server_args(parser)


def build_serve_parser(prog: str = "kvserve serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=SERVE_DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(parser)
    return parser


SERVE_DESCRIPTION = ("Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, "
                     "/v1/models) with Prometheus metrics on /metrics.")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags (dashes become underscores); ConfigError if invalid."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values["model"] = args.model_tag or args.model or DEFAULT_MODEL
    values["served_model_name"] = args.served_model_name[0] if args.served_model_name else None
    return EngineConfig.from_kwargs(**values)


def server_config_from_args(args: argparse.Namespace) -> Any:
    from kvserve.service.server.config import ServerConfig

    return ServerConfig(
        host=args.host, port=args.port, served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or os.environ.get("KVSERVE_API_KEY") or None,
        public_paths=tuple(args.public_paths),
        max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_time_limit=args.chat_template_time_limit,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        limits=limits_from_args(args),
        allowed_origins=list(args.allowed_origins),
        shutdown_grace_period=args.shutdown_grace_period, log_level=args.log_level,
        redis_url=args.redis_url, service_name=args.service_name,
        advertise_url=args.advertise_url, replica_id=args.replica_id, print_banner=True)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    engine_config = engine_config_from_args(args)
    server_config = server_config_from_args(args)
    from kvserve.service.api_server import run_server

    return run_server(engine_config, server_config)


def run_fetch_model(args: argparse.Namespace) -> int:
    setup_logging("info")
    from kvserve.engine.model_loader import fetch_model

    print(fetch_model(args.name))
    return 0


def register_external(subparsers: Any, module_name: str) -> bool:
    """Let `module_name` add its subcommands; skip (with a warning) only if it does not exist."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        logger.warning("%s is not installed: its subcommands are not available", module_name)
        return False
    module.register(subparsers)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: a paged KV-cache LLM engine, an OpenAI-compatible "
        "server, a prefix-aware router and a Kubernetes operator.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           description=SERVE_DESCRIPTION,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)
    fetch = sub.add_parser("fetch-model", help="download a known model once; print its folder",
                           description="Download and convert a known model into the kvserve "
                           "cache (once) and print the folder.")
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                       help=f"known model name (default {DEFAULT_MODEL})")
    fetch.set_defaults(func=run_fetch_model)
    for module_name in EXTERNAL_COMMANDS:
        register_external(sub, module_name)
    return parser


def _version() -> str:
    import kvserve

    return f"kvserve {kvserve.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"kvserve: configuration error: {exc}", file=sys.stderr)
        return 2
    except KVServeError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
