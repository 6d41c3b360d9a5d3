"""Several models in one process over one KV pool: `ModelSet` holds an LLMEngine per model
name, all seated on one SharedKV (worker/kv_region.py: the page allocator and the bytes), each
with its own scheduler; `MultiModelLLM` is the offline front (`generate(..., model=name)`).

Weights are loaded once per model; pages go to whichever model needs them; each engine steps
under the pool's turn lock, so the engines of one process take turns (fair by default)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import ConfigError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.worker.kv_region import PoolSeat, SharedKV

logger = logging.getLogger("kvserve.engine")


def weight_bytes_on_disk(config: EngineConfig) -> int:
    """The checkpoint's stored weight bytes (0 when its folder cannot be read: a hub id not
    fetched yet), what the first model's budget sets aside for a model still to load."""
    from kvserve.engine.sizing.weights_size import checkpoint_weight_bytes
    from kvserve.engine.worker.model_loader import resolve_model

    try:
        return checkpoint_weight_bytes(resolve_model(config.model, config.revision))
    except Exception:  # noqa: BLE001 - sizing is best effort; the load itself will say why
        return 0


class ModelSet:
    """The engines of several models on one shared KV pool, by served name.

    The first model sizes the pool (its KV budget less the others' weights, or `num_pages`)
    and its block is the page: list the model with the largest KV block first."""

    def __init__(self, configs: Mapping[str, EngineConfig], num_pages: int | None = None,
                 fair: bool = True) -> None:
        if not configs:
            raise ConfigError("a ModelSet needs at least one model")
        names = list(configs)
        reserve = sum(weight_bytes_on_disk(configs[n]) for n in names[1:])
        self.shared = SharedKV(num_pages=num_pages, reserve_bytes=reserve, fair=fair)
        self.engines: dict[str, LLMEngine] = {}
        for i, name in enumerate(names):
            self.add(name, configs[name], plain_hashes=i == 0)

    @property
    def first(self) -> str:
        return next(iter(self.engines))

    def add(self, name: str, config: EngineConfig, plain_hashes: bool = False) -> LLMEngine:
        """Load a model onto the pool under `name` (its blocks must fit a page)."""
        if name in self.engines:
            raise ConfigError(f"a model named {name!r} is already served; pick another name")
        # no CPU swap pool: a preempted sequence recomputes (its pages go back to the pool)
        config = dataclasses.replace(config, served_model_name=name, swap_space=0)
        seat = PoolSeat(self.shared, name, None if plain_hashes else name)
        engine = LLMEngine(config, seat)
        self.engines[name] = engine
        pool = self.shared.pool
        assert pool is not None
        logger.info("model %s on the shared KV pool: %d pages of %d bytes, %.0f%% of each "
                    "page unused by its blocks", name, pool.num_pages, pool.page_bytes,
                    100 * pool.waste(name))
        return engine

    def remove(self, name: str) -> None:
        """Unload a model: abort its requests, stop it, forget its cached pages."""
        if name == self.first and len(self.engines) > 1:
            raise ConfigError(f"{name!r} sized the shared pool and stays while other models are "
                              "served; unload the others first")
        engine = self.engines.pop(name)
        engine.abort_request(list(engine.requests))
        while engine.has_unfinished_requests():
            engine.step()
        engine.shutdown()
        assert self.shared.pool is not None
        self.shared.pool.leave(name)

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self.engines.values())

    def step(self) -> dict[str, list[RequestOutput]]:
        """One step of each model with requests (in turn); their outputs by model."""
        return {name: e.step() for name, e in list(self.engines.items())
                if e.has_unfinished_requests()}

    def held_pages(self, name: str) -> int:
        """Pages the model's sequences hold now."""
        return self.engines[name].kv.num_held_blocks()

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


class MultiModelLLM:
    """The offline API over several models in one pool.

    >>> llm = MultiModelLLM({"a": "smollm2-135m-instruct", "b": "/models/tiny"},
    ...                     max_model_len=512)
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8), model="b")
    """

    def __init__(self, models: Mapping[str, str], num_pages: int | None = None,
                 fair: bool = True, **engine_kwargs: Any) -> None:
        configs = {name: EngineConfig.from_kwargs(model=path, **engine_kwargs)
                   for name, path in models.items()}
        self.models = ModelSet(configs, num_pages=num_pages, fair=fair)
        self._next = 0

    def generate(self, prompts: list[str] | list[list[int]], params: Any,
                 model: str | None = None) -> list[RequestOutput]:
        """Outputs for `prompts` on `model` (default: the first), in order."""
        return self.generate_many({model or self.models.first: (prompts, params)})[
            model or self.models.first]

    def generate_many(self, work: Mapping[str, tuple[list[Any], Any]]
                      ) -> dict[str, list[RequestOutput]]:
        """Run every model's prompts at once (the engines step in turns); outputs by model."""
        ids: dict[str, list[str]] = {}
        for name, (prompts, params) in work.items():
            engine = self._engine(name)
            ids[name] = []
            for p in prompts:
                self._next += 1
                engine.add_request(str(self._next), p, params)
                ids[name].append(str(self._next))
        done: dict[str, RequestOutput] = {}
        while self.models.has_unfinished_requests():
            for outs in self.models.step().values():
                done.update((o.request_id, o) for o in outs if o.finished)
        return {name: [done[i] for i in rids] for name, rids in ids.items()}

    def _engine(self, name: str) -> LLMEngine:
        if name not in self.models.engines:
            raise ConfigError(f"model {name!r} is not served here; served: "
                              f"{list(self.models.engines)}")
        return self.models.engines[name]

    def shutdown(self) -> None:
        self.models.shutdown()
