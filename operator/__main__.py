"""`python -m kvserve.operator plan|operator ...`: the operator image's entry point (no torch)."""

from __future__ import annotations

import argparse
import sys

from kvserve.operator.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.operator")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
