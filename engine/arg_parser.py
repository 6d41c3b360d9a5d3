"""vLLM's `FlexibleArgumentParser` (`vllm.utils.argparse_utils`): argparse that reads
`--max_model_len` as `--max-model-len`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's parser: `--max_model_len` is read as `--max-model-len` (underscores in a flag's
    name become dashes), so command lines written either way work."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args([_dashed(a) for a in argv], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
