"""The operator's typed errors, in a module of their own so every parser can raise them."""

from __future__ import annotations


class InvalidSpecError(ValueError):
    """A spec the operator refuses; `reason` becomes the Ready condition's reason."""

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(message)
        self.reason = reason
