"""EngineLoRAs (the engine's LoRA facade): an engine without enable_lora refuses adapters with
the error a caller can act on; with a manager, requests get their adapter read on first use,
each step's rows their slots (-1: the base model), and a busy adapter is not removed."""

from __future__ import annotations

import pytest
from kvserve.engine.errors import ConfigError, InvalidRequestError, LoRAError
from kvserve.lora.config import LoRAConfig
from kvserve.lora.engine_loras import EngineLoRAs
from kvserve.lora.manager import LoRAManager
from kvserve.lora.request import LoRARequest
from test_manager import write_adapter


def test_without_enable_lora_every_use_is_refused_and_listings_are_empty():
    loras = EngineLoRAs()
    assert loras.list() == [] and loras.resident() == []
    assert loras.name_for(None) is None and loras.slots([None, None], []) is None
    with pytest.raises(InvalidRequestError) as err:
        loras.name_for(LoRARequest("a", 1, "/nowhere"))
    assert err.value.param == "lora_request"
    for call in (lambda: loras.add(LoRARequest("a", 1, "/nowhere")),
                 lambda: loras.remove("a", []), lambda: loras.get("a")):
        with pytest.raises(ConfigError, match="enable_lora"):
            call()


def test_requests_read_their_adapter_and_steps_get_slots(tmp_path):
    loads: list = []
    loras = EngineLoRAs(LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2),
                                    lambda slot, w: loads.append((slot, w and w.name)),
                                    lambda w: None))
    a = LoRARequest("a", 1, write_adapter(tmp_path / "a"))
    b = LoRARequest("b", 2, write_adapter(tmp_path / "b"))
    assert loras.name_for(a) == "a" and loras.list() == [a]  # read on the request's arrival
    assert loras.slots([None, "a", None], running=["a"]) == [-1, 0, -1]
    assert loras.add(b) and not loras.add(b)  # the same adapter twice: already loaded
    assert loras.slots(["b", "a"], running=["a", "b"]) == [1, 0]
    assert loads == [(0, "a"), (1, "b")] and loras.resident() == ["b", "a"]  # LRU order
    with pytest.raises(LoRAError):
        loras.remove("a", busy=["a"])
    assert loras.remove(2, busy=["a"]) and loras.get("a") == a and loras.list() == [a]
