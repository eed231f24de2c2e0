"""Structured output, speculating: tokens/s and tokens per target pass on five JSON Schemas.

For each schema of benchmarks/schemas.py, at temperature 0, on the demo target (SmolLM2-135M):

- plain:          constrained decoding, nothing drafted (the baseline)
- forced:         + the grammar's forced tokens drafted for free (no draft model)
- forced+model:   + the smollm2-self pair's 4-bit draft model (k auto)
- forced+lookup:  + prompt lookup (the smollm2-lookup pair, k auto)

Each configuration runs `--runs` times in a rotating order; medians are reported. Every output
must be valid against its schema (jsonschema) and identical across configurations, or the
benchmark fails. Mask time per token (llguidance, unpacking, EOS ids) is compared with the
plain target step (1 / plain tokens per second).

    flock /tmp/bench.lock python benchmarks/structured.py [--runs 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import mlx_spec  # noqa: E402  (first: OpenBLAS before mlx.core)
from mlx_spec import generate, load_pair  # noqa: E402

# isort: split
from schemas import PROMPTS, SCHEMAS  # noqa: E402

CONFIGS = ["plain", "forced", "forced+model", "forced+lookup"]


def main() -> int:
    import jsonschema

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--only", nargs="*", choices=list(SCHEMAS), help="these schemas only")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()

    demo = load_pair("smollm2-self")
    lookup = load_pair("smollm2-lookup")
    alone = load_pair("smollm2-demo", skip_draft=True)
    runs = {
        "plain": (alone, {"use_draft": False}),
        "forced": (alone, {}),
        "forced+model": (demo, {}),
        "forced+lookup": (lookup, {}),
    }
    print(f"{args.runs} runs per configuration, after one warm-up run", flush=True)
    results, failures = {}, []
    for name, schema in SCHEMAS.items():
        if args.only and name not in args.only:
            continue
        messages = [{"role": "user", "content": PROMPTS[name]}]
        constraint = mlx_spec.decode.prompts.constraint_for(alone, schema=schema)
        rows = {c: [] for c in CONFIGS}
        for run in range(args.runs + 1):  # run 0 warms up (not counted)
            order = CONFIGS[run % len(CONFIGS) :] + CONFIGS[: run % len(CONFIGS)]
            for config in order:
                pair, kwargs = runs[config]
                res = generate(
                    pair, messages, max_tokens=args.max_tokens, grammar=constraint, **kwargs
                )
                if run:
                    rows[config].append(res)
        texts = {c: rows[c][0].text for c in CONFIGS}
        if len({tuple(r.tokens) for c in CONFIGS for r in rows[c]}) != 1:
            failures.append(f"{name}: outputs differ across configurations")
        for c in CONFIGS:
            res = rows[c][0]
            if res.finish_reason != "stop":
                failures.append(f"{name}/{c}: cut at {len(res.tokens)} tokens")
                continue
            try:
                jsonschema.validate(json.loads(res.text), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as err:
                failures.append(f"{name}/{c}: invalid: {str(err).splitlines()[0]}")
        summary = {}
        for c in CONFIGS:
            stats = [r.stats for r in rows[c]]
            summary[c] = {
                "tokens": stats[0].generated_tokens,
                "tokens_per_second": statistics.median(s.tokens_per_second for s in stats),
                "tokens_per_target_pass": statistics.median(
                    s.tokens_per_target_pass for s in stats
                ),
                "forced_tokens": statistics.median(s.forced_tokens for s in stats),
                "accepted": statistics.median(s.accepted for s in stats),
                "mask_us_per_token": statistics.median(
                    s.mask_seconds / s.masks * 1e6 for s in stats if s.masks
                ),
            }
        plain = summary["plain"]["tokens_per_second"]
        step_us = 1e6 / plain if plain else float("nan")
        for c in CONFIGS:
            summary[c]["speedup"] = summary[c]["tokens_per_second"] / plain if plain else 0.0
        results[name] = {"text": texts["plain"], "target_step_us": step_us, "configs": summary}
        print(f"\n{name}: {summary['plain']['tokens']} tokens; {texts['plain'][:70]!r}")
        print(f"  {'config':14} {'tok/s':>7} {'x plain':>8} {'tok/pass':>9} {'forced':>7}")
        for c in CONFIGS:
            row = summary[c]
            print(
                f"  {c:14} {row['tokens_per_second']:7.1f} {row['speedup']:7.2f}x "
                f"{row['tokens_per_target_pass']:9.2f} {row['forced_tokens']:7.0f}"
            )
        mask = summary["plain"]["mask_us_per_token"]
        print(
            f"  mask {mask:.0f} us per token vs a plain target step of {step_us / 1e3:.1f} ms "
            f"({mask / step_us:.2%})",
            flush=True,
        )
    speedups = {
        c: statistics.median(results[s]["configs"][c]["speedup"] for s in results) for c in CONFIGS
    }
    print("\nmedian over schemas, x plain constrained decoding: " + ", ".join(
        f"{c} {v:.2f}x" for c, v in speedups.items()
    ))  # fmt: skip
    if args.out:
        Path(args.out).write_text(
            json.dumps({"time": time.strftime("%Y-%m-%d %H:%M"), "schemas": results}, indent=2)
        )
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
