"""`kvserve plan` and `kvserve operator` through `register` on a plain argparse parser."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvserve.operator.cli import register
from kvserve.operator.crd import status_schema


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve")
    register(p.add_subparsers(dest="command", required=True))
    return p


def run(capsys: pytest.CaptureFixture, argv: list[str]) -> tuple[int, str, str]:
    args = parser().parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_json_keys_are_status_sizing(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, ["plan", "--model", "llama-2-7b", "--gpu", "A100-80GB",
                                "--max-model-len", "4096", "--gpu-memory-utilization", "0.9",
                                "--output", "json"])
    data = json.loads(out)
    assert code == 0
    assert set(status_schema()["properties"]["sizing"]["properties"]) <= set(data)
    assert (data["gpusPerReplica"], data["numBlocks"], data["maxConcurrency"]) == (1, 7541, 29)


def test_plan_table(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, ["plan", "--model", "llama-3-70b", "--gpu", "H100-80GB",
                                "--kv-cache-dtype", "fp8", "--max-num-seqs", "64"])
    assert code == 0
    rows = dict(line.split(None, 1) for line in out.splitlines() if line and "  " in line[:25])
    assert rows["gpusPerReplica"].strip() == "4"
    assert "4 x H100-80GB" in out


def test_plan_custom_architecture(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, ["plan", "--model", "mine", "--layers", "4", "--kv-heads", "2",
                                "--head-dim", "64", "--parameters", "1000000", "--gpu", "L4",
                                "--max-model-len", "1024", "--output", "json"])
    assert code == 0 and json.loads(out)["bytesPerBlock"] == 2 * 4 * 2 * 64 * 2 * 16


def test_plan_refusal_exits_2_with_the_reason(capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, ["plan", "--model", "llama-3-70b", "--gpu", "L4",
                                  "--max-gpus-per-replica", "2"])
    assert code == 2 and out == "" and "InsufficientGPUMemory" in err


def test_operator_scope_flags() -> None:
    args = parser().parse_args(["operator", "--namespace", "a", "--namespace", "b"])
    assert args.namespace == ["a", "b"] and not args.all_namespaces and callable(args.func)
    assert parser().parse_args(["operator", "--all-namespaces"]).all_namespaces
    with pytest.raises(SystemExit):
        parser().parse_args(["operator"])
    with pytest.raises(SystemExit):
        parser().parse_args(["operator", "--namespace", "a", "--all-namespaces"])


def test_operator_package_never_imports_torch() -> None:
    code = ("import sys, kvserve.operator.handlers, kvserve.operator.cli, "
            "kvserve.operator.__main__; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_module_entry_point_runs_plan() -> None:
    done = subprocess.run([sys.executable, "-m", "kvserve.operator", "plan", "--model",
                           "smollm2-135m", "--device", "cpu", "--memory", "4Gi", "--output",
                           "json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["gpusPerReplica"] == 0


def test_top_level_kvserve_cli_has_plan(capsys: pytest.CaptureFixture) -> None:
    from kvserve.service.cli import main

    code = main(["plan", "--model", "smollm2-135m", "--gpu", "L4", "--output", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["gpusPerReplica"] == 1 and data["weightDtype"] == "bfloat16"
