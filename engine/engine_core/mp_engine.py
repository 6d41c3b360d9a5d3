"""MPLLMEngine: `LLMEngine`'s interface (add/abort/step) over an engine core process, for the
offline `LLM` (`KVSERVE_ENABLE_MULTIPROCESSING=1`). `step()` returns the outputs of the core's
next step message; the core is already running the step after it."""

from __future__ import annotations

from typing import Any

from kvserve.engine.engine_core.core_client import POLL_S, CoreClient, EngineCoreDiedError
from kvserve.engine.engine_core.messages import (AbortRequests, AddRequest, CoreDead,
                                                 StepMessage)
from kvserve.engine.engine_core.client_outputs import ClientOutputProcessor
from kvserve.engine.outputs import RequestOutput


class MPLLMEngine:
    """The engine of `LLM` when its core runs in another process. Other engine methods
    (`get_stats`, `reset_prefix_cache`, `start_profile`, ...) are calls into the core."""

    def __init__(self, config: Any) -> None:
        self.client = CoreClient(config)
        self.config = config
        self.outputs = ClientOutputProcessor(self.client.info.tokenizer)
        self._unanswered: set[str] = set()  # adds sent, the core's answer not yet read
        self._refused: dict[str, BaseException] = {}  # adds the core refused, not yet raised
        self._errors: dict[str, BaseException] = {}  # requests that failed alone in a step
        self._buffered: list[RequestOutput] = []  # read while waiting for answers

    @classmethod
    def from_config(cls, config: Any) -> MPLLMEngine:
        return cls(config)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("client", "outputs"):
            raise AttributeError(name)
        return getattr(self.client.engine, name)

    @property
    def requests(self) -> dict[str, Any]:
        """The requests in flight (`.prompt` is settable, as `LLMEngine.requests`)."""
        return self.outputs.requests

    def add_request(self, request_id: str, prompt: str | list[int], params: Any,
                    **kwargs: Any) -> None:
        """Queue a request in the core without waiting; `confirm_added` raises what it
        refused (InvalidRequestError), as `LLMEngine.add_request` would have."""
        if request_id in self.outputs.requests:
            from kvserve.engine.errors import InvalidRequestError

            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      "request_id")
        self.outputs.add(request_id, prompt, params, kwargs.get("lora_request"),
                         kwargs.get("continuation"))
        self._unanswered.add(request_id)
        self.client.send(AddRequest(request_id, prompt, params, kwargs))

    def confirm_added(self, request_ids: list[str]) -> None:
        """Wait for the core's answer to these adds; raise the first refusal."""
        while self._unanswered.intersection(request_ids):
            self._buffered += self._next_step()
        for rid in request_ids:
            if rid in self._refused:
                exc = self._refused.pop(rid)
                self._refused.clear()
                raise exc

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.outputs.remove(rid)
        self.client.send(AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.requests) or bool(self._buffered)

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.requests)

    def take_request_errors(self) -> dict[str, BaseException]:
        errors, self._errors = self._errors, {}
        return errors

    def step(self) -> list[RequestOutput]:
        if self._buffered:
            outs, self._buffered = self._buffered, []
            return outs
        return self._next_step()

    def _next_step(self) -> list[RequestOutput]:
        while True:
            msg = self.client.recv(POLL_S)
            if isinstance(msg, StepMessage):
                break
            if isinstance(msg, CoreDead):
                raise EngineCoreDiedError(f"the engine failed: {msg.reason}")
            if msg is None and self.client.death is not None:
                raise EngineCoreDiedError(self.client.death)
        for rid, exc in msg.accepted:
            self._unanswered.discard(rid)
            if exc is not None:
                self.outputs.remove(rid)
                self._refused[rid] = exc
        for rid, exc in msg.errors.items():
            if rid in self.outputs.requests:
                self.outputs.remove(rid)
                self._errors[rid] = exc
        outs, stopped = self.outputs.process(msg.deltas)
        if stopped:
            self.client.send(AbortRequests(stopped))
        return outs

    def shutdown(self) -> None:
        self.client.close()
