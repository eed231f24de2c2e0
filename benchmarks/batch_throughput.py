"""Aggregate tokens/s of `batch_generate` against `generate` run prompt after prompt.

For B = 1, 2, 4, 8 prompts (greedy, the same prompts for every method, each reply
`--max-tokens` long): sequential `generate` (the pair's k, `auto` by default), `batch_generate`
with `auto` (one k a round from the measured pass cost per row count: speculating where it
pays), and `batch_generate` with use_draft=False (plain continuous batching, k = 0). Runs are
interleaved (every method at every B once per run, after one warm-up call each), the table shows
medians, and every batched cell is checked token for token against the sequential output.
Run: flock /tmp/bench.lock python benchmarks/batch_throughput.py [--pair smollm2-self]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx_spec

PROMPTS = [
    "Tell me about the history of Paris.",
    "Write a Python function that reverses a list.",
    "What is speculative decoding?",
    "List three colours and what they make people feel.",
    "Explain how a bicycle stays upright.",
    "Summarise the plot of Romeo and Juliet.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]
SIZES = (1, 2, 4, 8)


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def sequential(pair, prompts, max_tokens):
    return [mlx_spec.generate(pair, p, max_tokens=max_tokens) for p in prompts]


def batched(pair, prompts, max_tokens, **settings):
    return mlx_spec.batch_generate(pair, prompts, max_tokens=max_tokens, **settings)


METHODS = {
    "sequential generate": sequential,
    "batch_generate auto": lambda pair, p, m: batched(pair, p, m, num_draft_tokens="auto"),
    "batch_generate k=0": lambda pair, p, m: batched(pair, p, m, use_draft=False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-self")
    parser.add_argument("--target", help="a target directory instead of --pair (with --draft)")
    parser.add_argument("--draft", help="its draft model (e.g. benchmarks/cheap_pair.py's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.target:
        pair = mlx_spec.load_pair(target=args.target, draft=args.draft)
        args.pair = f"{args.target} drafted by {args.draft}"
    else:
        pair = mlx_spec.load_pair(args.pair)
    for run in METHODS.values():  # one-time costs (allocation, first calls) out of the table
        run(pair, [messages(0)], 8)
    speeds = {(m, b): [] for m in METHODS for b in SIZES}
    drafted = {(m, b): 0 for m in METHODS for b in SIZES}
    identical = True
    for _ in range(args.runs):
        for b in SIZES:
            prompts = [messages(i) for i in range(b)]
            reference = None
            for name, run in METHODS.items():
                start = time.perf_counter()
                results = run(pair, prompts, args.max_tokens)
                seconds = time.perf_counter() - start
                tokens = [r.tokens for r in results]
                reference = reference or tokens
                identical &= tokens == reference
                speeds[name, b].append(sum(map(len, tokens)) / seconds)
                drafted[name, b] += sum(r.stats.drafted for r in results)
    table = {
        name: {b: round(statistics.median(speeds[name, b]), 2) for b in SIZES} for name in METHODS
    }
    if args.json:
        print(json.dumps({"pair": args.pair, "tokens_per_second": table, "identical": identical}))
        return
    print(f"{args.pair}: aggregate tokens/s, median of {args.runs} interleaved runs, ")
    print(f"{args.max_tokens} tokens a reply, greedy; output identical in every cell: {identical}")
    print(f"| method | {' | '.join(f'B={b}' for b in SIZES)} |")
    print(f"|---|{'---|' * len(SIZES)}")
    for name in METHODS:
        cells = [f"{table[name][b]:.1f}" for b in SIZES]
        print(f"| {name} | {' | '.join(cells)} |")
    base = table["sequential generate"]
    for name in list(METHODS)[1:]:
        ratios = ", ".join(f"B={b} {table[name][b] / base[b]:.2f}x" for b in SIZES)
        print(f"{name} / sequential: {ratios}")
    per_b = {b: drafted["batch_generate auto", b] // args.runs for b in SIZES}
    print(f"tokens drafted per run by batch_generate auto: {per_b}")


if __name__ == "__main__":
    main()
