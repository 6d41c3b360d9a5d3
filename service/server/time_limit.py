"""A time limit on pure-Python work in the current thread (a chat template a request sent).

A thread cannot be killed from outside, so the work checks the clock itself: a trace function,
installed for this thread only while the work runs, raises once the deadline passes. Jinja
compiles a template to Python, so every loop iteration of a rendering template is a traced line
and a runaway template stops within a line of its deadline. Tracing slows the work, which is why
only request-supplied templates run under it, never the model's own."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


class TimeLimitExceeded(Exception):
    """The work ran past its time limit and was stopped."""


def run_with_time_limit(seconds: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in this thread, stopped with TimeLimitExceeded after `seconds`."""
    deadline = time.monotonic() + seconds

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TimeLimitExceeded(f"stopped after its time limit of {seconds:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(previous)
