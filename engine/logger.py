"""vLLM's `init_logger(name)`: the standard library's logger of that name, with vLLM's
`debug_once` / `info_once` / `warning_once` (a message logged once per process)."""

from __future__ import annotations

import logging
from functools import lru_cache
from types import MethodType
from typing import Any


@lru_cache(maxsize=None)
def _once(logger: logging.Logger, level: int, msg: str, *args: Any) -> None:
    # the cache is the memory of what was logged: one call per (logger, level, message, args)
    logger.log(level, msg, *args, stacklevel=3)


def _once_method(level: int) -> Any:
    def method(self: logging.Logger, msg: str, *args: Any) -> None:
        _once(self, level, msg, *args)
    return method


_ONCE_METHODS = {"debug_once": logging.DEBUG, "info_once": logging.INFO,
                 "warning_once": logging.WARNING}


def init_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` plus the `*_once` methods vLLM's loggers have."""
    logger = logging.getLogger(name)
    for method_name, level in _ONCE_METHODS.items():
        setattr(logger, method_name, MethodType(_once_method(level), logger))
    return logger
