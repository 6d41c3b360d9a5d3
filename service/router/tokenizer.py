"""The router's tokenizer: loaded off the event loop once a name is known (`--tokenizer`, else the
model the replicas announce), retried until then; prefix routing waits for it, the rest does not."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvserve.service.bounded import stop_task
from kvserve.service.router.prompt_tokens import prompt_tokens_for
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.router.shared_load import CLOSE_TIMEOUT_S

logger = logging.getLogger("kvserve.router")


class RouterTokenizer:
    """Tokenizes request bodies as the engine does; `tokenizer` is None until it is loaded."""

    def __init__(self, name: str | None, replicas: ReplicaSet, retry_interval: float) -> None:
        self.name, self.replicas, self.retry_interval = name, replicas, retry_interval
        self.tokenizer: Any = None
        self._chat_encoder: Any = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Load now when the name is known, so the first requests are routed well; else retry in
        the background."""
        if not await self._try_load():
            self._task = asyncio.create_task(self._load_loop())

    async def close(self) -> None:
        if self._task is not None:  # bounded: a load stuck in a thread never holds the exit
            await stop_task(self._task, CLOSE_TIMEOUT_S)

    async def _try_load(self) -> bool:
        """Load the tokenizer (off the event loop); False when no name is known or it failed."""
        from kvserve.engine.sample.tokenizer import load_tokenizer

        name = self.name or self.replicas.announced_model()
        if not name:
            return False
        logger.info("loading the router's tokenizer from %s", name)
        try:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, name, load_tokenizer)
        except Exception as exc:  # a bad name must not kill the router: least-load still works
            logger.error("cannot load tokenizer %r (%s); pass --tokenizer. Prefix routing falls "
                         "back to least load until then", name, exc)
            return False
        return True

    async def _load_loop(self) -> None:
        """Retry until a replica announces its model (prefix routing needs the tokenizer)."""
        while not await self._try_load():
            if self.name:
                return  # an explicit name that failed will not get better
            await asyncio.sleep(self.retry_interval)

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids exactly as the engine computes them (None: cannot tell)."""
        if self.tokenizer is None:
            return None
        try:
            if self._chat_encoder is None or self._chat_encoder.tokenizer is not self.tokenizer:
                from kvserve.engine.sample.tokenizer import ChatEncoder

                self._chat_encoder = ChatEncoder(self.tokenizer)
            return prompt_tokens_for(self.tokenizer, path, body, self._chat_encoder)
        except Exception as exc:  # a malformed body: the replica will answer with the 400
            logger.debug("cannot tokenize request for routing: %s", exc)
            return None


def _load_tokenizer(name: str, loader: Any) -> Any:
    from kvserve.engine.worker.model_loader import resolve_model

    return loader(resolve_model(name))
