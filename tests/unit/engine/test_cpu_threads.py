"""libgomp's short spin for kvserve's processes (engine/cpu_threads.py): set at `import kvserve`
before torch is loaded, in the environment of the engine core process, and never over a choice
of the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.engine.cpu_threads import (OPT_OUT_ENV, SPIN_DEFAULT, SPIN_ENV,
                                        spin_default_for_children)

PRINT = "import os, sys; print(os.environ.get('GOMP_SPINCOUNT'))"


def _child(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in (SPIN_ENV, OPT_OUT_ENV, "OMP_WAIT_POLICY")}
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
