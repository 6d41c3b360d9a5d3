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
(powers of two, taken at each epoch's start), epochs of EPOCH_STEPS decoding steps alternate between drafting (the rule
above) and plain decoding until each was tried MIN_EPOCHS times; then the mode that gave more
output tokens per wall second is kept, and the other is tried again every EXPLORE_EVERY
epochs, so a change of load or acceptance is seen."""

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
MIN_EPOCHS = 2  # epochs of each mode, per batch size, before the better is kept
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
    c only once both steps with and without drafts are in the window, else 0)."""

    def __init__(self) -> None:
        self.points: deque[tuple[float, float, float]] = deque(maxlen=FIT_WINDOW)
        self.per_token = 0.0  # b: optimistic until steps of different sizes were seen
        self.per_verification = 0.0  # c: what scoring any draft adds to a step

    def observe(self, num_tokens: int, seconds: float, drafted: bool = False) -> None:
        self.points.append((float(num_tokens), float(drafted), seconds))
        if len(self.points) < 8:
            return
        data = np.array(self.points)
        if data[:, 0].std() < MIN_TOKEN_SPREAD:
            return
        both = min(data[:, 1].sum(), len(data) - data[:, 1].sum()) >= MIN_EACH_KIND
        cols = [np.ones(len(data)), data[:, 0]] + ([data[:, 1]] if both else [])
        coef = np.linalg.lstsq(np.stack(cols, axis=1), data[:, 2], rcond=None)[0]
        self.per_token = max(float(coef[1]), 0.0)
        self.per_verification = max(float(coef[2]), 0.0) if both else 0.0


class ModeChooser:
    """Drafting or plain decoding, per batch-size bucket (bit length of the running count), by
    output tokens per wall second measured over epochs of EPOCH_STEPS decoding steps (the wall
    time between step ends: overlap, scheduling and sampling included). Past epochs of a mode
    weigh half at each new one."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.rates: dict[tuple[int, bool], list[float]] = {}  # tokens, seconds, epochs
        self.bucket: int | None = None
        self.drafting = True
        self.left = 0  # decoding steps left in this epoch
        self.epochs = 0  # epochs chosen by measurement (the exploration's clock)
        self.tokens = self.seconds = 0.0
        self.last: float | None = None

    def drafts_allowed(self, batch: int) -> bool:
        """Whether a step of `batch` running seqs may draft. A new epoch starts when the last
        one is over, in the bucket of the batch then (a batch that shrinks or grows within an
        epoch stays in its bucket: epochs cut short at every finish would measure nothing)."""
        if self.left <= 0:
            self._close_epoch()
            self.bucket, self.left = max(batch, 1).bit_length(), EPOCH_STEPS
            self.drafting = self._pick(self.bucket)
        return self.drafting

    def _pick(self, bucket: int) -> bool:
        d, p = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        tried_d, tried_p = (d[2] if d else 0), (p[2] if p else 0)
        if min(tried_d, tried_p) < MIN_EPOCHS:
            return tried_d <= tried_p  # the less tried, drafting first
        self.epochs += 1
        best = d[0] * p[1] >= p[0] * d[1]  # type: ignore[index]
        return (not best) if self.epochs % EXPLORE_EVERY == 0 else best

    def observe(self, decoding: bool, num_output_tokens: int, seconds: float) -> None:
        """A step ended: decoding steps count toward the epoch (the gap since the previous
        step's end, unless the engine sat idle in between)."""
        now = self.clock()
        gap = None if self.last is None else now - self.last
        self.last = now
        if not decoding or gap is None or gap > 3 * seconds + 0.05:
            return
        self.tokens += num_output_tokens
        self.seconds += gap
        self.left -= 1

    def _close_epoch(self) -> None:
        if self.bucket is not None and self.seconds > 0 and self.left <= EPOCH_STEPS // 2:
            r = self.rates.setdefault((self.bucket, self.drafting), [0.0, 0.0, 0])
            r[0], r[1], r[2] = 0.5 * r[0] + self.tokens, 0.5 * r[1] + self.seconds, r[2] + 1
        self.tokens = self.seconds = 0.0


class AdaptiveDrafts:
    """Per-request draft lengths from acceptance and the step cost (see the module doc)."""

    def __init__(self, max_tokens: int, enabled: bool = True) -> None:
        self.max_tokens = max_tokens
        self.enabled = enabled
        self.streams: dict[str, StreamAcceptance] = {}
        self.cost = StepCost()
        self.mode = ModeChooser()
        self.throughput = 0.0  # output tokens per second over the window's decoding steps
        self.outputs: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)

    def observe_step(self, num_tokens: int, num_output_tokens: int, seconds: float,
                     decoding: bool = True, drafted: bool = False) -> None:
        """A finished step: `decoding` when every seq scored only its last token and drafts
        (steps with a prefill chunk are left out of the cost and the throughput); `drafted`
        when it scored any draft."""
        if seconds <= 0:
            return
        self.mode.observe(decoding, num_output_tokens, seconds)
        if not decoding:
            return
        self.cost.observe(num_tokens, seconds, drafted)
        self.outputs.append((num_output_tokens, seconds))
        self.throughput = sum(n for n, _ in self.outputs) / sum(t for _, t in self.outputs)

    def threshold(self) -> float:
        """The chance of use a draft token must have to pay for its place in the step."""
        return self.cost.per_token * self.throughput

    def drafts_allowed(self, batch: int) -> bool:
        """The measured mode for a step of `batch` running seqs (always, without adaptive)."""
        return not self.enabled or self.mode.drafts_allowed(batch)

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
