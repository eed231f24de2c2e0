"""Draft-length policies: how many tokens to draft each round (k = 0: decode plainly).

A `DraftLength` is the user's choice as a value — `Fixed(4)` or `Auto()` — carried from the CLI,
models.toml and the API to the engine; `.policy()` makes the object that decides round by
round. Policies see only the past (earlier rounds' acceptance and timings), never the round they
decide, so the output stays exactly the target's whatever they choose.

`Controller` (behind `auto`) picks k to maximise expected tokens per second from what this run
measures: the wall time of a round for each k it tried (draft steps + the verify pass + the
round's host work), the time of a plain decoding step, and the draft's acceptance per position
from decayed counts over ~40 rounds. When no k is expected to beat a plain step it decodes
plainly and re-probes with a short draft now and then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .errors import SpecError

K_MAX = 8  # `auto` chooses k within [0, K_MAX]


# --------------------------------------------------------------------------- the user's choice


@dataclass(frozen=True)
class Fixed:
    """The same draft length every round."""

    k: int

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise SpecError(f"num-draft-tokens must be an integer >= 1 or 'auto', got {self.k!r}")

    def __str__(self) -> str:
        return str(self.k)

    def policy(self, max_draft: int | None = None) -> FixedK:
        return FixedK(self.k if max_draft is None else min(self.k, max_draft))


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

    def wants_split(self) -> bool:
        """Whether to time this round's draft apart from its verify pass (an extra sync)."""

    def wants_timing(self) -> bool:
        """Whether prefill should time a target step and a draft step for `calibrate`."""

    def calibrate(self, plain: float | None, draft: float | None) -> None:
        """A target step and a draft step, timed at the end of prefill."""

    def view(self) -> dict:
        """Its state for stats (empty: nothing to show)."""


def expected_tokens(acceptance: Sequence[float], reach: Sequence[float] | None = None) -> float:
    """Tokens a round emits, E(k) = 1 + sum_j R_j * prod_{i<=j} a_i, for k = len(acceptance):
    a_i the acceptance of draft position i given the ones before it were accepted, R_j the
    chance a j-th token is proposed at all (default 1). With a_i = alpha for every i this is
    (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023)."""
    total, chain = 1.0, 1.0
    for j, a in enumerate(acceptance):
        chain *= a
        total += (1.0 if reach is None else reach[j]) * chain
    return total


class FixedK:
    """The same draft length every round."""

    def __init__(self, k: int):
        self.k = self.k_max = k

    def next(self, available: bool | None = None) -> int:
        return self.k

    def update(self, requested, drafted, verified, seconds, split=None, replayed=0) -> None:
        pass

    def wants_timing(self) -> bool:
        return False

    def calibrate(self, plain: float | None, draft: float | None) -> None:
        pass

    def update_plain(self, tokens: int, seconds: float) -> None:
        pass

    def plain_burst(self) -> int:
        return 1  # only the last token of a reply (or a recurrent replay) runs without drafts

    def wants_split(self) -> bool:
        return False

    def view(self) -> dict:
        return {}


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
        plain, speed = self.round_time(0), self.speed(k)
        return speed * plain if plain and speed else 0.0

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
        }


# ------------------------------------------------------------------------- a batch's draft length
# A batch (batch.py) verifies B x (k+1) rows in one pass: the pass gets dearer as B grows (on the
# Linux CPU with OpenBLAS 8 rows cost ~1.3x one in float32, ~8x in bfloat16), so the k that pays
# shrinks with B and reaches 0 (plain continuous batching) where drafting no longer pays.

PROBE_ROUNDS = 32  # a batch that chose k = 0 tries k = 1 again after this many rounds
# ... or after this many when even a draft the target always accepted could not pay (measured
# costs: a compute-bound draft step as dear as a target pass): such a probe buys nothing, and
# its first step must take in every token the draft missed meanwhile
PROBE_ROUNDS_HOPELESS = PROBE_MAX_INTERVAL


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
) -> float:
    """Expected tokens per second, all rows together, of a round with k drafts a row:
    sum_i E_i(k) / (k * draft_step + T(B x (k+1))). `pass_seconds(rows)`: a verify pass's
    seconds; `draft_step`: one batched draft step (0 for lookup); `acceptance`: a_i per draft
    position; `reach[row][j]`: the chance that row proposes a j-th token (None: always)."""
    rows = batch * (k + 1)
    seconds = pass_seconds(rows) + k * draft_step
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
) -> int:
    """argmax over k in [0, k_max] of `batch_speed` (a tie goes to the shorter draft). Pure."""
    speeds = [
        (batch_speed(k, batch, pass_seconds, draft_step, acceptance, reach), -k)
        for k in range(k_max + 1)
    ]
    return -max(speeds)[1]


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
    draft_model: bool = True  # a draft step costs time (lookup: none)
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
        if not self.draft_model:
            return 0.0
        points = {b: e.value for b, e in self.draft_steps.items()}
        return interpolate(points, batch, 0.0)

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
        would cost more than a plain pass: after a long plain stretch a compute-bound draft
        would take longer to catch up than the whole stretch took."""
        if available is not None and not any(a is not False for a in available):
            self.chosen = 0  # nothing to propose anywhere: a plain step costs no draft rows
            return 0
        draft = self.draft_seconds(batch)
        if self.pass_seconds(batch) is None or batch not in self.passes:
            self.chosen = 0  # a plain pass of this batch first: every decision rests on it
            return 0
        hopeless = draft is not None and self.hopeless(batch, draft)
        affordable = self.catch_up_seconds(batch, missed) <= self.pass_seconds(batch)
        warm = draft is not None and batch * 2 in self.passes
        if not (warm or hopeless) and affordable:
            self.chosen = 1  # the warm-up: times a draft step and a pass over 2B rows
            return 1
        reach = self.row_reach(available)
        k = 0
        if warm and not hopeless:
            acceptance = self.acceptance()
            k = choose_batch_k(batch, self.k_max, self.pass_seconds, draft, acceptance, reach)
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
        return choose_batch_k(batch, self.k_max, self.pass_seconds, draft, always) == 0

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

    def update(self, batch: int, timing, outcomes) -> None:
        """A drafting round: `timing` (batch.BatchTiming) and per row (k asked, drafted,
        accepted)."""
        self.passes.setdefault(timing.rows, Estimate(0.25, warmup=True)).add(timing.verify_seconds)
        if timing.draft_steps and self.draft_model:
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
