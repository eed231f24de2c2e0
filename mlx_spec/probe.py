"""Is decoding memory-bound here? Measure the verify cost curve and predict the speed-up.

Speculation pays when verifying n tokens costs about what producing 1 costs (memory-bound)
and the draft is cheap. `probe` measures both on this machine and predicts tokens/s per k
from the measured curve rather than from the idealised formula.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from . import caches

# Regimes by the extra cost of each verified token, as a fraction of a decode step (the slope
# of T(n)/T(1)): flat is purely memory-bound, 1 is purely compute-bound.
MEMORY_BOUND_SLOPE = 0.25  # verifying 5 tokens costs at most 2 steps: speculation can pay
COMPUTE_BOUND_SLOPE = 0.6  # close to linear: every drafted token costs most of a step


def step_seconds(model, n: int, context: int, max_reps: int = 7, vocab: int = 1000) -> float:
    """Median seconds of one forward pass over `n` new tokens after `context` cached ones.

    Repeats up to `max_reps` times, fewer (at least 3) when one pass takes long."""
    cache = caches.make_cache(model)
    tokens = mx.arange(context + n) % vocab
    for start in range(0, context, 512):  # prefill in chunks, like the engine
        model(tokens[None, start : min(start + 512, context)], cache=cache)
        caches.eval_state(cache)
    saved = caches.snapshot(cache)
    times = []
    reps = max_reps
    for i in range(reps + 1):  # the first pass warms up
        begin = time.perf_counter()
        mx.eval(model(tokens[None, context:], cache=cache))
        times.append(time.perf_counter() - begin)
        caches.restore(cache, saved)  # every pass starts from the same state
        caches.rollback(cache, n, skip_recurrent=True)
        if i == 1:
            reps = max(3, min(max_reps, int(2.0 / times[1])))  # ~2 s per point
        if i >= reps:
            break
    times = sorted(times[1:])
    return times[len(times) // 2]


def verify_curve(model, sizes, context: int) -> list[float]:
    """T(n) / T(1) for each n in `sizes`."""
    base = step_seconds(model, 1, context)
    return [step_seconds(model, n, context) / base for n in sizes]


def curve_slope(sizes, curve) -> float:
    """Least-squares slope of T(n)/T(1) against n through (1, 1): extra cost per token."""
    xs = [n - 1 for n in sizes]
    ys = [t - 1 for t in curve]
    denom = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / denom if denom else 0.0


def classify_regime(sizes, curve) -> str:
    slope = curve_slope(sizes, curve)
    if slope < MEMORY_BOUND_SLOPE:
        return "memory-bound"
    if slope > COMPUTE_BOUND_SLOPE:
        return "compute-bound"
    return "in between"


def estimate_alpha(accepted: int, drafted: int, full_rounds: int, rounds: int) -> float:
    """Per-token acceptance α, the maximum-likelihood estimate under the geometric model:
    accepted tokens / (accepted tokens + rejections). A round with fewer than k accepted
    ended in one rejection; a fully accepted round ended in none."""
    rejections = rounds - full_rounds
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per round: (1 − α^(k+1)) / (1 − α) (Leviathan et al. 2023)."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class Prediction:
    k: int
    tokens_per_round: float
    tokens_per_second: float
    speedup: float


def predict(alpha: float, c: float, curve: dict[int, float], t1: float, ks) -> list[Prediction]:
    """Tokens/s per k from the measured curve: a round costs k draft steps (c·T(1) each)
    plus one verify pass over k+1 tokens, T(k+1)."""
    out = []
    for k in ks:
        round_seconds = k * c * t1 + curve[k + 1] * t1
        tokens = expected_tokens(alpha, k)
        tps = tokens / round_seconds
        out.append(Prediction(k, tokens, tps, tps * t1))
    return out


@dataclass
class ProbeResult:
    blas: str
    context: int
    sizes: list[int]
    curve: list[float]
    regime: str
    target_step_seconds: float
    draft_cost: float | None  # c: draft step / target step
    alpha: float | None
    predictions: list[Prediction] = field(default_factory=list)
    recommended_k: int | None = None
    verdict: str = ""

    def to_json(self) -> dict:
        return {
            "blas": self.blas,
            "context": self.context,
            "verify_cost_curve": {
                str(n): round(t, 3) for n, t in zip(self.sizes, self.curve, strict=True)
            },
            "regime": self.regime,
            "target_tokens_per_second": round(1 / self.target_step_seconds, 2),
            "draft_cost_ratio": None if self.draft_cost is None else round(self.draft_cost, 3),
            "alpha": None if self.alpha is None else round(self.alpha, 3),
            "predictions": [
                {
                    "k": p.k,
                    "tokens_per_round": round(p.tokens_per_round, 3),
                    "tokens_per_second": round(p.tokens_per_second, 2),
                    "speedup": round(p.speedup, 3),
                }
                for p in self.predictions
            ],
            "recommended_k": self.recommended_k,
            "verdict": self.verdict,
        }


def verdict(regime: str, c: float | None, alpha: float | None, best: Prediction | None) -> str:
    if c is None or best is None:
        return f"decoding is {regime} here; no draft to evaluate"
    if best.speedup >= 1.05:
        return f"speculation pays: k={best.k} predicts {best.speedup:.2f}x plain decoding"
    reasons = []
    if regime != "memory-bound":
        reasons.append(f"the verify pass is {regime} (checking k tokens costs ~k steps)")
    if c > 0.5:
        reasons.append(f"the draft costs {c:.2f}x a target step (it should be < 0.2)")
    if alpha is not None and alpha < 0.5:
        reasons.append(f"acceptance is low (α={alpha:.2f})")
    why = "; ".join(reasons) or "the gain is within noise"
    return f"speculation does not pay here: {why}. Use --no-draft"
