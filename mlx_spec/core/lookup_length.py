"""How long a lookup draft (suffix decoding: drafters/suffix.py) is, and whether it goes at
all, by the cost of a verify pass rather than K_MAX.

A lookup draft costs no model step: a round of L looked-up tokens costs a verify pass over
L + 1 rows, fitted across lookup rounds as T = A + s * L (until L has varied: A a plain step,
s = PRIOR_VERIFY_SLOPE of it). A looked-up token is accepted with a probability `a` that
depends on how long the match behind it is: one rate per match-length bucket, decayed counts
shrunk toward the bucket's prior, with the geometric model E(L) = (1 - a^(L+1)) / (1 - a)
tokens a round. The length chosen is argmax E(L) / T(L) over L <= what the match supports;
it goes when that beats the rival — the pair's drafter's best round, or a plain step.
Like every policy it sees only past rounds: the output stays exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# (shortest match of the bucket, prior per-token acceptance): a long verbatim match is
# nearly always continued verbatim (an agent rewriting a file), a 1-token one rarely
BUCKETS = ((1, 0.45), (3, 0.7), (8, 0.85), (16, 0.93))
PRIOR_WEIGHT = 4.0  # pseudo-tokens of the prior
DECAY = 0.97  # per round (~30 rounds of evidence)
FIT_DECAY = 0.9
PRIOR_VERIFY_SLOPE = 0.07  # as policies.py: a verified row costs this much of a plain step


def expected_tokens(a: float, n: int) -> float:
    """Tokens a round of n guesses emits when each is accepted with probability a."""
    if a >= 1.0:
        return n + 1.0
    return (1.0 - a ** (n + 1)) / (1.0 - a)


@dataclass
class LookupCosts:
    hits: list = field(default_factory=lambda: [0.0] * len(BUCKETS))
    seen: list = field(default_factory=lambda: [0.0] * len(BUCKETS))
    fit: list = field(default_factory=lambda: [0.0] * 5)  # decayed w, x, xx, t, xt
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    lengths: dict = field(default_factory=dict)  # draft length -> rounds (for stats)

    @staticmethod
    def bucket(match: int) -> int:
        return max(i for i, (low, _) in enumerate(BUCKETS) if match >= low or i == 0)

    def acceptance(self, match: int) -> float:
        b = self.bucket(match)
        return (self.hits[b] + PRIOR_WEIGHT * BUCKETS[b][1]) / (self.seen[b] + PRIOR_WEIGHT)

    def line(self, plain: float) -> tuple[float, float]:
        """(A, s) of T = A + s * L, in seconds (`plain`: a plain step's)."""
        w, sx, sxx, st, sxt = self.fit
        slope = PRIOR_VERIFY_SLOPE * plain
        if w <= 0:
            return plain, slope
        mean_x, mean_t = sx / w, st / w
        if sxx / w - mean_x**2 > 1.0:  # L has varied enough to show the slope
            slope = max((sxt / w - mean_x * mean_t) / (sxx / w - mean_x**2), 0.0)
        # (a round holds a verify pass: not much cheaper than a plain step, whatever the fit)
        return max(mean_t - slope * mean_x, 0.5 * plain), slope

    def best(self, match: int, reach: int, plain: float) -> tuple[int, float]:
        """(L, tokens per second) of the best lookup draft of at most `reach` tokens."""
        a = self.acceptance(match)
        base, slope = self.line(plain)
        best = (0, 0.0)
        for n in range(1, reach + 1):
            speed = expected_tokens(a, n) / (base + slope * n)
            if speed > best[1]:
                best = (n, speed)
        return best

    def choose(self, match: int, reach: int, plain: float | None, rival: float | None) -> int:
        """The lookup draft's length, 0 where the rival (tokens per second; None: a plain
        step) is expected to do better. `plain` None (not timed yet): in plain steps."""
        if match <= 0 or reach <= 0:
            return 0
        unit = plain or 1.0
        n, speed = self.best(match, reach, unit)
        if rival is None:
            rival = 1.0 / unit
        return n if speed > rival else 0

    def update(self, match: int, drafted: int, accepted: int, seconds: float) -> None:
        """A lookup round: its match, guesses, accepted guesses and wall time."""
        if drafted <= 0:
            return
        b = self.bucket(match)
        self.hits = [DECAY * h for h in self.hits]
        self.seen = [DECAY * s for s in self.seen]
        accepted = min(accepted, drafted)
        self.hits[b] += accepted
        self.seen[b] += accepted + (accepted < drafted)
        self.fit = [FIT_DECAY * v for v in self.fit]
        for i, v in enumerate((1.0, drafted, drafted * drafted, seconds, drafted * seconds)):
            self.fit[i] += v
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.lengths[drafted] = self.lengths.get(drafted, 0) + 1

    def view(self) -> dict:
        if not self.rounds:
            return {}
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "lengths": dict(sorted(self.lengths.items())),
            "acceptance": [round(self.acceptance(low), 3) for low, _ in BUCKETS],
        }
