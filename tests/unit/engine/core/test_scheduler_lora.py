"""`Scheduler.preempt_running`, the prefix-cache reset that also preempts the running requests
(mutation survivors, see docs/mutation.md; the adapter slots are tested in
tests/unit/lora/test_manager.py)."""

from __future__ import annotations

from test_scheduler import Sim, prompt

from kvserve.engine.core.sequence import SequenceStatus


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

