"""Where kvserve keeps what it fetches and builds (converted models, compiled CPU kernels): one
root shared by the engine and the kernels, so neither imports the other for it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$KVSERVE_CACHE` or `~/.cache/kvserve`."""
    return Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve"))
