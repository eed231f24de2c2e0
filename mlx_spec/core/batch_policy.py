"""A batch's draft length: `BatchController` picks one k for all rows of a batch.

A batch (batch.py) verifies B x (k+1) rows in one pass: the pass gets dearer as B grows (on the
Linux CPU with OpenBLAS 8 rows cost ~1.3x one in float32, ~8x in bfloat16), so the k that pays
shrinks with B and reaches 0 (plain continuous batching) where drafting no longer pays.

A row whose suffix match supports a long lookup draft (drafters/suffix.py) is not bound by
that k: `lookup_width` widens the pass where the rows' lookups pay for it, by the same pass
costs (`BatchController.pass_seconds`) and lookup_length.py's acceptance per match length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .lookup_length import expected_tokens as lookup_tokens
from .policies import (
    ACCEPT_MEMORY,
    EXPLORE_EVERY,
    K_MAX,
    PRIOR_ACCEPTANCE,
    PRIOR_VERIFY_SLOPE,
    PROBE_MAX_INTERVAL,
    Estimate,
    expected_tokens,
)

PROBE_ROUNDS = 32  # a batch that chose k = 0 tries k = 1 again after this many rounds
# ... or after this many when even a draft the target always accepted could not pay (measured
# costs: a compute-bound draft step as dear as a target pass): such a probe buys nothing, and
# its first step must take in every token the draft missed meanwhile
PROBE_ROUNDS_HOPELESS = PROBE_MAX_INTERVAL
# an exploring round's catch-up may cost this share of the plain rounds the draft missed
CATCH_UP_SHARE = 0.1


def interpolate(points: dict[int, float], x: int, prior_slope: float) -> float | None:
    """Seconds of a pass over `x` rows from the measured {rows: seconds}: piecewise linear
    between measured row counts, the nearest segment's slope beyond them (never negative;
    `prior_slope` per row while only one count is measured). None before any measurement."""
    if not points:
        return None
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        a = b = xs[0]
        slope = prior_slope
    else:
        if x < xs[0]:
            a, b = xs[0], xs[1]
        elif x > xs[-1]:
            a, b = xs[-2], xs[-1]
        else:
            a = max(v for v in xs if v < x)
            b = min(v for v in xs if v > x)
        slope = max((points[b] - points[a]) / (b - a), 0.0)
    return max(points[a] + slope * (x - a), 1e-9)


def batch_speed(
    k: int,
    batch: int,
    pass_seconds,
    draft_step: float,
    acceptance: Sequence[float],
    reach: Sequence[Sequence[float]] | None = None,
    block: bool = False,
) -> float:
    """Expected tokens per second, all rows together, of a round with k drafts a row:
    sum_i E_i(k) / (k * draft_step + T(B x (k+1))). `pass_seconds(rows)`: a verify pass's
    seconds; `draft_step`: one batched draft step (0 for lookup), `block`: the whole round's
    draft (a block head: one forward drafts every position, whatever k); `acceptance`: a_i per
    draft position; `reach[row][j]`: the chance that row proposes a j-th token (None: always)."""
    rows = batch * (k + 1)
    seconds = pass_seconds(rows) + (min(k, 1) if block else k) * draft_step
    reach = reach if reach is not None else [None] * batch
    tokens = sum(expected_tokens(acceptance[:k], r[:k] if r is not None else None) for r in reach)
    return tokens / seconds


def choose_batch_k(
    batch: int,
    k_max: int,
    pass_seconds,
    draft_step: float,
    acceptance: Sequence[float],
    reach: Sequence[Sequence[float]] | None = None,
    block: bool = False,
) -> int:
    """argmax over k in [0, k_max] of `batch_speed` (a tie goes to the shorter draft). Pure."""
    speeds = [
        (batch_speed(k, batch, pass_seconds, draft_step, acceptance, reach, block), -k)
        for k in range(k_max + 1)
    ]
    return -max(speeds)[1]


def lookup_width(
    requested: Sequence[int],
    rival: Sequence[float],
    lookups: dict[int, tuple[float, int]],
    pass_seconds,
    draft_step: float,
    fed: bool = False,
    block: bool = False,
) -> dict[int, int]:
    """Each looking-up row's lookup draft length this round ({row: L}; a row left out drafts
    `requested[row]` as it would without: its k, 0 for none). Pure.

    `rival[b]`: the tokens row b's round gives without a lookup past its k (its k-draft's
    E(k), 1 for a plain row); `lookups[b]`: (a, reach), the acceptance of row b's looked-up
    tokens (by its match length) and the longest draft its match supports. At a pass width W
    a row looks up min(reach, W) tokens where E = (1 - a^(n+1)) / (1 - a) beats its rival;
    the round costs one pass over B x (width + 1) rows (the shorter rows padded, as ever)
    plus its draft steps: those of the rows that draft with the model (`draft_step` each;
    `block`: one for the block), or of every column when the draft model is `fed` each guess
    (a looked-up one too: it keeps one lag for all rows). The W with the most tokens a second
    wins, against no lookup at all (ties: the narrower). `pass_seconds` None (nothing
    measured yet): a plain pass of the batch plus PRIOR_VERIFY_SLOPE of it a column, and
    `draft_step` in those units."""
    batch = len(requested)
    if pass_seconds is None:

        def pass_seconds(rows: int) -> float:
            return 1.0 + PRIOR_VERIFY_SLOPE * (rows / batch - 1)

    def speed(width_cap: int | None) -> tuple[float, dict[int, int]]:
        tokens, width, model, chosen = 0.0, 0, 0, {}
        for b in range(batch):
            if width_cap is not None and b in lookups:
                a, reach = lookups[b]
                n = min(reach, width_cap)
                e = lookup_tokens(a, n)
                if e > rival[b]:
                    chosen[b] = n
                    tokens += e
                    width = max(width, n)
                    continue
            tokens += rival[b]
            width = max(width, requested[b])
            model = max(model, requested[b])
        steps = width if fed else (min(model, 1) if block else model)
        return tokens / (pass_seconds(batch * (width + 1)) + steps * draft_step), chosen

    best, chosen = speed(None)
    for w in range(1, max((reach for _, reach in lookups.values()), default=0) + 1):
        s, c = speed(w)
        if s > best * (1 + 1e-9):
            best, chosen = s, c
    return chosen


@dataclass
class BatchController:
    """Chooses one k a round for a whole batch (batch.py), as `Controller` does for one stream:
    from measured costs, keyed here by the verify pass's total row count B x (k+1), and a draft
    step's by B; acceptance per draft position is pooled over the rows. Warm-up: a plain pass,
    then k = 1 (which times a draft step and a wider pass); every EXPLORE_EVERY drafting rounds
    a longer draft measures the next row count; after choosing 0 it probes k = 1 every
    PROBE_ROUNDS rounds (PROBE_ROUNDS_HOPELESS when even an always-accepted draft could not
    pay). `calibrate` takes a lone row's target and draft steps timed in its prefill, so a
    draft that cannot pay at B = 1 is never run there (as `Controller` does for one stream).
    Warm-ups and probes wait while the draft's catch-up would cost more than a plain pass
    (`catch_up_seconds`, from the measured prefills and catch-ups)."""

    k_max: int = K_MAX
    draft_model: bool = True  # a draft step costs time (a draft model, a head; lookup: none)
    block: bool = False  # a block head (DFlash): one timed "step" drafts the whole round
    passes: dict = field(default_factory=dict)  # rows -> Estimate of a verify pass's seconds
    draft_steps: dict = field(default_factory=dict)  # B -> Estimate of one draft step's
    accept: list = field(default_factory=list)
    reach: list = field(default_factory=list)
    rounds: int = 0
    since_probe: int = 0
    chosen: int = 0
    catch_up: Estimate = field(default_factory=lambda: Estimate(0.25))  # s per token and row

    def __post_init__(self):
        self.accept = [Estimate(ACCEPT_MEMORY) for _ in range(self.k_max)]
        self.reach = [Estimate(ACCEPT_MEMORY) for _ in range(self.k_max)]

    def acceptance(self) -> list[float]:
        out, last = [], PRIOR_ACCEPTANCE
        for e in self.accept:
            last = e.value if e.count else last
            out.append(last)
        return out

    def _reach(self) -> list[float]:
        out, last = [], 1.0
        for e in self.reach:
            last = e.value if e.count else last
            out.append(last)
        return out

    def pass_seconds(self, rows: int) -> float | None:
        points = {r: e.value for r, e in self.passes.items()}
        if not points:
            return None
        prior = PRIOR_VERIFY_SLOPE * points[min(points)] / min(points)
        return interpolate(points, rows, prior)

    def draft_seconds(self, batch: int) -> float | None:
        """A draft step over `batch` rows, interpolated from those measured; never more than
        the rows' steps one by one (a single slow measurement over 2 rows, 23 ms against
        6 ms for one, extrapolated to 56 ms at 4 rows: the sliding pair's batch judged its
        draft hopeless and never drafted, 1.46x serial where drafting gave 3.6x)."""
        if not self.draft_model:
            return 0.0
        points = {b: e.value for b, e in self.draft_steps.items()}
        seconds = interpolate(points, batch, 0.0)
        one = points.get(1)
        return min(seconds, batch * one) if seconds is not None and one else seconds

    def row_reach(self, available) -> list[list[float]] | None:
        """Per row, the chance of a j-th proposal given what lookup said of the row now."""
        if available is None:
            return None
        r = self._reach()
        scale = max(r[0], 1e-6) if r else 1.0
        return [
            r if a is None else ([min(1.0, x / scale) for x in r] if a else [0.0] * len(r))
            for a in available
        ]

    def next(
        self, batch: int, available: Sequence[bool | None] | None = None, missed: int = 0
    ) -> int:
        """k for the next round of a batch of `batch` rows; `available`: per row, lookup's
        word on whether it has a proposal now (None: a draft model, unknown); `missed`:
        tokens a row the draft model must take in before it can draft (after plain rounds).
        A round that only explores (the warm-up, a probe) is not run while that catch-up
        would cost more than a plain pass or CATCH_UP_SHARE of the plain rounds it follows:
        after a long plain stretch a compute-bound draft would take longer to catch up than
        the whole stretch took."""
        if available is not None and not any(a is not False for a in available):
            self.chosen = 0  # nothing to propose anywhere: a plain step costs no draft rows
            return 0
        draft = self.draft_seconds(batch)
        if self.pass_seconds(batch) is None or batch not in self.passes:
            self.chosen = 0  # a plain pass of this batch first: every decision rests on it
            return 0
        hopeless = draft is not None and self.hopeless(batch, draft)
        # (against the plain stretch it follows, not one pass: the lag grows with every plain
        # round, and a catch-up dearer than one pass never let a batch probe again)
        stretch = max(1.0, CATCH_UP_SHARE * missed) * self.pass_seconds(batch)
        affordable = self.catch_up_seconds(batch, missed) <= stretch
        warm = draft is not None and batch * 2 in self.passes
        if not (warm or hopeless) and affordable:
            self.chosen = 1  # the warm-up: times a draft step and a pass over 2B rows
            return 1
        reach = self.row_reach(available)
        k = 0
        if warm and not hopeless:
            acceptance = self.acceptance()
            k = choose_batch_k(
                batch, self.k_max, self.pass_seconds, draft, acceptance, reach, self.block
            )
        if k == 0:
            self.since_probe += 1
            due = self.since_probe >= (PROBE_ROUNDS_HOPELESS if hopeless else PROBE_ROUNDS)
            if due and affordable:
                self.since_probe, k = 0, 1
        else:
            self.rounds += 1
            if self.rounds % EXPLORE_EVERY == 0 and k < self.k_max:
                k += 1  # measure the next row count now and then
        self.chosen = k
        return k

    def hopeless(self, batch: int, draft: float) -> bool:
        """Whether even a draft the target always accepted could not pay at this batch size,
        by the costs known (a pass over more rows than measured: the prior slope)."""
        always = [1.0] * self.k_max
        return (
            choose_batch_k(batch, self.k_max, self.pass_seconds, draft, always, None, self.block)
            == 0
        )

    def catch_up_seconds(self, batch: int, missed: int) -> float:
        """Seconds for the draft model to take in `missed` tokens in each of `batch` rows: the
        measured seconds per token and row of its prefills and catch-ups (before any: a draft
        step's per token, as for a compute-bound draft; 0 before that)."""
        if not self.draft_model or missed <= 0:
            return 0.0
        per = self.catch_up.value if self.catch_up.count else (self.draft_seconds(1) or 0.0)
        return per * batch * missed

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The draft took in `tokens` (tokens x rows) in `seconds` (a prefill, a catch-up)."""
        if tokens > 0 and self.draft_model:
            self.catch_up.add(seconds / tokens)

    def calibrate(self, plain: float | None, draft: float | None) -> None:
        """A lone row's target step and draft step, timed at the end of its prefill (each
        after a step that paid the one-time costs), as a batch of one would take them."""
        if plain is not None:
            self.passes.setdefault(1, Estimate(0.25, warmup=True)).add(plain)
        if draft is not None and self.draft_model:
            self.draft_steps.setdefault(1, Estimate(0.25, warmup=True)).add(draft)

    def wants_timing(self) -> bool:
        """Whether a lone row's prefill should time its steps (see `calibrate`)."""
        return 1 not in self.passes or (self.draft_model and 1 not in self.draft_steps)

    def update(self, batch: int, timing, outcomes, timed: bool = True) -> None:
        """A drafting round: `timing` (batch.BatchTiming) and per row (k asked, drafted,
        accepted); `timed=False`: its costs are not a round's (rows just joined or left),
        only what was accepted is learnt."""
        if timed:
            passes = self.passes.setdefault(timing.rows, Estimate(0.25, warmup=True))
            passes.add(timing.verify_seconds)
        if timed and timing.draft_steps and self.draft_model:
            step = timing.draft_seconds / timing.draft_steps
            self.draft_steps.setdefault(batch, Estimate(0.25, warmup=True)).add(step)
        # one estimate update per position a round, over the rows that got there: the
        # memory is in rounds, whatever B is
        for j in range(self.k_max):
            asked = [d > j for r, d, _ in outcomes if r > j]
            if asked:
                self.reach[j].add(sum(asked) / len(asked))
            reached = [a > j for _, d, a in outcomes if d > j and a >= j]
            if reached:
                self.accept[j].add(sum(reached) / len(reached))

    def update_plain(self, batch: int, timing) -> None:
        self.passes.setdefault(timing.rows, Estimate(0.25, warmup=True)).add(timing.verify_seconds)

    def view(self) -> dict:
        return {
            "k": self.chosen,
            "pass_seconds": {r: round(e.value, 5) for r, e in sorted(self.passes.items())},
            "draft_step_seconds": {
                b: round(e.value, 5) for b, e in sorted(self.draft_steps.items())
            },
            "acceptance": [round(e.value, 3) for e in self.accept if e.count],
        }
