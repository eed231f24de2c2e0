"""Does speculation pay? One criterion, computed one way, for every tool that answers.

A speculative round with k drafts emits E(k) tokens (`expected_tokens`) and costs
`round_cost` plain decoding steps (k draft steps, the verify pass over k+1 tokens, the round's
host work); plain decoding emits one token per step. The predicted speed-up over plain
decoding is therefore E(k) / round_cost (`predicted_speedup`). `probe` feeds it its measured
verify curve, draft cost and sampled acceptance; a run's policy (`FixedK`, the `auto`
controller) feeds it the run's own round timings and acceptance, which is what the `generate`
hint and the chat's verdict line show; the controller drafts exactly when its best k
predicts more than 1. `Payoff` puts the figure into the same words everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PAYS = 1.05  # a speed-up of at least this pays; under 1 it loses; in between: within noise


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


def predicted_speedup(
    acceptance: float | Sequence[float],
    k: int,
    round_cost: float,
    reach: Sequence[float] | None = None,
) -> float:
    """Tokens per second of rounds drafting k tokens, relative to plain decoding: E(k) over
    the round's cost in plain steps. `acceptance`: one per-token rate for every position (the
    geometric model), or a rate per position."""
    if round_cost <= 0:
        return 0.0
    rates = [acceptance] * k if isinstance(acceptance, int | float) else list(acceptance)[:k]
    return expected_tokens(rates, reach) / round_cost


def estimate_alpha(accepted: int, drafted: int, full_rounds: int, rounds: int) -> float:
    """Per-token acceptance α, the maximum-likelihood estimate under the geometric model:
    accepted tokens / (accepted tokens + rejections). A round with fewer than k accepted
    ended in one rejection; a fully accepted round ended in none."""
    rejections = rounds - full_rounds
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def judge(speedup: float) -> str:
    """ "pays" (at least PAYS), "loses" (under 1: plain decoding is faster) or "even"."""
    if speedup >= PAYS:
        return "pays"
    return "loses" if speedup < 1.0 else "even"


@dataclass(frozen=True)
class Payoff:
    """The verdict on one draft length: k, its predicted speed-up over plain decoding, and
    the figures it rests on (per-token acceptance, a round's cost in plain steps)."""

    k: int
    speedup: float
    acceptance: float
    round_cost: float
    # an upper bound: nothing was drafted, and even a draft the target always accepted would
    # not pay at the measured costs (acceptance is then the 100 % assumed, not measured)
    bound: bool = False

    @classmethod
    def of(cls, acceptance: float, k: int, round_cost: float) -> Payoff:
        return cls(k, predicted_speedup(acceptance, k, round_cost), acceptance, round_cost)

    @property
    def judgement(self) -> str:
        return judge(self.speedup)

    @property
    def pays(self) -> bool:
        return self.judgement == "pays"

    def figures(self) -> str:
        cost = f"a round costs {self.round_cost:.2f} plain steps"
        if self.bound:
            return f"{cost}, even if every draft token were accepted (none was tried)"
        return f"acceptance {self.acceptance:.0%}, {cost}"

    def sentence(self) -> str:
        """The verdict in the words every tool uses."""
        at = f"k={self.k} predicts {self.speedup:.2f}x plain decoding"
        if self.bound:
            at = f"even a perfect draft at k={self.k} predicts at most {self.speedup:.2f}x"
        if self.judgement == "pays":
            return f"speculation pays: {at}"
        if self.judgement == "even":
            return f"speculation about breaks even: {at}"
        return f"speculation does not pay here: {at}"

    def short(self) -> str:
        """The chat panel's form: "pays, 1.22x at k=1"."""
        word = {"pays": "pays", "even": "even", "loses": "does not pay"}[self.judgement]
        most = "at most " if self.bound else ""
        return f"{word}, {most}{self.speedup:.2f}x at k={self.k}"

    @classmethod
    def from_json(cls, d: dict) -> Payoff:
        return cls(d["k"], d["speedup"], d["acceptance"], d["round_cost"], d.get("bound", False))

    def to_json(self) -> dict:
        return {
            "k": self.k,
            "speedup": round(self.speedup, 3),
            "acceptance": round(self.acceptance, 4),
            "round_cost": round(self.round_cost, 3),
            "verdict": self.judgement,
            "bound": self.bound,
        }
