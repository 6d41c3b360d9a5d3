"""Adaptive draft lengths: the cost fit, the acceptance estimate, and the rule between them."""

from __future__ import annotations

from kvserve.engine.spec_decode.adaptive import (PROBE_EVERY, AdaptiveDrafts, StepCost,
                                                 _useful_length)


def test_useful_length():
    assert _useful_length(0.9, 0.0, 5) == 5  # free tokens: the most
    assert _useful_length(0.5, 0.2, 5) == 2  # 0.5^2 = 0.25 >= 0.2 > 0.125
    assert _useful_length(0.3, 0.9, 5) == 0
    assert _useful_length(1.0, 0.9, 5) == 5


def test_step_cost_fit():
    cost = StepCost()
    for tokens in [1, 2, 4, 8, 16, 32] * 3:
        cost.observe(tokens, 0.030 + 0.002 * tokens)
    assert abs(cost.per_token - 0.002) < 1e-6


def test_drafts_shrink_when_rejected_and_probe_again():
    a = AdaptiveDrafts(max_tokens=4)
    threshold = 0.3
    assert a.num_tokens("r", threshold) == 1  # prior alpha 0.5: 0.5 >= 0.3 > 0.25
    for _ in range(10):
        a.observe("r", 1, 0)
    assert a.num_tokens("r", threshold) == 0
    counts = [a.num_tokens("r", threshold) for _ in range(PROBE_EVERY)]
    assert counts.count(1) == 1  # one probe in PROBE_EVERY steps
    for _ in range(30):
        a.observe("r", 4, 4)
    assert a.num_tokens("r", threshold) == 4


def test_off_when_not_adaptive():
    a = AdaptiveDrafts(max_tokens=3, enabled=False)
    a.observe("r", 3, 0)
    assert a.num_tokens("r", 0.99) == 3


def test_prefill_steps_leave_the_fit_and_the_throughput():
    """A prefill chunk's tokens cost less each than scored drafts: were they fitted, the slope
    would be the prefill's (here 1 ms) instead of the decoding steps' (3 ms)."""
    a = AdaptiveDrafts(max_tokens=4)
    for tokens in [8, 12, 16, 24] * 4:
        a.observe_step(tokens, 8, 0.030 + 0.003 * tokens)
        a.observe_step(500, 8, 0.030 + 0.001 * 500, decoding=False)
    assert abs(a.cost.per_token - 0.003) < 1e-6
    decoding_seconds = sum(0.030 + 0.003 * t for t in [8, 12, 16, 24])
    assert abs(a.throughput - 32 / decoding_seconds) < 1e-6
    assert abs(a.threshold() - 0.003 * 32 / decoding_seconds) < 1e-9


def test_fit_separates_the_verification_cost():
    """Steps with drafts cost c = 40 ms more beside their tokens: the fit finds b and c."""
    cost = StepCost()
    for tokens in [8, 12, 16, 24, 32, 40] * 3:
        cost.observe(tokens, 0.030 + 0.002 * tokens)
        cost.observe(tokens + 8, 0.030 + 0.002 * (tokens + 8) + 0.040, drafted=True)
    assert abs(cost.per_token - 0.002) < 1e-6
    assert abs(cost.per_verification - 0.040) < 1e-6


def test_no_verification_cost_until_both_kinds_of_step_were_seen():
    cost = StepCost()
    for tokens in [8, 12, 16, 24, 32, 40] * 3:
        cost.observe(tokens, 0.070 + 0.002 * tokens, drafted=True)
    assert abs(cost.per_token - 0.002) < 1e-6 and cost.per_verification == 0.0


def test_a_step_drafts_only_when_its_drafts_pay_for_the_verification():
    a = AdaptiveDrafts(max_tokens=4)
    a.cost.per_token, a.cost.per_verification, a.throughput = 0.002, 0.040, 100.0
    for sid in ("x", "y"):
        for _ in range(20):
            a.observe(sid, 4, 4)  # alpha near 1
    # each draft: alpha^j / 100 - 0.002 ~ 8 ms saved; 4 of them ~ 32 ms < 40 ms
    assert not a.step_pays([("x", 4)])
    assert a.step_pays([("x", 4), ("y", 4)])  # ~ 64 ms > 40 ms
    a.cost.per_verification = 0.0  # not fitted yet: drafts go in as chosen
    assert a.step_pays([("x", 1)])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_epochs(chooser, clock, batch: int, epochs: int, seconds: dict[bool, float],
               tokens: dict[bool, int]) -> list[bool]:
    """Drive `epochs` epochs of decoding steps; each mode's step takes seconds[mode] and yields
    tokens[mode]. Returns the mode of each epoch."""
    from kvserve.engine.spec_decode.adaptive import EPOCH_STEPS

    modes = []
    for _ in range(epochs):
        mode = chooser.drafts_allowed(batch)
        modes.append(mode)
        for _ in range(EPOCH_STEPS):
            assert chooser.drafts_allowed(batch) == mode  # kept for the whole epoch
            clock.now += seconds[mode]
            chooser.observe(True, tokens[mode], seconds[mode], batch, drafted=mode)
    return modes


def test_mode_chooser_keeps_the_faster_mode_and_explores():
    from kvserve.engine.spec_decode.adaptive import EXPLORE_EVERY, MIN_EPOCHS, ModeChooser

    clock = FakeClock()
    chooser = ModeChooser(clock)
    chooser.observe(False, 0, 0.1)  # a prefill step first: no gap yet
    # drafting: 64 tokens in 0.25 s (256/s); plain: 64 in 0.2 s (320/s)
    modes = run_epochs(chooser, clock, 64, 2 * MIN_EPOCHS + EXPLORE_EVERY,
                       {True: 0.25, False: 0.2}, {True: 64, False: 64})
    assert modes[:2 * MIN_EPOCHS] == [True, False] * MIN_EPOCHS  # both tried, drafting first
    kept = modes[2 * MIN_EPOCHS:]
    assert kept.count(False) == EXPLORE_EVERY - 1 and kept.count(True) == 1  # one exploration
    # at batch 1 drafting pays (3 tokens a step for 1.1x the time): its own bucket learns it
    modes = run_epochs(chooser, clock, 1, 2 * MIN_EPOCHS + 4, {True: 0.055, False: 0.05},
                       {True: 3, False: 1})
    assert modes[2 * MIN_EPOCHS:] == [True] * 4


def test_mode_chooser_skips_idle_gaps():
    """A gap far past the step's own time (the engine had nothing to do) is not counted."""
    from kvserve.engine.spec_decode.adaptive import EPOCH_STEPS, ModeChooser

    clock = FakeClock()
    chooser = ModeChooser(clock)
    chooser.drafts_allowed(8)
    chooser.observe(True, 8, 0.1)  # the first end: no gap to measure
    clock.now += 30.0
    chooser.observe(True, 8, 0.1)  # idle for 30 s
    assert chooser.left == EPOCH_STEPS and chooser.seconds == 0.0
    clock.now += 0.1
    chooser.observe(True, 8, 0.1)
    assert chooser.left == EPOCH_STEPS - 1 and abs(chooser.seconds - 0.1) < 1e-9


def test_not_adaptive_always_drafts():
    a = AdaptiveDrafts(max_tokens=3, enabled=False)
    assert all(a.drafts_allowed(64) for _ in range(100))


def test_running_fit_equals_the_windows_least_squares():
    """The running sums forget what left the window: after 3 windows of steps whose costs
    change halfway, the fit is the least-squares solution of the last FIT_WINDOW steps."""
    import numpy as np

    from kvserve.engine.spec_decode.adaptive import FIT_WINDOW

    rng = np.random.default_rng(0)
    cost = StepCost()
    points = []
    for i in range(3 * FIT_WINDOW + 17):
        tokens, drafted = int(rng.integers(8, 300)), bool(rng.random() < 0.4)
        b, c = (0.001, 0.010) if i < 2 * FIT_WINDOW else (0.003, 0.025)
        seconds = 0.02 + b * tokens + c * drafted + float(rng.normal(0, 1e-3))
        cost.observe(tokens, seconds, drafted)
        points.append((tokens, drafted, seconds))
    data = np.array(points[-FIT_WINDOW:], dtype=float)
    design = np.stack([np.ones(FIT_WINDOW), data[:, 0], data[:, 1]], axis=1)
    coef = np.linalg.lstsq(design, data[:, 2], rcond=None)[0]
    assert abs(cost.per_token - coef[1]) < 1e-9 and abs(cost.per_verification - coef[2]) < 1e-9
    assert abs(cost.per_token - 0.003) < 2e-4  # the old steps are gone


def test_throughput_is_the_windows():
    from kvserve.engine.spec_decode.adaptive import FIT_WINDOW

    a = AdaptiveDrafts(max_tokens=4)
    for _ in range(FIT_WINDOW):
        a.observe_step(64, 64, 0.1)
    for _ in range(FIT_WINDOW):
        a.observe_step(64, 32, 0.1)  # half the output per step from now on
    assert abs(a.throughput - 320.0) < 1e-6


def test_buckets_the_batch_drains_into_inherit_what_is_implied():
    """Drafting won at 8 seqs: at 5 it starts drafting, without a plain exploration first;
    plain won at 64: at 200 it starts plain. At 24 (between the two: nothing implied) both
    modes are tried. An inherited bucket still tries the other mode one epoch in
    EXPLORE_EVERY."""
    from kvserve.engine.spec_decode.adaptive import EXPLORE_EVERY, MIN_EPOCHS, ModeChooser

    clock = FakeClock()
    chooser = ModeChooser(clock)
    chooser.observe(False, 0, 0.1)
    fast_drafts = ({True: 0.055, False: 0.05}, {True: 24, False: 8})
    slow_drafts = ({True: 0.25, False: 0.2}, {True: 64, False: 64})
    assert run_epochs(chooser, clock, 8, 2 * MIN_EPOCHS, *fast_drafts) == \
        [True, False] * MIN_EPOCHS
    assert run_epochs(chooser, clock, 64, 2 * MIN_EPOCHS, *slow_drafts) == \
        [True, False] * MIN_EPOCHS
    assert run_epochs(chooser, clock, 5, 3, *fast_drafts) == [True] * 3
    assert run_epochs(chooser, clock, 200, 3, *slow_drafts) == [False] * 3
    assert run_epochs(chooser, clock, 24, 2 * MIN_EPOCHS, *fast_drafts) == \
        [True, False] * MIN_EPOCHS
    modes = run_epochs(chooser, clock, 5, EXPLORE_EVERY, *fast_drafts)
    assert modes.count(False) == 1  # the inherited bucket explored plain decoding once
    assert chooser.rates[(3, False)][2] == 1 and chooser._best(3)  # and measured drafting won


def test_an_epoch_is_measured_in_the_bucket_of_the_steps_it_timed():
    """A run's first epoch starts before its requests are admitted (nothing running: no epoch)
    or while few are: its steps of 8 seqs are measured as 8's, not as the 1 it started at."""
    from kvserve.engine.spec_decode.adaptive import EPOCH_STEPS, ModeChooser

    clock = FakeClock()
    chooser = ModeChooser(clock)
    chooser.observe(False, 0, 0.1)
    assert chooser.drafts_allowed(0) and chooser.left <= 0  # nothing running: no epoch yet
    assert chooser.drafts_allowed(1) and chooser.left == EPOCH_STEPS
    for _ in range(EPOCH_STEPS):
        clock.now += 0.02
        chooser.observe(True, 8, 0.02, 8, drafted=True)
    chooser.drafts_allowed(8)  # the next epoch: the first one is closed
    assert list(chooser.rates) == [(4, True)]  # 8 seqs: bucket 4 (bit length)
    assert abs(chooser.rates[(4, True)][0] / chooser.rates[(4, True)][1] - 400.0) < 1e-6


def test_a_drafting_epoch_without_drafts_is_booked_as_plain_and_drafting_is_tried_again():
    """The proposer found nothing in the first epoch (a new workload: no output to match
    yet): that epoch decoded plainly, so it does not count against drafting."""
    from kvserve.engine.spec_decode.adaptive import EPOCH_STEPS, ModeChooser

    clock = FakeClock()
    chooser = ModeChooser(clock)
    chooser.observe(False, 0, 0.1)
    modes = []
    for drafted in (False, False, True):
        modes.append(chooser.drafts_allowed(4))
        for _ in range(EPOCH_STEPS):
            clock.now += 0.01
            chooser.observe(True, 4, 0.01, 4, drafted=drafted and modes[-1])
    chooser.drafts_allowed(4)
    assert modes == [True, True, True]  # drafting kept until it was really tried
    assert chooser.rates[(3, False)][2] == 2 and chooser.rates[(3, True)][2] == 1


def drain_epochs(chooser, clock, batch: int, epochs: int, seconds: dict[bool, float],
                 tokens: dict[bool, int], falls: dict[bool, int], budget: int = 10_000
                 ) -> list[bool]:
    """As run_epochs, in an offline batch's tail: each step also brings the largest budget
    left down by falls[mode]."""
    from kvserve.engine.spec_decode.adaptive import EPOCH_STEPS

    modes = []
    for _ in range(epochs):
        mode = chooser.drafts_allowed(batch, drain=True)
        modes.append(mode)
        for _ in range(EPOCH_STEPS):
            clock.now += seconds[mode]
            budget -= falls[mode]
            chooser.observe(True, tokens[mode], seconds[mode], batch, drafted=mode,
                            critical=budget, max_gain=5 if mode else 1)
    return modes


def test_an_offline_tail_is_judged_by_its_slowest_request():
    """Drafting doubles the output per step for 1.25x the time (more tokens per second), but
    the request with the most left gains one token a step either way: in serving, drafting
    wins; in an offline batch's tail plain decoding does, booked apart from serving."""
    from kvserve.engine.spec_decode.adaptive import MIN_EPOCHS, ModeChooser

    steps = ({True: 0.25, False: 0.2}, {True: 128, False: 64})
    choosers = [ModeChooser(clock) for clock in (FakeClock(), FakeClock(), FakeClock())]
    for chooser in choosers:
        chooser.observe(False, 0, 0.1)
    serving, offline, later = choosers
    assert run_epochs(serving, serving.clock, 64, 2 * MIN_EPOCHS + 4, *steps) == \
        [True, False] * MIN_EPOCHS + [True] * 4
    modes = drain_epochs(offline, offline.clock, 64, 2 * MIN_EPOCHS + 4, *steps,
                         {True: 1, False: 1})
    assert modes == [True, False] * MIN_EPOCHS + [False] * 4
    assert not offline.rates and set(offline.drain_rates) == {(7, True), (7, False)}
    # where drafting moves the slowest request 3 tokens a step, the tail drafts
    modes = drain_epochs(later, later.clock, 64, 2 * MIN_EPOCHS + 4, *steps, {True: 3, False: 1})
    assert modes == [True, False] * MIN_EPOCHS + [True] * 4


def test_a_tail_step_counts_no_more_than_one_seq_can_gain():
    """The request with the most left ending by EOS drops the largest budget by dozens: the
    step counts 1 + its drafts (luck is not speed), and an epoch that began in serving and
    ended in the tail is not booked at all."""
    from kvserve.engine.spec_decode.adaptive import EPOCH_STEPS, ModeChooser

    clock = FakeClock()
    chooser = ModeChooser(clock)
    chooser.observe(False, 0, 0.1, critical=100)
    assert chooser.drafts_allowed(8, drain=True) and chooser.drain
    for budget in (99, 60, 59, 58, 57, 56, 55, 54):
        clock.now += 0.1
        chooser.observe(True, 8, 0.1, 8, drafted=False, critical=budget, max_gain=1)
    assert chooser.progress == EPOCH_STEPS  # 1 a step, the fall of 39 counted as 1
    chooser.drafts_allowed(8)
    fell, seconds, _ = chooser.drain_rates[(4, False)]  # no step drafted: booked as plain
    assert fell == EPOCH_STEPS and abs(seconds - EPOCH_STEPS * 0.1) < 1e-9
    chooser.left = 0
    assert chooser.drafts_allowed(8, drain=False) and not chooser.drain  # serving: untried
    for k in range(EPOCH_STEPS):  # ... the queue empties halfway through
        clock.now += 0.1
        chooser.observe(True, 8, 0.1, 8, critical=50 - k if k >= 4 else None)
    chooser.drafts_allowed(8)
    assert not chooser.rates and chooser.drain_rates[(4, False)][2] == 1
