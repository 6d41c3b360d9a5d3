"""ServerConfig: one server process's HTTP settings, from `kvserve serve`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.service.limits import RequestLimits
from kvserve.service.tool_parsers import DEFAULT_TOOL_PARSER

DEFAULT_PUBLIC_PATHS = ("/health", "/metrics", "/version", "/ping")
# --max-waiting's default, per running slot (--max-num-seqs): enough queue to refill the batch a
# few times over, small enough that a burst gets 429s instead of minutes in a queue.
WAITING_PER_SEQ = 4
AUTO = "auto"


@dataclass
class ServerConfig:
    """The HTTP side's settings (the engine's are in EngineConfig)."""

    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # [] = the engine's model name
    api_key: str | None = None
    public_paths: tuple[str, ...] = DEFAULT_PUBLIC_PATHS  # open without the API key
    # 429 once this many requests wait; "auto" = WAITING_PER_SEQ x max_num_seqs, None = no limit
    max_waiting: int | str | None = AUTO
    request_timeout: float | None = None  # seconds from arrival; None = no deadline
    trust_request_chat_template: bool = False  # run chat templates sent in requests (sandboxed)
    chat_template_time_limit: float = 5.0  # seconds a request's chat template may render
    chat_template: str | None = None  # --chat-template (its text), instead of the tokenizer's
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice (auto works either way)
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser (service/reasoning/): None = off
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    max_body_bytes: int = 1 << 20
    limits: RequestLimits = field(default_factory=RequestLimits)
    allowed_origins: list[str] = field(default_factory=list)  # CORS off when empty
    shutdown_grace_period: float = 30.0
    log_level: str = "info"
    engine_core: str = "auto"  # --engine-core: thread, process, auto (= process)
    redis_url: str | None = None
    service_name: str = "default"
    advertise_url: str | None = None
    replica_id: str | None = None
    print_banner: bool = False  # print the curl line and Python snippet once started
    lora_modules: list = field(default_factory=list)  # LoRAModulePath: adapters loaded at start
    # --additional-model NAME=PATH: more models on this port, one shared KV pool (multi_model.py)
    additional_models: list[tuple[str, str]] = field(default_factory=list)

    def waiting_limit(self, max_num_seqs: int) -> int | None:
        """--max-waiting resolved against the engine's batch size."""
        if self.max_waiting == AUTO:
            return WAITING_PER_SEQ * max_num_seqs
        return self.max_waiting  # type: ignore[return-value]

