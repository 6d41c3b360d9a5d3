"""Scheduling policies (vLLM's `--scheduling-policy`): "fcfs" serves in arrival order and preempts
the newest running sequence; "priority" serves the lowest `priority` value first (ties by
arrival) and preempts the running sequence with the highest value (the newest among equals)."""

from __future__ import annotations

from collections import deque

from kvserve.engine.core.sequence import Sequence

POLICIES = ("fcfs", "priority")


def order_key(seq: Sequence) -> tuple[int, float, int]:
    return (seq.priority, seq.arrival_time, seq.seq_id)


def add_waiting(waiting: deque[Sequence], seq: Sequence, policy: str, front: bool = False) -> None:
    """Queue `seq`: FCFS at the back (or the front: a preempted seq goes first again); by
    priority, at its place in (priority, arrival) order, wherever it comes from."""
    if policy == "fcfs":
        waiting.appendleft(seq) if front else waiting.append(seq)
        return
    key = order_key(seq)
    for i, other in enumerate(waiting):
        if key < order_key(other):
            waiting.insert(i, seq)
            return
    waiting.append(seq)


def victim(running: list[Sequence], policy: str) -> Sequence:
    """The running sequence to preempt when blocks run out."""
    return running[-1] if policy == "fcfs" else max(running, key=order_key)
