"""Is decoding memory-bound here? Measure the verify cost curve and predict the speed-up.

Speculation pays when verifying n tokens costs about what producing 1 costs (memory-bound)
and the draft is cheap. `probe` measures both on this machine and predicts tokens/s per k
from the measured curve rather than from the idealised formula.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ..core import caches
from ..core.caches import prefill_cache
from ..core.payoff import Payoff, predicted_speedup

# Regimes by the extra cost of each verified token, as a fraction of a decode step (the slope
# of T(n)/T(1)): flat is purely memory-bound, 1 is purely compute-bound.
MEMORY_BOUND_SLOPE = 0.25  # verifying 5 tokens costs at most 2 steps: speculation can pay
COMPUTE_BOUND_SLOPE = 0.6  # close to linear: every drafted token costs most of a step


# Pass sizes in the order a tight budget times them: the ends (the regime's slope), then the
# small sizes the predictions lean on most, then the rest; untimed sizes are interpolated.
PRIORITY = (1, 16, 2, 4, 8, 3, 6, 11, 5, 7, 9, 10, 12, 13, 14, 15)
MIN_REPS = 3  # timed passes per size at least: a median of three
MAX_REPS = 7  # ... at most, when the budget allows


# Context tokens a PassTimer runs through the model; the rest of the context repeats their keys
# and values. Prefilling 512 tokens of the demo pair took 43 s (target) and 53 s (draft) on the
# reference BLAS here — more than the whole probe may take.
PREFIX = 8
CHUNK = 512  # tokens per prefill chunk


def extend_context(cache: list, n: int) -> bool:
    """Grow every attention layer of a prefilled cache by `n` positions that repeat the keys
    and values it holds. A pass's work depends on the shapes it attends over, not on the
    values in them, so it then costs what it costs after a real context of that length.
    Recurrent layers keep their state (its size does not grow with the context). Returns False,
    changing nothing, when some layer is of a kind this does not know how to grow."""
    leaves = caches._leaves(cache)
    grown = [c for c in leaves if type(c) in (KVCache, caches.WindowedKVCache)]
    if len(grown) + sum(isinstance(c, ArraysCache) for c in leaves) != len(leaves):
        return False
    if any(c.keys is None or c.size() == 0 for c in grown):
        return False  # nothing to repeat
    for c in grown:
        keys, values = c.keys_and_values()
        reps = -(-n // keys.shape[2])
        c.update_and_fetch(
            mx.concatenate([keys] * reps, axis=2)[..., :n, :],
            mx.concatenate([values] * reps, axis=2)[..., :n, :],
        )
    caches.eval_state(cache)
    return True


class PassTimer:
    """Forward passes over `n` new tokens after `context` cached ones, all from one prefill.

    The model prefills the first PREFIX tokens of the context, and `extend_context` repeats
    their keys and values up to `context` positions (`full=True`, or a cache kind it cannot
    grow: the model prefills all of them). After each pass the cache is put back (recurrent
    layers restored from a snapshot, attention layers trimmed), so every pass starts from the
    same state. `prefilled` counts the tokens the model was fed to build the context, `passes`
    the passes run since."""

    def __init__(
        self, model, context: int, largest: int, vocab: int | None = None, clock=None, full=False
    ):
        self.model, self.context = model, context
        self.clock = clock or time.perf_counter
        # token ids the model has embeddings for (an id past them reads garbage: NaN logits)
        vocab = vocab or getattr(getattr(model, "args", None), "vocab_size", None) or 1000
        self.tokens = mx.arange(context + largest) % min(vocab, 1000)
        self.cache = caches.make_cache(model)
        begin = self.clock()
        self._prefill(0, context if full else min(context, PREFIX))
        # grown chunk by chunk, as a prefill would: a sliding-window layer then keeps the
        # same number of past tokens (it compacts when a chunk goes past its margin)
        grown = self.prefilled
        for end in [*range(CHUNK, context, CHUNK), context]:
            if end <= grown:
                continue
            if not extend_context(self.cache, end - grown):
                self._prefill(grown, context)
                break
            grown = end
        self.prefill_seconds = self.clock() - begin
        self.saved = caches.snapshot(self.cache)
        self.passes = 0

    def _prefill(self, begin: int, end: int) -> None:
        prefill_cache(self.model, self.cache, self.tokens[begin:end].tolist(), step=CHUNK)
        self.prefilled = end

    def run(self, n: int) -> float:
        """Seconds of one pass over n tokens (then rolled back)."""
        begin = self.clock()
        mx.eval(self.model(self.tokens[None, self.context : self.context + n], cache=self.cache))
        seconds = self.clock() - begin
        caches.restore(self.cache, self.saved)
        caches.rollback(self.cache, n, skip_recurrent=True)
        self.passes += 1
        return seconds


def plan_passes(
    estimate, sizes, budget: float, min_sizes: int = 3, min_reps=MIN_REPS, max_reps=MAX_REPS
) -> tuple[list[int], int]:
    """Which sizes to time and how many timed passes of each, so that a warm-up pass plus the
    timed ones of every chosen size fit `budget` seconds, by `estimate(n)` seconds a pass.

    Sizes are taken in PRIORITY order; at least `min_sizes` of them (the floor on a machine
    too slow for the budget) at `min_reps`; more repetitions, up to `max_reps`, only once every
    size fits."""
    order = [n for n in PRIORITY if n in sizes] + sorted(set(sizes) - set(PRIORITY))

    def cost(chosen, reps):
        return (reps + 1) * sum(estimate(n) for n in chosen)

    chosen = order[:min_sizes]
    for n in order[min_sizes:]:
        if cost([*chosen, n], min_reps) > budget:
            break
        chosen.append(n)
    reps = min_reps
    while len(chosen) == len(order) and reps < max_reps and cost(chosen, reps + 1) <= budget:
        reps += 1
    return sorted(chosen), reps


def time_passes(timer: PassTimer, sizes, budget: float, min_sizes: int = 3):
    """Median seconds of one pass for each size timed within `budget` seconds (see
    `plan_passes`), and the timed passes per size.

    A pilot pass at each end of `sizes` (after a warm-up pass of that size) gives the per-size
    estimate the plan scales by. Every size gets a warm-up pass before its timed ones, and the
    timed passes go in rounds, each visiting the sizes in a rotated order, so a burst of load
    from elsewhere on the machine spreads over all sizes rather than skewing one."""
    clock, begin = timer.clock, timer.clock()
    ends = sorted({min(sizes), max(sizes)})
    samples: dict[int, list[float]] = {}
    for n in ends:
        timer.run(n)  # warm-up: the first pass of a shape pays one-time costs
        samples[n] = [timer.run(n)]
    lo, hi = ends[0], ends[-1]
    t_lo, t_hi = samples[lo][0], samples[hi][0]

    def estimate(n):
        return t_lo if hi == lo else t_lo + (n - lo) * (t_hi - t_lo) / (hi - lo)

    # the plan counts the pilot's passes (a warm-up and a timed one per end) at the estimate;
    # what the warm-ups took beyond it comes off the budget
    excess = clock() - begin - 2 * sum(samples[n][0] for n in ends)
    chosen, reps = plan_passes(estimate, sizes, budget - max(excess, 0.0), min_sizes)
    for n in chosen:
        if n not in samples:
            timer.run(n)
            samples[n] = []
    for r in range(reps):
        for n in chosen[r % len(chosen) :] + chosen[: r % len(chosen)]:
            if len(samples[n]) < reps:
                samples[n].append(timer.run(n))
    return {n: statistics.median(s) for n, s in sorted(samples.items())}, reps


def fill_curve(sizes, seconds: dict[int, float]) -> list[float]:
    """Seconds for every n in `sizes`: the measured median where timed, else linear between
    the nearest timed sizes on either side (both ends are always timed)."""
    timed = sorted(seconds)
    out = []
    for n in sizes:
        if n in seconds:
            out.append(seconds[n])
            continue
        lo = max(m for m in timed if m < n)
        hi = min(m for m in timed if m > n)
        out.append(seconds[lo] + (n - lo) * (seconds[hi] - seconds[lo]) / (hi - lo))
    return out


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


@dataclass
class Prediction:
    k: int
    tokens_per_round: float
    tokens_per_second: float
    speedup: float
    round_cost: float = 0.0  # in plain steps


def predict(
    alpha: float, c: float, curve: dict[int, float], t1: float, ks, drafting=None
) -> list[Prediction]:
    """Tokens/s per k from the measured curve: a round costs k draft steps (c·T(1) each)
    plus one verify pass over k+1 tokens, T(k+1). `drafting`: the measured seconds of
    drafting k tokens, by k, where they are not k steps (a drafting head: DFlash drafts its
    block in one forward)."""
    out = []
    for k in ks:
        draft_seconds = drafting[k] if drafting is not None else k * c * t1
        round_cost = (draft_seconds + curve[k + 1] * t1) / t1  # in plain steps
        speedup = predicted_speedup(alpha, k, round_cost)  # the geometric model: α everywhere
        tokens = speedup * round_cost
        out.append(Prediction(k, tokens, speedup / t1, speedup, round_cost))
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
    recommended_k: int | None = None  # the best k of all it predicted, if it pays
    verdict: str = ""
    k_policy: str = ""  # the pair's own draft length: "1", "auto"
    verdict_k: int | None = None  # the k the verdict is on: the pair's, or auto's best
    judgement: str | None = None  # payoff.judge of the verdict's k: pays / even / loses
    timed_sizes: list[int] = field(default_factory=list)  # the rest of `sizes` interpolated
    repetitions: int = 0  # timed passes per timed size (after a warm-up pass each)
    passes: int = 0  # forward passes timed or warming up, target and draft
    sample_tokens: int = 0  # tokens sampled for α
    sample_rounds: int = 0
    seconds: float = 0.0  # wall time of the measurements (after loading)

    def to_json(self) -> dict:
        return {
            "blas": self.blas,
            "context": self.context,
            "verify_cost_curve": {
                str(n): round(t, 3) for n, t in zip(self.sizes, self.curve, strict=True)
            },
            "timed_sizes": self.timed_sizes,
            "repetitions": self.repetitions,
            "regime": self.regime,
            "target_tokens_per_second": round(1 / self.target_step_seconds, 2),
            "draft_cost_ratio": None if self.draft_cost is None else round(self.draft_cost, 3),
            "alpha": None if self.alpha is None else round(self.alpha, 3),
            "sample": None
            if self.alpha is None
            else {"tokens": self.sample_tokens, "rounds": self.sample_rounds},
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
            "k_policy": self.k_policy,
            "verdict_k": self.verdict_k,
            "judgement": self.judgement,
            "verdict": self.verdict,
            "passes": self.passes,
            "seconds": round(self.seconds, 2),
        }


def verdict(regime: str, c: float | None, alpha: float | None, best: Prediction | None) -> str:
    """The verdict on `best` (the prediction at the pair's own k, or the best of its range),
    in the words every tool uses (payoff.Payoff), with the reasons when it does not pay."""
    if c is None or best is None:
        return f"decoding is {regime} here; no draft to evaluate"
    payoff = Payoff(best.k, best.speedup, alpha or 0.0, best.round_cost)
    if payoff.judgement == "pays":
        return payoff.sentence()
    reasons = []
    if regime != "memory-bound":
        reasons.append(f"the verify pass is {regime} (checking k tokens costs ~k steps)")
    if c > 0.5:
        reasons.append(f"the draft costs {c:.2f}x a target step (it should be < 0.2)")
    if alpha is not None and alpha < 0.5:
        reasons.append(f"acceptance is low (α={alpha:.2f})")
    why = "; ".join(reasons) or "the gain is within noise"
    if payoff.judgement == "even":
        return f"{payoff.sentence()} ({why}); compare with --no-draft"
    return f"{payoff.sentence()} ({why}); use --no-draft"
