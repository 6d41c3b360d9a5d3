"""mkdocs hook: adds the generated reference pages (docs/gen/reference.py) to every build, so
`make docs` and `make docs-serve` always show the code as it is."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def _reference() -> Any:
    """docs/gen/reference.py, loaded by path (docs/ is not a package)."""
    path = Path(__file__).with_name("reference.py")
    spec = importlib.util.spec_from_file_location("kvserve_docs_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def on_files(files: Files, config: Any) -> Files:
    reference = _reference()
    for uri, render in reference.PAGES.items():
        files.append(File.generated(config, uri, content=render()))
    # The benchmarks' committed plots stay in bench/results/; the site shows them as perf/plots/.
    for png in sorted((reference.ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"perf/plots/{png.name}", abs_src_path=str(png)))
    return files
