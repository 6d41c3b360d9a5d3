"""The operator's typed errors, in a module of their own so every parser can raise them."""

from __future__ import annotations

from kvserve.operator.trust import redact


class InvalidSpecError(ValueError):
    """A spec the operator refuses; `reason` becomes the Ready condition's reason. The message
    goes to status, events and logs, so a URL's password in it is redacted here, once."""

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(redact(message))
        self.reason = reason
