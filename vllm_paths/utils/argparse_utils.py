"""`kvserve.utils.argparse_utils`, as `vllm.utils.argparse_utils`."""

from kvserve.engine.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
