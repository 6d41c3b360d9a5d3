"""libgomp's short spin for kvserve's processes (engine/cpu_threads.py): set at `import kvserve`
before torch is loaded, in the environment of the engine core process, and never over a choice
of the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.engine.cpu_threads import (OPT_OUT_ENV, SPIN_DEFAULT, SPIN_ENV, cpu_quota,
                                        rank_threads, spin_default_for_children, usable_cpus)
from kvserve.engine.worker.startup import size_torch_threads

PRINT = "import os, sys; print(os.environ.get('GOMP_SPINCOUNT'))"


def _child(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in (SPIN_ENV, OPT_OUT_ENV, "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_import_kvserve_first_sets_the_short_spin():
    assert _child("import kvserve; " + PRINT) == SPIN_DEFAULT


@pytest.mark.parametrize("env, want", [({SPIN_ENV: "50000"}, "50000"),
                                       ({"OMP_WAIT_POLICY": "ACTIVE"}, "None"),
                                       ({OPT_OUT_ENV: "0"}, "None")])
def test_the_users_choice_is_kept(env, want):
    assert _child("import kvserve; " + PRINT, **env) == want


def test_too_late_once_torch_is_loaded():
    """libgomp read its settings when torch loaded it: setting the variable then would only
    mislead whoever reads the environment."""
    assert _child("import torch, kvserve; " + PRINT) == "None"


def test_a_script_importing_torch_first_is_told_at_engine_start(tiny_model_dir):
    code = ("import torch, logging\nlogging.basicConfig()\nfrom kvserve import LLM\n"
            f"LLM(model={str(tiny_model_dir)!r}, dtype='float32', kv_cache_memory=1 << 22,"
            " max_model_len=128)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items()
                                           if k not in (SPIN_ENV, OPT_OUT_ENV)})
    assert out.returncode == 0, out.stderr
    assert "long spin-wait (torch was imported before kvserve)" in out.stderr
    assert f"{SPIN_ENV}={SPIN_DEFAULT}" in out.stderr
    quiet = subprocess.run([sys.executable, "-c", code.replace("import torch, ", "import ")],
                           capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in os.environ.items()
                                if k not in (SPIN_ENV, OPT_OUT_ENV)})
    assert quiet.returncode == 0 and "long spin-wait" not in quiet.stderr


def test_children_start_with_it_and_this_process_is_left_as_it_was(monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv(OPT_OUT_ENV, raising=False)
    with spin_default_for_children():
        assert os.environ[SPIN_ENV] == SPIN_DEFAULT
    assert SPIN_ENV not in os.environ
    monkeypatch.setenv(SPIN_ENV, "7")
    with spin_default_for_children():
        assert os.environ[SPIN_ENV] == "7"
    assert os.environ[SPIN_ENV] == "7"


# ---------------------------------------------------------------------------- thread count

def _tree(tmp_path, cgroup_lines: str, files: dict[str, str]):
    """A /proc/self/cgroup and a cgroup mount of real files under tmp_path."""
    proc, mount = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    for rel, text in files.items():
        (mount / rel).parent.mkdir(parents=True, exist_ok=True)
        (mount / rel).write_text(text)
    return proc, mount


def test_v2_quota_is_the_tightest_level(tmp_path):
    proc, mount = _tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "250000 100000\n",
        "kubepods/pod1/ctr/cpu.max": "400000 100000\n"})
    cpus, why = cpu_quota(proc, mount)
    assert cpus == 2.5 and "v2" in why and why.endswith("pod1")
    assert usable_cpus(proc, mount)[0] == min(2, len(os.sched_getaffinity(0)))


def test_v1_quota_and_no_quota(tmp_path):
    proc, mount = _tree(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(proc, mount)[0] == 1.5
    proc2, mount2 = _tree(tmp_path / "none", "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpu_quota(proc2, mount2) is None
    assert usable_cpus(proc2, mount2)[0] == len(os.sched_getaffinity(0))


def test_ranks_share_the_usable_cpus_and_omp_num_threads_wins(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert rank_threads(1, (8, "quota"))[0] == 8
    assert rank_threads(3, (8, "quota"))[0] == 2
    assert rank_threads(16, (8, "quota"))[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert rank_threads(3, (8, "quota")) == (5, "OMP_NUM_THREADS")


def test_torch_threads_lowered_to_the_quota_never_raised(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert size_torch_threads(1, (2, "a 2-CPU quota")) == 2
        assert size_torch_threads(1, (64, "a big node")) == 2  # lowered only
        assert size_torch_threads(2, (8, "quota")) == 4  # a rank's share, either way
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to narrow to 1")
def test_an_engine_started_on_a_narrower_mask_uses_its_cpus(tiny_model_dir):
    """The affinity mask narrowed after torch chose its threads (as a container's would be
    at its start, before the quota is read): the engine lowers torch to the CPUs it has."""
    code = (
        "import os, torch\n"
        "torch.set_num_threads(2)\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "from kvserve import LLM\n"
        f"LLM(model={str(tiny_model_dir)!r}, dtype='float32', kv_cache_memory=1 << 22,"
        " max_model_len=128)\n"
        "print(torch.get_num_threads())\n")
    assert _child(code).splitlines()[-1] == "1"
