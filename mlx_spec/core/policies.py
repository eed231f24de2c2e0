"""Draft-length policies: how many tokens to draft each round (k = 0: decode plainly).

A `DraftLength` is the user's choice as a value — `Fixed(4)` or `Auto()` — carried from the CLI,
models.toml and the API to the engine; `.policy()` makes the object that decides round by
round. Policies see only the past (earlier rounds' acceptance and timings), never the round they
decide, so the output stays exactly the target's whatever they choose.

`Controller` (behind `auto`) picks k to maximise expected tokens per second from what this run
measures: the wall time of a round for each k it tried (draft steps + the verify pass + the
round's host work), the time of a plain decoding step, and the draft's acceptance per position
from decayed counts over ~40 rounds. When no k is expected to beat a plain step it decodes
plainly and re-probes with a short draft now and then. Beside it, a lookup draft's length
(suffix decoding) comes from the same measured round times (lookup_length.py's fit).

Over 600 lines: the fixed and the measured policy answer the same questions (k, a lookup's
length, a plain burst, the payoff verdict's figures) from the same round timings; apart, the
one would re-read the other's estimates.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import SpecError
from .lookup_length import LookupCosts
from .payoff import Payoff, estimate_alpha, expected_tokens, predicted_speedup

K_MAX = 8  # `auto` chooses k within [0, K_MAX] (a lookup draft's length: lookup_length.py)
FIXED_LOOKUP_MATCH = 4  # a fixed k beside a lookup: a match this long drafts by lookup


# --------------------------------------------------------------------------- the user's choice


@dataclass(frozen=True)
class Fixed:
    """The same draft length every round. `retime`: after every `retime` rounds one plain
    step, timed in the loop, so the run's verdict divides by a plain token taken under the
    same load as its rounds (the chat's: see FixedK); 0, the default: every round drafts."""

    k: int
    retime: int = 0

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise SpecError(f"num-draft-tokens must be an integer >= 1 or 'auto', got {self.k!r}")

    def __str__(self) -> str:
        return str(self.k)

    def policy(self, max_draft: int | None = None) -> FixedK:
        return FixedK(self.k if max_draft is None else min(self.k, max_draft), self.retime)


@dataclass(frozen=True)
class Auto:
    """k chosen every round by the `Controller`."""

    k_max: int = K_MAX

    def __str__(self) -> str:
        return "auto"

    def policy(self, max_draft: int | None = None) -> Controller:
        """`max_draft`: the most the drafter kind can propose in a round."""
        return Controller(self.k_max if max_draft is None else min(self.k_max, max_draft))


DraftLength = Fixed | Auto


def draft_length(value) -> DraftLength:
    """An int, "auto" (or a digit string), or a DraftLength -> a DraftLength."""
    if isinstance(value, Fixed | Auto):
        return value
    if value == "auto":
        return Auto()
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return Fixed(value)


# ----------------------------------------------------------------------------- the deciders


class Policy(Protocol):
    """What the engine asks of a draft-length policy each round. It sees only past rounds,
    never the one it decides, so the output stays exactly the target's whatever it picks."""

    k_max: int  # the longest draft it may choose

    def next(self, available: bool | None = None) -> int:
        """k for the next round (0: decode plainly for `plain_burst()` tokens). `available`:
        the drafter's free word on whether it has a proposal now (None: unknown)."""

    def plain_burst(self) -> int:
        """Plain tokens to decode before asking `next` again, after it chose 0."""

    def update(self, requested, drafted, verified, seconds, split=None, replayed=0) -> None:
        """A speculative round happened: k asked, proposed, accepted, its wall time, and when
        timed apart (draft seconds, draft steps, verify seconds, verify rows)."""

    def update_plain(self, tokens: int, seconds: float) -> None:
        """Plain tokens were decoded in `seconds`."""

    def consumed(self, seconds: float) -> None:
        """The caller held the round just yielded for `seconds` before asking for the next
        (that time is in the next round's wall time)."""

    def wants_split(self) -> bool:
        """Whether to time this round's draft apart from its verify pass (an extra sync)."""

    def wants_timing(self) -> bool:
        """Whether prefill should time a target step and a draft step for `calibrate`."""

    def calibrate(self, plain: float | None, draft: float | None) -> None:
        """A target step and a draft step, timed at the end of prefill."""

    def view(self) -> dict:
        """Its state for stats (empty: nothing to show)."""

    def payoff(self) -> Payoff | None:
        """Whether drafting pays by what this run measured (None: not measured yet)."""

    def lookup_length(self, match: int, reach: int, rival: bool) -> int:
        """A lookup draft's length this round (suffix decoding; 0: none), by the verify cost
        (lookup_length.py), not k_max: `match` the longest match's length, `reach` the most
        it supports; `rival`: another drafter could draft the round instead."""

    def update_lookup(self, match: int, drafted: int, verified: int, seconds: float) -> None:
        """A lookup round happened (not one of the k rounds `update` counts)."""


class FixedK:
    """The same draft length every round. It decides nothing from what happens, but keeps what
    the run measured for `payoff`: a plain step timed in prefill, the rounds' wall times, the
    caller's share of a round and the draft's acceptance.

    A round's wall time runs from its start to the next one's, so it holds the time the caller
    kept the round (printing it, drawing it, sending it). Plain decoding hands over every token
    as a round of its own, but queues the next step first: a plain token costs the longer of a
    step and the caller's share (`plain_token`). `auto` needs no such model: it times its plain
    tokens in the loop.

    Neither sees a caller that slows the decoding itself: the chat draws on another thread
    while the rounds run (2 cores, the GIL), and there a plain token cost 1.6x the step timed
    in prefill, before the app drew anything — the verdict row said 0.58-0.77x where the
    chat's own race measured 1.04-1.70x (2026-12-03, a loaded 2-core machine). With `retime`
    every `retime` k-rounds are followed by one plain step timed as a round is, and the
    verdict divides by the median of those (a plain step then, instead of a round: 1/17 of
    the rounds at retime 16, about 1 % of a speed-up of 1.2x)."""

    RECENT = 16  # the plain steps timed in the loop that the median takes

    def __init__(self, k: int, retime: int = 0):
        self.k = self.k_max = k
        self.retime = retime
        self.since_plain = 0  # k-rounds since the last plain step timed in the loop
        self.loop_plain: list[float] = []  # seconds of those plain steps
        self.plain_step: float | None = None  # seconds of a target step (prefill times it)
        self.first_round: float | None = None  # the first round's seconds: it pays one-time costs
        self.timed_rounds, self.round_seconds = 0, 0.0  # k-draft rounds after the first, their time
        self.accepted = self.rejections = 0  # draft tokens accepted; rounds that rejected one
        self.held_rounds, self.held_seconds = 0, 0.0  # rounds the caller held, for how long
        self.lookup = LookupCosts()

    def lookup_length(self, match: int, reach: int, rival: bool) -> int:
        """Beside another drafter, a lookup draft goes where the match is long
        (FIXED_LOOKUP_MATCH); its length by the verify cost against a plain step."""
        if rival and match < FIXED_LOOKUP_MATCH:
            return 0
        return self.lookup.choose(match, reach, self.plain_step, None)

    def update_lookup(self, match: int, drafted: int, verified: int, seconds: float) -> None:
        self.lookup.update(match, drafted, verified, seconds)

    def next(self, available: bool | None = None) -> int:
        if self.retime and self.since_plain >= self.retime:
            return 0  # one plain step, timed (update_plain)
        return self.k

    def update(self, requested, drafted, verified, seconds, split=None, replayed=0) -> None:
        self.since_plain += 1
        if drafted:
            self.accepted += min(verified, drafted)
            self.rejections += verified < drafted
        if requested != self.k or drafted != self.k:
            return  # a shorter round (the reply's end, a short proposal) is not a k round
        if self.first_round is None:
            self.first_round = seconds
        else:
            self.timed_rounds += 1
            self.round_seconds += seconds

    def wants_timing(self) -> bool:
        return self.plain_step is None

    def calibrate(self, plain: float | None, draft: float | None) -> None:
        if plain is not None:
            self.plain_step = plain

    def consumed(self, seconds: float) -> None:
        self.held_rounds += 1
        self.held_seconds += seconds

    def plain_token(self) -> float | None:
        """Seconds of a plain token here: with `retime`, the median of the plain steps timed
        in the loop; else the step timed in prefill, or the caller's mean share of a round if
        that is longer (the step queued meanwhile runs under it)."""
        if self.loop_plain:
            return statistics.median(self.loop_plain[-self.RECENT :])
        if not self.plain_step:
            return None
        held = self.held_seconds / self.held_rounds if self.held_rounds else 0.0
        return max(self.plain_step, held)

    def payoff(self) -> Payoff | None:
        """What this run measured: a round of k drafts against a plain token."""
        plain = self.plain_token()
        if not plain or self.first_round is None:
            return None
        mean = self.round_seconds / self.timed_rounds if self.timed_rounds else self.first_round
        alpha = estimate_alpha(self.accepted, 0, 0, self.rejections)
        return Payoff.of(alpha, self.k, mean / plain)

    def update_plain(self, tokens: int, seconds: float) -> None:
        if self.retime and self.since_plain >= self.retime:  # the step next() asked for
            self.since_plain = 0
            self.loop_plain.append(seconds / tokens)

    def plain_burst(self) -> int:
        return 1  # the last token of a reply, a recurrent replay, a retimed step: one alone

    def wants_split(self) -> bool:
        return False

    def view(self) -> dict:
        lookup = self.lookup.view()
        return {"lookup": lookup} if lookup else {}


@dataclass
class Estimate:
    """An exponential moving average that knows whether it has seen anything. With `warmup`
    the first value is provisional and the second replaces it: a first call of a model (or of
    a new shape) pays one-time costs — allocation, kernel compilation on Metal."""

    rate: float
    warmup: bool = False
    value: float | None = None
    count: int = 0

    def add(self, x: float) -> None:
        if self.value is None or (self.warmup and self.count == 1):
            self.value = x
        else:
            self.value += self.rate * (x - self.value)
        self.count += 1


ACCEPT_MEMORY = 0.15  # weight of the newest round in the reach and batch estimates (~7 rounds)
# a draft position's acceptance: counts decayed by this per observation (~40 rounds of evidence)
ACCEPT_DECAY = 0.95
PRIOR_WEIGHT = 2.0  # ... plus this many pseudo-observations of the prior
PLAIN_MEMORY = 0.1  # ... in a plain token's time (timed token by token)
ROUND_MEMORY = 0.9  # decay per round of the round-time fit (~10 rounds)
PRIOR_ACCEPTANCE = 0.6  # before a position has been seen
# an extra verified token costs this much of a plain step until measured (verifying 8 tokens
# cost ~1.5 steps in float32 on the Linux CPU with OpenBLAS; less on Apple GPUs)
PRIOR_VERIFY_SLOPE = 0.07
PROBE_LOSS = 0.02  # re-probe no more often than a probe's expected loss stays under 2 % of time
PROBE_MAX_INTERVAL = 256  # plain tokens between probes at most
WARMUP_PLAIN = 4  # plain tokens that time a plain step at the start
CALIBRATION_ROUNDS = 3  # first rounds whose draft and verify parts are timed apart
EXPLORE_EVERY = 8  # drafting rounds between tries of a longer draft


@dataclass
class Rate:
    """How often a draft position is accepted: decayed counts, shrunk toward a prior while
    they are few, (hits + w * prior) / (seen + w). An exponential average over ~7 rounds swung
    with every outcome (at 32 % acceptance its standard deviation is 0.13) and the controller
    paused on the dips: the demo's head ran 49 % of a reply plain, 1.06x against 1.17x at a
    fixed k = 1; and a later position, seen only when the ones before it were accepted, kept
    its first value for dozens of rounds. Here each position's prior is the position before
    it, so an unseen or rarely seen position leans on the best evidence there is."""

    decay: float = ACCEPT_DECAY
    hits: float = 0.0
    seen: float = 0.0
    count: int = 0

    def add(self, accepted: float) -> None:
        self.hits = self.decay * self.hits + accepted
        self.seen = self.decay * self.seen + 1.0
        self.count += 1

    def value(self, prior: float) -> float:
        return (self.hits + PRIOR_WEIGHT * prior) / (self.seen + PRIOR_WEIGHT)


@dataclass
class Controller:
    """Chooses k each round to maximise expected tokens per second (k = 0: plain decoding).

    Expected tokens of a round with k drafts: E(k) = 1 + sum_j R_j * prod_{i<=j} a_i, where a_i
    is the acceptance of draft position i given the ones before it were accepted and R_j the
    chance that the drafter proposes a j-th token at all (prompt lookup may find a shorter
    match; a model draft may stop on low confidence). A round's wall time is fitted across
    rounds as T = A + B * x (x: tokens drafted and replayed; A: the verify pass and the round's
    host work; B: a draft step plus a verified row), so every round informs every k; until x has
    varied, B is the draft step timed in the calibration rounds plus a prior verify cost. A plain
    step's time T(0) is timed on stretches of plain decoding. The choice is argmax E(k) / T(k),
    with E(k) / T(k) = 1 / T(0) for k = 0.
    """

    k_max: int = K_MAX
    accept: list = field(default_factory=list)  # a_i per draft position
    reach: list = field(default_factory=list)  # R_j per draft position
    plain: Estimate = field(default_factory=lambda: Estimate(PLAIN_MEMORY, warmup=True))
    draft_step: Estimate = field(default_factory=lambda: Estimate(0.25, warmup=True))
    verify: dict = field(default_factory=dict)  # rows -> seconds of a verify pass (calibration)
    fit: list = field(default_factory=lambda: [0.0] * 5)  # decayed sums: w, x, xx, t, xt
    plan: list = field(default_factory=list)  # choices made in advance (the warm-up)
    warmed: bool = False
    plain_since_probe: int = 0
    calibrated: int = 0
    rounds: int = 0
    burst: int = WARMUP_PLAIN
    chosen: int = 0
    reason: str = "warming up"
    given: bool | None = None  # the drafter's word on this round (see next)
    drafted_total: int = 0  # draft tokens proposed in all rounds so far (measured, no prior)
    accepted_total: int = 0  # ... and accepted by the target
    lookup: LookupCosts = field(default_factory=LookupCosts)  # suffix drafts (lookup_length.py)

    def __post_init__(self):
        self.accept = [Rate() for _ in range(self.k_max)]
        self.reach = [Estimate(ACCEPT_MEMORY) for _ in range(self.k_max)]

    # ------------------------------------------------------------------ the model of a round

    def acceptance(self, i: int) -> float:
        """a_i for 0-based position i: its counts, shrunk toward the position before it (the
        first toward PRIOR_ACCEPTANCE)."""
        a = PRIOR_ACCEPTANCE
        for rate in self.accept[: i + 1]:
            a = rate.value(a)
        return a

    def proposed(self, j: int) -> float:
        """R_j for 0-based position j: the chance a j-th draft token is proposed (given what
        the drafter said of this round: a lookup with a match proposes a first token)."""
        r = self._reach(j)
        if self.given is None:
            return r
        return min(1.0, r / max(self._reach(0), 1e-6)) if self.given else 0.0

    def _reach(self, j: int) -> float:
        e = self.reach[j]
        if e.count:
            return e.value
        return self._reach(j - 1) if j > 0 else 1.0

    def expected_tokens(self, k: int, optimistic: bool = False) -> float:
        if optimistic:  # every token proposed and accepted
            return k + 1.0
        return expected_tokens(
            [self.acceptance(i) for i in range(k)], [self.proposed(j) for j in range(k)]
        )

    def expected_drafted(self, k: int, optimistic: bool = False) -> float:
        return float(k) if optimistic else sum(self.proposed(j) for j in range(k))

    def varied(self) -> bool:
        """Whether the rounds in the fit drafted different numbers of tokens."""
        w, sx, sxx = self.fit[:3]
        return w > 0 and sxx / w - (sx / w) ** 2 > 0.25

    def line(self) -> tuple[float, float] | None:
        """(A, B) of the round-time fit T = A + B * x, or None before any round counted."""
        w, sx, sxx, st, sxt = self.fit
        if w <= 0:  # no round yet: a verify pass costs a plain step, a draft token its step
            if self.draft_step.value is None or self.plain.value is None:
                return None
            return self.plain.value, self.draft_step.value + PRIOR_VERIFY_SLOPE * self.plain.value
        mean_x, mean_t = sx / w, st / w
        if self.varied():  # x has varied enough to show the slope
            slope = (sxt / w - mean_x * mean_t) / (sxx / w - mean_x**2)
        else:
            slope = (self.draft_step.value or 0.0) + PRIOR_VERIFY_SLOPE * (self.plain.value or 0)
        slope = max(slope, 0.0)
        return max(mean_t - slope * mean_x, 1e-9), slope

    def round_time(self, k: int, optimistic: bool = False) -> float | None:
        """Seconds of a round with k drafts (k = 0: of a plain token)."""
        if k == 0:
            return self.plain.value
        line = self.line()
        if line is None:
            return None
        return line[0] + line[1] * self.expected_drafted(k, optimistic)

    def speed(self, k: int, optimistic: bool = False) -> float | None:
        t = self.round_time(k, optimistic)
        if t is None:
            return None
        return (1.0 if k == 0 else self.expected_tokens(k, optimistic)) / t

    # ------------------------------------------------------------------------- the decision

    def best(self, optimistic: bool = False, lowest: int = 0) -> tuple[int, float]:
        speeds = [(self.speed(k, optimistic) or 0.0, -k, k) for k in range(lowest, self.k_max + 1)]
        speed, _, k = max(speeds)
        return k, speed

    def probe_interval(self) -> int:
        """Plain tokens between probes: a probe (the best k > 0) should cost at most
        PROBE_LOSS of the time spent decoding plainly in between."""
        plain = self.round_time(0)
        k, _ = self.best(lowest=1)
        t = self.round_time(k)
        if plain is None or t is None:
            return WARMUP_PLAIN
        if self.best(optimistic=True)[0] == 0:
            return PROBE_MAX_INTERVAL  # even a draft that is always right cannot pay
        loss = max(t - self.expected_tokens(k) * plain, 0.0)
        return int(min(PROBE_MAX_INTERVAL, max(8, loss / (PROBE_LOSS * plain))))

    def next(self, available: bool | None = None) -> int:
        """k for the next round. `available`: the drafter says (for free) whether it has a
        proposal now (prompt lookup), so the chance of a first draft token is known."""
        if not self.warmed:
            self.warmed, self.plan = True, self.plan or self.warm_up()
        if self.plan:
            self.chosen, self.burst = self.plan.pop(0), WARMUP_PLAIN
            return self.chosen
        self.given = available
        k, _ = self.best()
        if k == 0:
            interval = self.probe_interval()
            # a probe needs something to draft: none when lookup says it has no match
            if self.plain_since_probe >= interval and available is not False:
                self.chosen, self.reason = self.best(lowest=1)[0], "probing"
                return self.chosen
            left = interval - self.plain_since_probe  # <= 0: a probe is due but has nothing
            self.chosen, self.burst = 0, left if left > 0 else interval
            self.reason = self._paused_reason()
            return 0
        self.rounds += 1
        self.chosen, self.reason = k, f"k={k}: predicted {self.predicted_speedup(k):.2f}x"
        explore = self.rounds % EXPLORE_EVERY == 0 or (not self.varied() and self.rounds % 2)
        if explore and k < self.k_max:
            # now and then a longer draft: the round-time fit needs x to vary, and positions
            # past k need fresh evidence
            self.chosen = k = min(self.k_max, k + 2)
        return k

    def lookup_length(self, match: int, reach: int, rival: bool) -> int:
        """The lookup draft's length by the verify cost (lookup_length.py) when it beats the
        rival's best round (the other drafter's, or a plain step), else 0."""
        plain = self.round_time(0)
        if plain is None:  # not timed yet: in plain steps, against a plain step
            return self.lookup.choose(match, reach, None, None)
        speed = None
        if rival and self.warmed and not self.plan:
            given, self.given = self.given, None
            speed = self.best()[1]
            self.given = given
        return self.lookup.choose(match, reach, plain, speed)

    def update_lookup(self, match: int, drafted: int, verified: int, seconds: float) -> None:
        self.lookup.update(match, drafted, verified, seconds)

    def warm_up(self) -> list[int]:
        """Rounds that measure what prefill did not time (see `calibrate`): plain steps, then
        two single-token drafts (the first pays one-time costs: its timing stays out of the
        fit). Cheap for a draft that cannot pay; one that can is tried longer right after."""
        plan = [0] if self.plain.value is None else []
        return plan + ([1, 1] if self.draft_step.value is None else [])

    def plain_burst(self) -> int:
        """How many plain tokens to decode before asking again (k = 0 was chosen)."""
        return max(1, self.burst)

    def predicted_speedup(self, k: int) -> float:
        """speed(k) / speed(0), through the one criterion (payoff.predicted_speedup)."""
        plain, t = self.round_time(0), self.round_time(k)
        if not plain or t is None:
            return 0.0
        acceptance = [self.acceptance(i) for i in range(k)]
        return predicted_speedup(acceptance, k, t / plain, [self.proposed(j) for j in range(k)])

    def payoff(self) -> Payoff | None:
        """The verdict on the best draft length (k >= 1) by the estimates this run made: it
        pays when the controller drafts, and loses when it decodes plainly."""
        plain = self.round_time(0)
        if plain and not self.drafted_total and self.best(optimistic=True)[0] == 0:
            # nothing drafted, and even a draft that is always right loses at these costs
            k, speed = self.best(optimistic=True, lowest=1)
            t = self.round_time(k, optimistic=True)
            if t is not None:
                return Payoff(k, speed * plain, 1.0, t / plain, bound=True)
        k = self.best(lowest=1)[0]
        t = self.round_time(k)
        if not plain or t is None or not self.drafted_total:
            return None
        alpha = self.accepted_total / self.drafted_total
        return Payoff(k, self.predicted_speedup(k), alpha, t / plain)

    def _paused_reason(self) -> str:
        """Why k = 0, citing only what was measured: the draft's timed cost, the acceptance of
        tokens actually drafted. The priors a decision may rest on (PRIOR_ACCEPTANCE before
        anything was drafted) are never quoted as if measured."""
        c = self.draft_cost()
        cost = f"draft costs {c:.2f} steps" if c is not None else None
        if self.best(optimistic=True)[0] == 0:  # even a draft that is always right loses
            if cost:
                return f"drafting paused: {cost}"
            if self.fit[0] > 0 and self.plain.value is not None:  # timed rounds say so
                return "drafting paused: a round costs more than a perfect draft saves"
            return "drafting paused: costs not measured yet"
        if self.drafted_total:
            rate = self.accepted_total / self.drafted_total
            measured = f"acceptance {rate:.0%} of {self.drafted_total} drafted tokens"
            # a few accepted tokens do not yet outweigh the prior the estimate starts from
            verdict = "too few to pay yet" if rate > self.acceptance(0) else "too low to pay"
            return f"drafting paused: {measured} is {verdict}" + (f" ({cost})" if cost else "")
        return f"drafting paused: {cost + ', ' if cost else ''}acceptance not measured yet"

    def draft_cost(self) -> float | None:
        """One draft step in plain target steps (the `c` of the speed-up formula)."""
        plain = self.round_time(0)
        if self.draft_step.value is None or not plain:
            return None
        return self.draft_step.value / plain

    def wants_split(self) -> bool:
        """Time the draft apart from the verify pass this round (one extra host sync): the
        first rounds and every probe, so the view has `c` and the verify curve."""
        return self.calibrated < CALIBRATION_ROUNDS or self.reason == "probing"

    # ------------------------------------------------------------------------ what happened

    def update(self, requested, drafted, verified, seconds, split=None, replayed=0) -> None:
        """A speculative round: k asked, drafted, accepted (before EOS truncation), its wall
        time, and optionally (draft seconds, draft steps, verify seconds, verify rows)."""
        if requested == 0:
            return
        self.plain_since_probe = 0
        self.drafted_total += drafted
        self.accepted_total += min(verified, drafted)
        if self.calibrated or split is None:  # the very first round pays one-time costs
            x = drafted + replayed
            self.fit = [ROUND_MEMORY * v for v in self.fit]
            for i, v in enumerate((1.0, x, x * x, seconds, x * seconds)):
                self.fit[i] += v
        # a position seen for the first time starts from what was assumed for it, so one
        # rejection cannot rule it out for good
        for j in range(requested):
            self.reach[j].value = self._reach(j)
            self.reach[j].add(float(j < drafted))
        for i in range(min(drafted, verified + 1)):
            self.accept[i].add(float(i < verified))
        if split is not None:
            draft_seconds, steps, verify_seconds, rows = split
            self.calibrated += 1
            if steps:
                self.draft_step.add(draft_seconds / steps)
            self.verify.setdefault(rows, Estimate(0.25, warmup=True)).add(verify_seconds)

    def wants_timing(self) -> bool:
        """Whether prefill should time a target step and a draft step (see `calibrate`)."""
        return self.draft_step.value is None or self.plain.value is None

    def calibrate(self, plain: float | None, draft: float | None) -> None:
        """A target step and a draft step timed at the end of prefill (warm: the step before
        each paid the one-time costs). Knowing both before the first token, the controller
        skips its warm-up: a draft that cannot pay is never run, one that can starts at once."""
        if plain is not None:
            self.plain = Estimate(PLAIN_MEMORY, value=plain, count=2)
        if draft is not None:
            self.draft_step = Estimate(0.25, value=draft, count=2)

    def update_plain(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.plain.add(seconds / tokens)
            self.plain_since_probe += tokens

    def consumed(self, seconds: float) -> None:
        """Nothing: it times its plain tokens in the loop, as its rounds, with the caller's
        share (only the step timed in prefill that seeds them cannot see a caller slower than
        a step: until it decodes plainly, it undervalues drafting for such a caller)."""

    def view(self) -> dict:
        """The controller's state for stats: measured costs relative to a plain step."""
        plain = self.round_time(0)
        rel = (lambda t: round(t / plain, 3)) if plain else (lambda t: None)
        c = self.draft_cost()
        state = self._paused_reason() if self.chosen == 0 and not self.plan else self.reason
        line = self.line()
        return {
            "state": state,
            "k": self.chosen,
            "draft_cost": round(c, 3) if c is not None else None,
            "round_cost": {
                k: rel(t) for k in range(1, self.k_max + 1) if (t := self.round_time(k))
            },
            "round_fit": {"base": rel(line[0]), "per_token": rel(line[1])} if line else None,
            "verify_curve": {n: rel(e.value) for n, e in sorted(self.verify.items())},
            "acceptance": [
                round(self.acceptance(i), 3) for i, e in enumerate(self.accept) if e.count
            ],
            **({"lookup": lookup} if (lookup := self.lookup.view()) else {}),
        }
