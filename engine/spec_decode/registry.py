"""Proposers by method name (`speculative_config["method"]`): each module registers its class
with `@register_proposer`; `make_proposer` builds the configured one."""

from __future__ import annotations

import importlib

from kvserve.engine.errors import ConfigError
from kvserve.engine.spec_decode.proposer import Proposer, ProposerContext

_PROPOSERS: dict[str, type[Proposer]] = {}
# method -> module that registers it when imported (so a method's heavy imports wait until used)
_MODULES = {
    "ngram": "kvserve.engine.spec_decode.ngram",
    "suffix": "kvserve.engine.spec_decode.suffix",
    "draft_model": "kvserve.engine.spec_decode.draft_model",
    "eagle": "kvserve.engine.spec_decode.eagle",
    "eagle3": "kvserve.engine.spec_decode.eagle",
}
METHODS = tuple(_MODULES)


def register_proposer(cls: type[Proposer]) -> type[Proposer]:
    """Class decorator: `cls.method` names it in speculative_config."""
    if not cls.method:
        raise ValueError(f"{cls.__name__} sets no `method` name")
    _PROPOSERS[cls.method] = cls
    return cls


def proposer_class(method: str) -> type[Proposer]:
    """The class registered for `method` (its module imported on first use)."""
    if method not in _PROPOSERS and method in _MODULES:
        try:
            importlib.import_module(_MODULES[method])
        except ModuleNotFoundError as exc:
            if exc.name != _MODULES[method]:
                raise
    if method not in _PROPOSERS:
        known = sorted(set(_PROPOSERS) | set(_MODULES))
        raise ConfigError(f"speculative method {method!r} is not available here; known: {known}")
    return _PROPOSERS[method]


def make_proposer(config: object, context: ProposerContext) -> Proposer:
    """The proposer of a SpeculativeConfig."""
    return proposer_class(config.method)(config, context)  # type: ignore[attr-defined]
