"""LoRAManager: the LRU of device slots never evicts an adapter with running requests, the host
LRU keeps max_cpu_loras adapters and reads the others again; the scheduler admits at most
max_loras adapters among running requests."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.lora.adapter import load_adapter
from kvserve.lora.config import LoRAConfig
from kvserve.lora.manager import LoRAManager
from kvserve.lora.request import LoRARequest


def write_adapter(folder, r=2, alpha=4, rslora=False):
    """A PEFT-format folder with one module (layer 0's q_proj, 8 -> 8)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": rslora,
         "target_modules": ["q_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.ones(r, 8),
               f"{key}.lora_B.weight": torch.ones(8, r)}, str(folder / "adapter_model.safetensors"))
    return str(folder)


@pytest.fixture
def manager(tmp_path):
    loads: list = []
    m = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=3),
                    lambda slot, w: loads.append((slot, w.name if w else None)), lambda w: None)
    for i in range(5):
        m.add(LoRARequest(f"a{i}", i + 1, write_adapter(tmp_path / f"a{i}")))
    m.loads = loads
    return m


def test_scaling_alpha_over_r_and_rslora(tmp_path):
    plain = load_adapter("p", write_adapter(tmp_path / "p", r=4, alpha=8), max_rank=8)
    rs = load_adapter("r", write_adapter(tmp_path / "r", r=4, alpha=8, rslora=True), max_rank=8)
    (_, b_plain), = plain.modules.values()
    (_, b_rs), = rs.modules.values()
    assert float(b_plain[0, 0]) == 2.0 and float(b_rs[0, 0]) == 4.0  # 8/4 and 8/sqrt(4)


def test_host_lru_keeps_max_cpu_loras(manager):
    assert list(manager.host) == ["a2", "a3", "a4"]
    manager.activate(["a0"], busy=[])  # read from its folder again
    assert list(manager.host) == ["a3", "a4", "a0"] and manager.slots == {"a0": 0}


def test_slots_evict_the_least_recently_used_idle_adapter(manager):
    manager.activate(["a0", "a1"], busy=[])
    manager.activate(["a0"], busy=["a0"])  # a0 used last
    slots = manager.activate(["a2"], busy=["a0"])
    assert slots == {"a2": 1} and "a1" not in manager.slots
    # a2 is the least recently used now, but it runs: a0 goes instead
    slots = manager.activate(["a3"], busy=["a2"])
    assert slots == {"a3": 0} and set(manager.slots) == {"a2", "a3"}
    with pytest.raises(RuntimeError, match="running requests"):
        manager.activate(["a4"], busy=["a2", "a3"])
    assert manager.loads[-1] == (0, "a3")


def test_remove_frees_the_slot_and_refuses_while_busy(manager):
    manager.activate(["a0"], busy=[])
    with pytest.raises(Exception, match="in flight"):
        manager.remove("a0", busy=["a0"])
    assert manager.remove("a0") and manager.loads[-1] == (0, None)
    assert "a0" not in manager.resident() and manager.remove("a0") is False


def test_scheduler_admits_at_most_max_loras_adapters():
    kv = KVCacheManager(64, 16, True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                      max_model_len=128, max_loras=2), kv)
    params = SamplingParams(max_tokens=4)
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], params, lora_name=name)
            for i, name in enumerate(["x", "y", "z", None, "x"])]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.lora_name for s in out.seqs] == ["x", "y", None, "x"]  # z waits for a slot
    assert [s.lora_name for s in sched.waiting] == ["z"]
    sched.finish(seqs[1])  # y's only request is done: z may start
    out = sched.schedule()
    assert seqs[2] in out.seqs
