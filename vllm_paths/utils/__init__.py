"""`kvserve.utils`, as `vllm.utils`: a package of vLLM's helper modules (`argparse_utils`,
`serial_utils`); `FlexibleArgumentParser` also here, where older vLLM scripts import it."""

from kvserve.engine.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
