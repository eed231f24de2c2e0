"""mlx-spec probe: is decoding memory-bound on this machine, and which k pays?"""

from __future__ import annotations

import json

from ..errors import SpecError
from ..measure.plots import check_plot
from .args import add_pair_args, nonnegative_int, pair_from_args, positive_int

SAMPLE_PROMPT = "Explain in a few sentences how a bicycle's gears make pedalling easier."
SAMPLE_K = 4
SAMPLE_TOKENS = 128  # tokens the sample for α may take, over one prompt or more (see below)
PREDICT_KS = range(1, 11)


BUDGET = 45.0  # seconds the measurements may take after loading, by default
CURVE_SHARE = 0.45  # of what the prefills leave: the target's verify curve (the rest: draft, α)
DRAFT_SHARE = 0.1
MIN_SAMPLE_ROUNDS = 4  # the sample for α runs at least this many rounds, past the budget too


def setup_arg_parser(parser):
    add_pair_args(parser)
    parser.add_argument(
        "--context", type=nonnegative_int, default=512, help="cached tokens while timing"
    )
    parser.add_argument("--temp", type=float, default=0.0, help="temperature of the sample run")
    parser.add_argument(
        "--sample-tokens",
        type=positive_int,
        default=SAMPLE_TOKENS,
        help=f"most tokens to sample for α (default {SAMPLE_TOKENS})",
    )
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=BUDGET,
        metavar="SECONDS",
        help=f"time the measurements may take after loading (default {BUDGET:.0f})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the curve and the predictions")


def positive_float(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def sample_acceptance(
    pair, temperature: float, max_tokens: int, deadline: float, clock, k: int = SAMPLE_K
):
    """Sample from `pair` at a fixed k until `max_tokens` or the deadline (after at least
    MIN_SAMPLE_ROUNDS rounds): SAMPLE_PROMPT, then `bench`'s built-in prompts in turn while
    replies end before `max_tokens` (the demo answered SAMPLE_PROMPT in 47 tokens whatever
    --sample-tokens asked, its head accepting 24 % of them against 22-52 % on bench's five
    prompts); the runs' stats, summed."""
    from ..core.stats import Stats
    from ..decode import generate
    from ..decode.config import GenerationConfig
    from ..measure.benchmark import PROMPTS

    stats = Stats()
    for text in (SAMPLE_PROMPT, *PROMPTS.values()):
        left = max_tokens - stats.generated_tokens
        done = clock() > deadline and stats.target_passes >= MIN_SAMPLE_ROUNDS
        if left <= 0 or done:
            break
        config = GenerationConfig(left, temperature, seed=0, num_draft_tokens=k)
        prompt = [{"role": "user", "content": text}]
        rounds = generate.stream_rounds(pair, prompt, config, stats=stats)
        for _ in rounds:
            if clock() > deadline and stats.target_passes >= MIN_SAMPLE_ROUNDS:
                rounds.close()
                return stats
    return stats


def own_ks(length) -> tuple[int, list[int]]:
    """The pair's own draft length -> (the k to sample acceptance at, the ks its verdict may
    choose from): a fixed k is that k; `auto` is the controller's range 1..k_max."""
    from ..core.policies import Fixed

    if isinstance(length, Fixed):
        return length.k, [length.k]
    return min(SAMPLE_K, length.k_max), list(range(1, length.k_max + 1))


def time_head(pair, ks, clock) -> dict[int, float]:
    """Seconds of the drafter's own `propose(k)` for each k (the second of two calls: the
    first pays one-time costs), on a throwaway decoder that prefilled the sample prompt: how
    a drafting head, which has no draft model to time step by step, is measured."""
    import mlx.core as mx

    from ..core.sampling import SamplingParams
    from ..decode.generate import make_decoder
    from ..decode.prompts import encode_prompt

    decoder = make_decoder(pair, seed=0)
    decoder.prefill(encode_prompt(pair.tokenizer, [{"role": "user", "content": SAMPLE_PROMPT}]))
    seconds = {}
    for k in ks:
        for _ in range(2):
            start = clock()
            tokens, _ = decoder.drafter.propose(k, SamplingParams(), None)
            mx.eval(tokens)
            seconds[k] = clock() - start
    return seconds


def run_probe(
    pair,
    context: int,
    temperature: float,
    sample_tokens: int,
    progress=print,
    budget: float = BUDGET,
    clock=None,
):
    """Measure the verify curve, the draft's cost and α within about `budget` seconds: each
    model's context is built once (verify_cost.PassTimer), the repetitions scale to the measured
    pass times, and the sample for α stops at the deadline (after MIN_SAMPLE_ROUNDS rounds)."""
    import time

    from ..core.payoff import estimate_alpha, judge
    from ..measure.verify_cost import (
        PassTimer,
        ProbeResult,
        classify_regime,
        fill_curve,
        predict,
        time_passes,
        verdict,
    )
    from ..runtime import blas

    clock = clock or time.perf_counter
    begin = clock()
    deadline = begin + budget
    length = pair.config.num_draft_tokens
    sample_k, ks = own_ks(length)
    predict_ks = sorted({*PREDICT_KS, *ks})
    sizes = sorted({*range(1, max(predict_ks) + 2), 16})
    progress(f"BLAS: {blas.describe()}")
    progress(f"building {context} tokens of context…")
    vocab = pair.vocab_size
    target = PassTimer(pair.target, context, sizes[-1], vocab, clock)
    # prompt lookup costs a few dictionary operations: nothing next to a model step
    draft = None
    if pair.speculative and pair.draft is not None:
        draft = PassTimer(pair.draft, context, 1, vocab, clock)
    left = deadline - clock()
    share = CURVE_SHARE if pair.speculative else 1.0
    progress(f"timing the target's verify pass for n = 1..{sizes[-1]}…")
    seconds, reps = time_passes(target, sizes, share * left)
    t1 = seconds[1]
    curve = [t / t1 for t in fill_curve(sizes, seconds)]
    regime = classify_regime(sizes, curve)
    result = ProbeResult(blas.describe(), context, sizes, curve, regime, t1, None, None)
    result.timed_sizes, result.repetitions = sorted(seconds), reps
    result.passes = target.passes
    if pair.speculative:
        progress("timing the draft…")
        draft_seconds, drafting = 0.0, None
        if draft is not None:
            draft_seconds = time_passes(draft, [1], DRAFT_SHARE * left, min_sizes=1)[0][1]
            result.passes += draft.passes
        elif pair.head is not None:  # a drafting head: timed through its drafter's propose
            drafting = time_head(pair, predict_ks, clock)
            draft_seconds = drafting[1]
        result.draft_cost = draft_seconds / t1
        result.k_policy = str(length)
        progress(f"sampling up to {sample_tokens} tokens at k={sample_k} to estimate acceptance…")
        stats = sample_acceptance(pair, temperature, sample_tokens, deadline, clock, sample_k)
        hist = stats.accepted_lengths + [0] * (sample_k + 1 - len(stats.accepted_lengths))
        accepted = sum(i * h for i, h in enumerate(hist))
        result.alpha = estimate_alpha(accepted, stats.drafted, hist[sample_k], sum(hist))
        result.sample_tokens, result.sample_rounds = stats.generated_tokens, stats.target_passes
        by_n = dict(zip(sizes, curve, strict=True))
        result.predictions = predict(
            result.alpha, result.draft_cost, by_n, t1, predict_ks, drafting
        )
        best = max(result.predictions, key=lambda p: p.tokens_per_second)
        result.recommended_k = best.k if judge(best.speedup) == "pays" else None
        # the verdict is on the pair's own k policy: its fixed k, or the best of auto's range
        own = max((p for p in result.predictions if p.k in ks), key=lambda p: p.speedup)
        result.verdict_k, result.judgement = own.k, judge(own.speedup)
        result.verdict = verdict(regime, result.draft_cost, result.alpha, own)
        if best.k != own.k and best.speedup > own.speedup and result.recommended_k:
            result.verdict += (
                f"; the best k here is {best.k} ({best.speedup:.2f}x): --num-draft-tokens {best.k}"
            )
    else:
        result.verdict = verdict(regime, None, None, None)
    result.seconds = clock() - begin
    return result


def format_table(r) -> str:
    lines = [
        f"BLAS            {r.blas}",
        f"target          {1 / r.target_step_seconds:.1f} tokens/s plain "
        f"({r.target_step_seconds * 1000:.1f} ms/step)",
        "verify curve    T(n)/T(1): "
        + "  ".join(
            f"{n}:{t:.2f}" for n, t in zip(r.sizes, r.curve, strict=True) if n in (2, 4, 8, 16)
        ),
        f"                medians of {r.repetitions} passes (after a warm-up) at n = "
        + ",".join(map(str, r.timed_sizes))
        + ("" if len(r.timed_sizes) == len(r.sizes) else "; the others interpolated"),
        f"regime          {r.regime}",
    ]
    if r.draft_cost is not None:
        lines += [
            f"draft cost c    {r.draft_cost:.2f} x a target step",
            f"acceptance α    {r.alpha:.2f} per token "
            f"({r.sample_tokens} tokens sampled in {r.sample_rounds} rounds)",
            "",
            " k  tokens/round  predicted tok/s  speedup",
        ]
        for p in r.predictions:
            marks = []
            if p.k == r.verdict_k:
                own = "auto's best" if r.k_policy == "auto" else f"the pair's k ({r.k_policy})"
                marks.append(own)
            if p.k == r.recommended_k and p.k != r.verdict_k:
                marks.append("best")
            mark = f"  <- {', '.join(marks)}" if marks else ""
            lines.append(
                f"{p.k:>2}  {p.tokens_per_round:>12.2f}  {p.tokens_per_second:>15.1f}  "
                f"{p.speedup:>6.2f}x{mark}"
            )
    lines += ["", r.verdict, f"(measured in {r.seconds:.0f} s after loading)"]
    return "\n".join(lines)


def plot(r, path: str) -> None:
    from ..measure.plots import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(r.sizes, r.curve, "o-", label="measured")
    left.plot(r.sizes, r.sizes, "--", color="grey", label="compute-bound (linear)")
    left.axhline(1, ls=":", color="grey", label="memory-bound (flat)")
    left.set(
        xlabel="tokens verified in one pass, n",
        ylabel="T(n) / T(1)",
        title=f"verify cost ({r.regime})",
    )
    left.legend()
    if r.predictions:
        ks = [p.k for p in r.predictions]
        right.bar(ks, [p.speedup for p in r.predictions])
        right.axhline(1, color="red", ls="--", label="plain decoding")
        right.set(
            xlabel="draft length k",
            ylabel="predicted speedup",
            title=f"α={r.alpha:.2f}, c={r.draft_cost:.2f}",
        )
        right.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(args):
    import sys

    if args.temp < 0 or args.temp != args.temp:
        raise SpecError(f"--temp must be >= 0, got {args.temp}")
    check_plot(args.plot)
    pair = pair_from_args(args)  # the memory check counts a KV cache of --context tokens
    longest = args.context + max(PREDICT_KS) + 6  # the verify curve's largest pass is 16
    if pair.context_length and longest > pair.context_length:
        raise SpecError(
            f"--context {args.context} plus the timed passes exceeds the target's context of "
            f"{pair.context_length} tokens"
        )
    from .progress import Stages

    if args.json:
        say = lambda *_: None  # noqa: E731
        result = run_probe(pair, args.context, args.temp, args.sample_tokens, say, args.budget)
    else:  # stage lines on stderr; on a terminal, a bar over the time budget
        with Stages(args.budget, by_time=True, stream=sys.stderr) as say:
            result = run_probe(pair, args.context, args.temp, args.sample_tokens, say, args.budget)
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    return 0
