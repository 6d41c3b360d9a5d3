"""Scheduler paths main added with LoRA (mutation survivors, see docs/mutation.md):
`preempt_running`, the prefix-cache reset that also preempts the running requests, and an
adapter slot held across steps (one step's slots: tests/unit/lora/test_manager.py)."""

from __future__ import annotations

from test_scheduler import Sim, prompt

from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.core.sequence import Sequence, SequenceStatus
from kvserve.engine.sample.sampling_params import SamplingParams


def test_preempt_running_requeues_every_running_seq_oldest_first_and_frees_its_blocks():
    sim = Sim(num_blocks=32, max_num_seqs=4)
    seqs = [sim.add(prompt(6, 20 * i), max_tokens=5) for i in range(3)]
    sim.step()
    sim.step()
    assert sim.sched.preempt_running() == 3
    assert list(sim.sched.waiting) == seqs and sim.sched.running == []
    assert all(s.status == SequenceStatus.WAITING and s.num_computed_tokens == 0
               and s.num_preemptions == 1 for s in seqs)
    assert sim.sched.num_preemptions == 3 and sim.kv.num_free_blocks == 32
    assert sim.sched.preempt_running() == 0
    sim.run()
    assert len(sim.finished) == 3 and sim.kv.num_free_blocks == 32



def test_an_adapter_running_from_an_earlier_step_holds_its_slot():
    # One adapter slot: x has run since the first step, so y waits until x finishes.
    sim = Sim(num_blocks=64)
    sim.config = SchedulerConfig(8, 64, 1024, max_loras=1)
    sim.sched = Scheduler(sim.config, sim.kv)
    x = Sequence(1, "x", 0, prompt(4), SamplingParams(max_tokens=3), lora_name="x")
    sim.sched.add(x)
    sim.step()
    y = Sequence(2, "y", 0, prompt(4, 30), SamplingParams(max_tokens=2), lora_name="y")
    sim.sched.add(y)
    while x.status != SequenceStatus.FINISHED:
        assert y not in sim.step().seqs
    sim.run()
    assert y.status == SequenceStatus.FINISHED
