"""vLLM's `EngineArgs` / `AsyncEngineArgs`: EngineConfig's fields as a mutable dataclass with
`add_cli_args` / `from_cli_args` / `create_engine_config`, plus the vLLM arguments that ask
nothing of this engine (accepted, no effect). Any other argument is refused by name."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any

from kvserve.engine.config import EngineConfig

# vLLM engine arguments that change nothing here: their values are accepted and dropped.
# (kvserve logs no periodic stats and needs no custom all-reduce; `enforce_eager` is an
# EngineConfig field: it turns CUDA graphs for decode off.)
NO_EFFECT = {"disable_log_stats": False, "disable_custom_all_reduce": False}


def split_vllm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without the arguments that have no effect here (see NO_EFFECT)."""
    return {k: v for k, v in kwargs.items() if k not in NO_EFFECT}


class _EngineArgsMethods:
    """What vLLM's EngineArgs does beyond holding values."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One `--flag-name` per field (vLLM's spelling), typed from its default."""
        for f in fields(EngineArgs):
            default = f.default if f.default is not MISSING else None
            flag = "--" + f.name.replace("_", "-")
            if isinstance(default, bool) or str(f.type).startswith("bool"):  # bool | None too
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            elif isinstance(default, tuple):  # a list of names (--logits-processors a:B c:D)
                parser.add_argument(flag, nargs="*", type=str, default=default)
            else:
                kind = type(default) if default is not None else _type_of(f.type)
                parser.add_argument(flag, type=kind, default=default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Any:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                      if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """The frozen EngineConfig (ConfigError for a value it refuses)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        return EngineConfig.from_kwargs(**split_vllm_kwargs(values))


def _type_of(annotation: Any) -> Any:
    text = str(annotation)
    for name, kind in (("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str


def _fields(base: type) -> list[tuple[str, Any, Any]]:
    out = []
    for f in fields(base):
        value = field(default=f.default) if f.default is not MISSING \
            else field(default_factory=f.default_factory)  # type: ignore[misc]
        out.append((f.name, f.type, value))
    names = {name for name, _, _ in out}  # a NO_EFFECT name EngineConfig now has is its own
    return out + [(k, bool, field(default=v)) for k, v in NO_EFFECT.items() if k not in names]


EngineArgs = make_dataclass("EngineArgs", _fields(EngineConfig), bases=(_EngineArgsMethods,))
EngineArgs.__module__ = __name__
EngineArgs.__doc__ = ("vLLM's EngineArgs: every EngineConfig field by name, mutable, plus the "
                      "vLLM arguments that have no effect here.")


@dataclass
class AsyncEngineArgs(EngineArgs):  # type: ignore[misc, valid-type]
    """vLLM's AsyncEngineArgs (the server's): EngineArgs plus request logging's switch."""

    disable_log_requests: bool = True

    def create_engine_config(self) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name != "disable_log_requests"}
        return EngineConfig.from_kwargs(**split_vllm_kwargs(values))

