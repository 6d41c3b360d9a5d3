"""vLLM's profiler_config: the dict, JSON text, kvserve.config.ProfilerConfig or any object with
vLLM's field names; LLM.start_profile()/stop_profile() write the torch trace to its folder."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from conftest import make_llm
from kvserve import SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.errors import ConfigError


def test_profiler_config_forms_and_refusals(tmp_path):
    from kvserve.config import ProfilerConfig

    want = ProfilerConfig("torch", str(tmp_path), torch_profiler_use_gzip=False)
    given = [{"profiler": "torch", "torch_profiler_dir": str(tmp_path),
              "torch_profiler_use_gzip": False}, want,
             json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path),
                         "torch_profiler_use_gzip": False}),
             SimpleNamespace(profiler="torch", torch_profiler_dir=str(tmp_path),
                             torch_profiler_use_gzip=False)]
    assert all(EngineConfig(profiler_config=g).profiler_config == want for g in given)
    assert EngineConfig().profiler_config is None
    for bad, message in (({"profiler": "cuda"}, "torch profiler"),
                         ({"profiler": "torch"}, "torch_profiler_dir"),
                         ({"profiler": "torch", "torch_profiler_dir": "d", "delay_iterations": 2},
                          "delay_iterations")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig(profiler_config=bad)


def test_llm_profiler_config_writes_a_gzipped_trace_to_its_folder(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """vLLM's examples/features/profiling/simple_profiling_offline.py, on the tiny model."""
    for name in ("KVSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "vllm_profile"
    llm = make_llm(tiny_model_dir, profiler_config={"profiler": "torch",
                                                    "torch_profiler_dir": str(folder)})
    llm.start_profile()
    llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=3),
                 use_tqdm=False)
    llm.stop_profile()
    traces = list(folder.glob("*.pt.trace.json.gz"))  # vLLM's default: gzip
    assert len(traces) == 1
    events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    assert "aten::embedding" in {e.get("name") for e in events}
    assert any(e.get("args", {}).get("Python id") is not None or "stack" in e.get("args", {})
               or e.get("cat") == "python_function" for e in events)  # with_stack: vLLM's default
