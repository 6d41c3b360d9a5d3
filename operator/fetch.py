"""The weights cache's init container: fetch a model into the claim only when its marker file (uri,
revision, checksum) is missing or stale, so the second pod and every scale-up start at once.

`python -m kvserve.operator.fetch --uri hf://ORG/NAME --revision main --cache /weights`; a name
`kvserve fetch-model` knows is fetched by running that command with KVSERVE_CACHE at the claim.
`--adapter hf://ORG/NAME[:REV]` (repeatable) fetches LoRA adapters into <cache>/adapters/ (the
adapter Job, operator/adapters.py).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.model_uri import ModelURI, parse_model_uri

MARKER = ".kvserve-weights.json"
logger = logging.getLogger("kvserve.fetch")
Fetcher = Callable[[ModelURI, Path], None]


def checksum(folder: Path) -> str:
    """sha256 over every file's relative path and size (not contents: reading hundreds of GB at
    each pod start would cost minutes); it catches truncated, missing and extra files."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        digest.update(f"{path.relative_to(folder)}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def marker(location: ModelURI, folder: Path) -> dict:
    return {"uri": location.path, "scheme": location.scheme, "revision": location.revision,
            "checksum": checksum(folder)}


def is_current(location: ModelURI, folder: Path) -> bool:
    try:
        found = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return found == marker(location, folder)


def fetch_with_cli(location: ModelURI, target: Path) -> None:
    """`kvserve fetch-model NAME` with its cache at the claim: it writes <cache>/models/NAME."""
    env = {**os.environ, "KVSERVE_CACHE": str(target.parent.parent)}
    done = subprocess.run(["kvserve", "fetch-model", location.path], env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kvserve fetch-model {location.path} failed ({done.returncode})")


def fetch_from_hub(location: ModelURI, target: Path) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(location.path, revision=location.revision, local_dir=str(target),
                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    shutil.rmtree(target / ".cache", ignore_errors=True)  # the hub's bookkeeping, not weights


FETCHERS: dict[str, Fetcher] = {"name": fetch_with_cli, "hf": fetch_from_hub}


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One fetcher per model at a time across pods sharing a ReadWriteMany claim."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure(location: ModelURI, cache: Path,
           fetchers: dict[str, Fetcher] | None = None, kind: str = "models") -> bool:
    """Make <cache>/<kind>/<slug> hold the weights (kind: models or adapters); True when it had
    to fetch them."""
    fetchers = fetchers or FETCHERS
    if location.scheme not in fetchers:
        raise InvalidSpecError(f"{location.scheme} {kind} cannot be fetched into a cache")
    target = cache / kind / location.slug
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(cache / kind / f".{location.slug}.lock"):
        if is_current(location, target):
            logger.info("weights of %s@%s already cached in %s", location.path,
                        location.revision, target)
            return False
        shutil.rmtree(target, ignore_errors=True)  # stale or partial: start clean
        fetchers[location.scheme](location, target)
        (target / MARKER).write_text(json.dumps(marker(location, target), indent=2) + "\n")
    logger.info("fetched %s@%s into %s", location.path, location.revision, target)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvserve.operator.fetch",
                                     description="Fill a weights cache once (init container).")
    parser.add_argument("--uri", default=None, help="hf://ORG/NAME[:REV], ORG/NAME or a name "
                        "`kvserve fetch-model` knows")
    parser.add_argument("--adapter", action="append", default=[],
                        help="a LoRA adapter, hf://ORG/NAME[:REV], into <cache>/adapters/ "
                             "(repeatable)")
    parser.add_argument("--revision", default=None, help="hub revision (default main)")
    parser.add_argument("--cache", required=True, type=Path, help="the mounted cache claim")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.uri is None and not args.adapter:
        print("fetch-weights: pass --uri and/or --adapter", file=sys.stderr)
        return 2
    try:
        if args.uri is not None:
            ensure(parse_model_uri(args.uri, args.revision), args.cache)
        for uri in args.adapter:
            location = parse_model_uri(uri)
            if location.scheme != "hf":
                raise InvalidSpecError(f"--adapter {uri}: only hub adapters are fetched")
            ensure(location, args.cache, kind="adapters")
    except (InvalidSpecError, RuntimeError, OSError) as exc:
        print(f"fetch-weights: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
