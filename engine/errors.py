"""Typed errors raised by the engine; each message says what to change."""


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class InvalidRequestError(KVServeError, ValueError):
    """A request (prompt or sampling parameters) that can never be served as given."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(KVServeError):
    """The model name, folder or hub id could not be resolved or fetched."""


class ConfigError(KVServeError, ValueError):
    """An engine configuration that cannot work (bad flag value, unsupported feature)."""


class QuantizationError(ConfigError):
    """A quantised checkpoint (or --quantization) the engine cannot serve: an unsupported scheme,
    or tensors whose shapes do not fit each other. The message names the scheme or tensor."""


class OutOfKVCacheError(KVServeError):
    """The KV cache is too small to hold even one request of the configured length."""


class WorkerDiedError(KVServeError):
    """A tensor-parallel worker process died or failed; the engine cannot continue."""


class RequestFailedError(KVServeError):
    """One request of an offline `LLM.generate`/`chat` call failed inside a step (its own error
    is the cause). The other requests of the call ran to the end; their outputs are in `outputs`
    (None where the request failed), so a caller can keep them."""

    def __init__(self, message: str, outputs: list) -> None:
        super().__init__(message)
        self.outputs = outputs


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served: not a PEFT adapter folder, a rank above max_lora_rank,
    trained for another base model, or targeting a module the model does not have (HTTP 400)."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param)


class LoRANotFoundError(KVServeError):
    """A request or an unload names an adapter this engine does not know (HTTP 404)."""
