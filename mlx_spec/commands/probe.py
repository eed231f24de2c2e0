"""mlx-spec probe: is decoding memory-bound on this machine, and which k pays?"""

from __future__ import annotations

import json

from ..cli import add_pair_args, nonnegative_int, pair_from_args, positive_int
from ..errors import SpecError

SAMPLE_PROMPT = "Explain in a few sentences how a bicycle's gears make pedalling easier."
SAMPLE_K = 4
PREDICT_KS = range(1, 11)


def setup_arg_parser(parser):
    add_pair_args(parser)
    parser.add_argument(
        "--context", type=nonnegative_int, default=512, help="cached tokens while timing"
    )
    parser.add_argument("--temp", type=float, default=0.0, help="temperature of the sample run")
    parser.add_argument(
        "--sample-tokens", type=positive_int, default=48, help="tokens to sample for α"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the curve and the predictions")


def run_probe(pair, context: int, temperature: float, sample_tokens: int, progress=print):
    from .. import blas
    from ..engine import generate
    from ..probe import (
        ProbeResult,
        classify_regime,
        estimate_alpha,
        predict,
        step_seconds,
        verdict,
    )

    sizes = sorted({*range(1, max(PREDICT_KS) + 2), 16})
    progress(f"BLAS: {blas.describe()}")
    progress(
        f"timing the target's verify pass for n = 1..{sizes[-1]} at {context} tokens of context…"
    )
    t1 = step_seconds(pair.target, 1, context)
    curve = [1.0] + [step_seconds(pair.target, n, context) / t1 for n in sizes[1:]]
    regime = classify_regime(sizes, curve)
    result = ProbeResult(blas.describe(), context, sizes, curve, regime, t1, None, None)
    if pair.speculative:
        progress("timing the draft…")
        # prompt lookup costs a few dictionary operations: nothing next to a model step
        draft_seconds = step_seconds(pair.draft, 1, context) if pair.draft is not None else 0.0
        result.draft_cost = draft_seconds / t1
        progress(f"sampling {sample_tokens} tokens at k={SAMPLE_K} to estimate acceptance…")
        res = generate(
            pair,
            [{"role": "user", "content": SAMPLE_PROMPT}],
            max_tokens=sample_tokens,
            temperature=temperature,
            num_draft_tokens=SAMPLE_K,
            seed=0,
        )
        hist = res.stats.accepted_lengths + [0] * (SAMPLE_K + 1 - len(res.stats.accepted_lengths))
        accepted = sum(i * h for i, h in enumerate(hist))
        result.alpha = estimate_alpha(accepted, res.stats.drafted, hist[SAMPLE_K], sum(hist))
        by_n = dict(zip(sizes, curve, strict=True))
        result.predictions = predict(result.alpha, result.draft_cost, by_n, t1, PREDICT_KS)
        best = max(result.predictions, key=lambda p: p.tokens_per_second)
        result.recommended_k = best.k if best.speedup >= 1.05 else None
        result.verdict = verdict(regime, result.draft_cost, result.alpha, best)
    else:
        result.verdict = verdict(regime, None, None, None)
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
        f"regime          {r.regime}",
    ]
    if r.draft_cost is not None:
        lines += [
            f"draft cost c    {r.draft_cost:.2f} x a target step",
            f"acceptance α    {r.alpha:.2f} per token",
            "",
            " k  tokens/round  predicted tok/s  speedup",
        ]
        for p in r.predictions:
            mark = "  <- recommended" if p.k == r.recommended_k else ""
            lines.append(
                f"{p.k:>2}  {p.tokens_per_round:>12.2f}  {p.tokens_per_second:>15.1f}  "
                f"{p.speedup:>6.2f}x{mark}"
            )
    lines += ["", r.verdict]
    return "\n".join(lines)


def plot(r, path: str) -> None:
    from ..plotting import pyplot

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
    pair = pair_from_args(args)  # the memory check counts a KV cache of --context tokens
    longest = args.context + max(PREDICT_KS) + 6  # the verify curve's largest pass is 16
    if pair.context_length and longest > pair.context_length:
        raise SpecError(
            f"--context {args.context} plus the timed passes exceeds the target's context of "
            f"{pair.context_length} tokens"
        )
    quiet = lambda *_: None  # noqa: E731
    result = run_probe(
        pair,
        args.context,
        args.temp,
        args.sample_tokens,
        progress=quiet if args.json else (lambda m: print(m, file=sys.stderr)),
    )
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    return 0
