"""How many tokens to draft for each request: a draft at position j (1-based) is worth scoring
when its chance of being used, alpha^j (alpha: the request's measured per-token acceptance),
exceeds what one more token costs the step in output: b * throughput, where b is the step's
marginal seconds per scored token, fitted on recent steps (seconds ~ a + b * tokens), and
throughput is the output tokens per second of those steps. Both are taken over decoding steps
only (each seq scores its last token and its drafts): a prefill chunk's tokens are cheaper per
token (one large GEMM) and, hundreds at a time, they would set the fit's slope alone, so b
came out at the prefill's cost, well under what a scored draft costs. On a
CPU at batch 1 a forward costs about the same for one token or five (a >> b), so drafts are
scored freely; at batch 64 the forward is compute-bound and only drafts that are nearly sure
survive, so speculation does not cost throughput.

A step that scores any draft also costs a fixed amount beside its tokens (the drafted seqs'
attention runs as a chunk, not as a decode; the sampler's extra rows; the acceptance pass): the
fit is seconds ~ a + b * tokens + c * [the step scored drafts], and the drafts chosen per
request go into a step only when their expected worth together, sum of (alpha^j / throughput -
b) in seconds, exceeds c. At high concurrency many drafts share one c; a few marginal ones do
not pay for it, and the step decodes without drafts.

What the fit cannot see decides the rest at high load: a step without drafts launches while
the one before it runs (async scheduling) and a step with drafts runs in turn, and Python's
work per row. So above the per-request rule sits a measured one (ModeChooser): per batch size
(powers of two, taken at each epoch's start), epochs of EPOCH_STEPS decoding steps alternate
between drafting (the rule above) and plain decoding until each was tried MIN_EPOCHS times
(drafting first); then the mode that gave more
output tokens per wall second is kept, and the other is tried again every EXPLORE_EVERY
epochs, so a change of load or acceptance is seen. A bucket not measured yet whose mode the
measured ones imply (drafting won at a larger batch, or plain decoding at a smaller one) starts
in that mode and explores the other on the same one-in-EXPLORE_EVERY clock: a batch that
drains through the buckets as its requests finish does not pay two exploration epochs in each.
A drafting epoch in which no step drafted is booked as plain decoding (drafting stays untried).

An offline batch's tail is judged by another measure. While `LLM.generate` drains its own
requests and none waits (`drain`), a slot a request leaves is not refilled: the batch ends when
its slowest request does, so output tokens per second over-rate drafting (the requests the
proposer serves finish early, the one it finds nothing for decodes a token a step behind
dearer steps). Drain epochs are measured by how fast the largest budget left (max_tokens less
the output, over the running seqs) comes down per wall second, each step's fall capped at the
tokens one seq can gain in it (an end by EOS is luck, not speed), and booked apart from the
serving epochs. A server never drains: more requests may arrive at any step."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

DECAY = 0.8  # weight of a request's past acceptance per step
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0  # alpha starts at 0.5
PROBE_EVERY = 16  # a request drafted nothing this many steps: try one draft token
FIT_WINDOW = 256  # steps in the cost fit
MIN_TOKEN_SPREAD = 2.0  # the fit needs steps of different sizes (std of tokens per step)
MIN_EACH_KIND = 4  # c is fitted once this many steps with drafts and without are in the window
EPOCH_STEPS = 8  # decoding steps a mode is kept before the chooser looks again
MIN_EPOCHS = 1  # epochs of each mode, per batch size, before the better is kept
EXPLORE_EVERY = 16  # then one epoch in this many tries the other mode


@dataclass
class StreamAcceptance:
    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    idle_steps: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A step scored `num_drafts` drafts and accepted the first `num_accepted`: that many
        successes and one failure (unless all were accepted)."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + (num_accepted < num_drafts)


class StepCost:
    """seconds ~ a + b * tokens + c * drafted over the last FIT_WINDOW steps (least squares;
    c only once both steps with and without drafts are in the window, else 0). The fit is kept
    as the window's running sums and solved in plain Python (3 unknowns): a step costs a few
    microseconds. (numpy's lstsq over the window took ~0.2 ms a step inside the engine, where
    its LAPACK call meets torch's threads: 0.4% of a 64-seq step, for nothing.)"""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float, float]] = deque()
        self.sums = [0.0] * 8  # n, x, d, xx, xd, y, xy, dy (x: tokens, d: drafted, y: seconds)
        self.added = 0  # points added since the sums were last rebuilt (rounding drift)
        self.per_token = 0.0  # b: optimistic until steps of different sizes were seen
        self.per_verification = 0.0  # c: what scoring any draft adds to a step

    @staticmethod
    def _add(sums: list[float], x: float, d: float, y: float, sign: float = 1.0) -> None:
        for i, v in enumerate((1.0, x, d, x * x, x * d, y, x * y, d * y)):
            sums[i] += sign * v

    def observe(self, num_tokens: int, seconds: float, drafted: bool = False) -> None:
        point = (float(num_tokens), float(drafted), float(seconds))
        self.points.append(point)
        self._add(self.sums, *point)
        if len(self.points) > FIT_WINDOW:
            self._add(self.sums, *self.points.popleft(), sign=-1.0)
        self.added += 1
        if self.added >= FIT_WINDOW:  # rebuild from the window now and then: no drift
            self.sums = [0.0] * 8
            for q in self.points:
                self._add(self.sums, *q)
            self.added = 0
        n, x, d, xx, xd, y, xy, dy = self.sums
        sxx = xx - x * x / n if n else 0.0  # centred: n * variance of the step sizes
        if n < 8 or sxx < n * MIN_TOKEN_SPREAD ** 2:
            return
        sxy = xy - x * y / n
        if min(d, n - d) >= MIN_EACH_KIND - 0.5:
            # centred normal equations of (b, c): [sxx sxd; sxd sdd] [b c]' = [sxy sdy]'
            sxd, sdd, sdy = xd - x * d / n, d - d * d / n, dy - d * y / n
            det = sxx * sdd - sxd * sxd
            if det > 1e-9 * sxx * sdd:  # else sizes and drafting move together: b alone
                self.per_token = max((sxy * sdd - sdy * sxd) / det, 0.0)
                self.per_verification = max((sxx * sdy - sxd * sxy) / det, 0.0)
                return
        self.per_token = max(sxy / sxx, 0.0)
        self.per_verification = 0.0


class ModeChooser:
    """Drafting or plain decoding, per batch-size bucket (bit length of the running count), by
    output tokens per wall second measured over epochs of EPOCH_STEPS decoding steps (the wall
    time between step ends: overlap, scheduling and sampling included). Past epochs of a mode
    weigh half at each new one."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.rates: dict[tuple[int, bool], list[float]] = {}  # tokens, seconds, epochs
        self.drain_rates: dict[tuple[int, bool], list[float]] = {}  # budget fallen, seconds...
        self.drain = False  # this epoch measures a drain (the module doc)
        self.mixed = False  # a step of this epoch was of the other kind: it is not booked
        self.progress = 0.0  # a drain epoch's fall of the largest budget left
        self.critical: int | None = None  # the largest budget left after the last step
        self.drafting = True
        self.left = 0  # decoding steps left in this epoch
        self.epochs = 0  # epochs chosen by measurement (the exploration's clock)
        self.tokens = self.seconds = 0.0
        self.steps = self.seq_steps = 0  # decoding steps timed in this epoch, and their seqs
        self.drafted_steps = 0  # of which scored drafts
        self.last: float | None = None

    def drafts_allowed(self, batch: int, drain: bool = False) -> bool:
        """Whether a step of `batch` running seqs may draft (`drain`: in an offline batch's
        tail, judged apart: the module doc). A new epoch starts when the last
        one is over, its mode picked for the bucket of the batch then; what it measures goes to
        the bucket of the decoding steps it timed (their mean size: the batch may have grown
        or shrunk since; epochs cut short at every change would measure nothing). With nothing
        running no epoch starts (a run's first step, before its requests are admitted)."""
        if self.left <= 0 and batch > 0:
            self._close_epoch()
            self.left = EPOCH_STEPS
            self.drain = drain
            self.drafting = self._pick(batch.bit_length(), drain)
        return self.drafting

    def _table(self, drain: bool) -> dict[tuple[int, bool], list[float]]:
        return self.drain_rates if drain else self.rates

    def _pick(self, bucket: int, drain: bool = False) -> bool:
        """The mode of a new epoch in `bucket`: the better measured one (the other one epoch in
        EXPLORE_EVERY); else what the measured buckets imply; else the less tried."""
        rates = self._table(drain)
        d, p = rates.get((bucket, True)), rates.get((bucket, False))
        tried_d, tried_p = (d[2] if d else 0), (p[2] if p else 0)
        if min(tried_d, tried_p) >= MIN_EPOCHS:
            best = self._best(bucket, drain)
        else:
            implied = self._implied(bucket, drain)
            if implied is None:
                return tried_d <= tried_p  # the less tried, drafting first
            best = implied
        self.epochs += 1
        return (not best) if self.epochs % EXPLORE_EVERY == 0 else best

    def _best(self, bucket: int, drain: bool = False) -> bool:
        rates = self._table(drain)
        d, p = rates[(bucket, True)], rates[(bucket, False)]
        return d[0] * p[1] >= p[0] * d[1]

    def _implied(self, bucket: int, drain: bool = False) -> bool | None:
        """A draft costs a step more, relative to its work, the more seqs it holds, so drafting
        that won at a larger batch wins at this one, and plain decoding that won at a smaller
        batch wins at this one: a bucket the batch drains or grows into starts in that mode
        instead of exploring both (None: no measured bucket implies either, or they disagree)."""
        rates = self._table(drain)
        measured = {b: self._best(b, drain) for (b, _) in rates
                    if min(rates.get((b, True), [0, 0, 0])[2],
                           rates.get((b, False), [0, 0, 0])[2]) >= MIN_EPOCHS}
        draft = any(best and b > bucket for b, best in measured.items())
        plain = any(not best and b < bucket for b, best in measured.items())
        return None if draft == plain else draft

    def observe(self, decoding: bool, num_output_tokens: int, seconds: float,
                num_seqs: int = 1, drafted: bool = False, critical: int | None = None,
                max_gain: int = 1) -> None:
        """A step of `num_seqs` seqs ended (`drafted`: it scored drafts): decoding steps count
        toward the epoch (the gap since the previous step's end, unless the engine sat idle in
        between). `critical`: in a drain, the largest budget left after the step (None: not a
        drain); `max_gain`: the most tokens one seq could gain in the step (1 + its drafts)."""
        now = self.clock()
        gap = None if self.last is None else now - self.last
        self.last = now
        before, self.critical = self.critical, critical
        if not decoding or gap is None or gap > 3 * seconds + 0.05:
            return
        if (critical is not None) != self.drain:
            self.mixed = True
        elif critical is not None and before is not None:
            self.progress += min(max(before - critical, 0), max_gain)
        self.tokens += num_output_tokens
        self.seconds += gap
        self.steps += 1
        self.seq_steps += num_seqs
        self.drafted_steps += drafted
        self.left -= 1

    def _close_epoch(self) -> None:
        """Book the epoch: a drafting epoch in which no step drafted (the proposer found
        nothing, or no draft paid) decoded plainly and is booked as plain decoding, so drafting
        stays untried and is tried again (a first epoch of a new workload often drafts nothing:
        the n-gram proposer needs some output to match)."""
        if self.seconds > 0 and self.steps >= EPOCH_STEPS // 2 and not self.mixed:
            bucket = max(round(self.seq_steps / self.steps), 1).bit_length()
            mode = self.drafting and self.drafted_steps > 0
            r = self._table(self.drain).setdefault((bucket, mode), [0.0, 0.0, 0])
            done = self.progress if self.drain else self.tokens
            r[0], r[1], r[2] = 0.5 * r[0] + done, 0.5 * r[1] + self.seconds, r[2] + 1
        self.tokens = self.seconds = self.progress = 0.0
        self.steps = self.seq_steps = self.drafted_steps = 0
        self.mixed = False


class AdaptiveDrafts:
    """Per-request draft lengths from acceptance and the step cost (see the module doc)."""

    def __init__(self, max_tokens: int, enabled: bool = True) -> None:
        self.max_tokens = max_tokens
        self.enabled = enabled
        self.streams: dict[str, StreamAcceptance] = {}
        self.cost = StepCost()
        self.mode = ModeChooser()
        self.throughput = 0.0  # output tokens per second over the window's decoding steps
        self.outputs: deque[tuple[int, float]] = deque()
        self.output_sums = [0, 0.0]  # the window's output tokens and seconds

    def observe_step(self, num_tokens: int, num_output_tokens: int, seconds: float,
                     decoding: bool = True, drafted: bool = False, num_seqs: int = 1,
                     critical: int | None = None, max_gain: int = 1) -> None:
        """A finished step of `num_seqs` seqs: `decoding` when every seq scored only its last
        token and drafts (steps with a prefill chunk are left out of the cost and the
        throughput); `drafted` when it scored any draft; `critical` and `max_gain`: see
        ModeChooser.observe."""
        if seconds <= 0:
            return
        self.mode.observe(decoding, num_output_tokens, seconds, num_seqs, drafted, critical,
                          max_gain)
        if not decoding:
            return
        self.cost.observe(num_tokens, seconds, drafted)
        self.outputs.append((num_output_tokens, seconds))
        sums = self.output_sums
        sums[0], sums[1] = sums[0] + num_output_tokens, sums[1] + seconds
        if len(self.outputs) > FIT_WINDOW:
            n, t = self.outputs.popleft()
            sums[0], sums[1] = sums[0] - n, sums[1] - t
        self.throughput = sums[0] / sums[1] if sums[1] > 0 else 0.0

    def threshold(self) -> float:
        """The chance of use a draft token must have to pay for its place in the step."""
        return self.cost.per_token * self.throughput

    def drafts_allowed(self, batch: int, drain: bool = False) -> bool:
        """The measured mode for a step of `batch` running seqs (always, without adaptive)."""
        return not self.enabled or self.mode.drafts_allowed(batch, drain)

    def step_pays(self, chosen: list[tuple[str, int]]) -> bool:
        """Whether drafts of these lengths (stream, k) are worth a verification step: their
        expected seconds saved, sum over j <= k of alpha^j / throughput - b, exceed c."""
        if not self.enabled or self.cost.per_verification <= 0.0 or self.throughput <= 0.0:
            return True
        worth = 0.0
        for sid, k in chosen:
            alpha = self.streams[sid].alpha if sid in self.streams else \
                PRIOR_ACCEPTED / PRIOR_TRIALS
            worth += sum(alpha ** j for j in range(1, k + 1)) / self.throughput \
                - k * self.cost.per_token
        return worth > self.cost.per_verification

    def num_tokens(self, stream_id: str, threshold: float, look_ahead: bool = False) -> int:
        """Drafts to ask for this request now (0: none this step). `look_ahead`: asked for a
        step that async scheduling may launch without drafts (Speculator.would_draft): it
        counts as an idle step, but the one-token try stays due for the step that drafts."""
        if not self.enabled:
            return self.max_tokens
        s = self.streams.setdefault(stream_id, StreamAcceptance())
        k = _useful_length(s.alpha, threshold, self.max_tokens)
        if k == 0:
            s.idle_steps += 1
            if s.idle_steps >= PROBE_EVERY:
                if not look_ahead:
                    s.idle_steps = 0
                return 1
        return k

    def observe(self, stream_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts > 0:
            s = self.streams.setdefault(stream_id, StreamAcceptance())
            s.observe(num_drafts, num_accepted)
            s.idle_steps = 0

    def release(self, stream_id: str) -> None:
        self.streams.pop(stream_id, None)


def _useful_length(alpha: float, threshold: float, max_tokens: int) -> int:
    """The largest j <= max_tokens with alpha^j >= threshold."""
    if threshold <= 0.0 or alpha >= 1.0:
        return max_tokens
    if alpha <= 0.0 or threshold >= 1.0:
        return 0
    return max(0, min(max_tokens, int(math.log(threshold) / math.log(alpha))))
