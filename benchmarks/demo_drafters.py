"""The demo target's drafters side by side: plain, its EAGLE-3 head, 3- and 4-bit self-drafts,
a LoRA-distilled self-draft and prompt lookup, in one process, interleaved, medians.

Every configuration decodes the same chat prompts (`benchmarks/chat_prompts.txt`, never trained
on) at each temperature, run by run in a rotating order, so a noisy machine slows them alike;
the table gives each one's median tokens/s, its ratio to mlx-spec plain (ratio of medians, per
temperature), tokens per target pass, and whether its greedy output is the plain output.

    flock /tmp/bench.lock python benchmarks/demo_drafters.py            # the shipped head
    flock /tmp/bench.lock python benchmarks/demo_drafters.py --head DIR # another head
    flock /tmp/bench.lock python benchmarks/demo_drafters.py --head A --head B  # two, side by side
    # with a LoRA self-draft from `mlx-spec distill --pair smollm2-self --draft-bits 3`:
    flock /tmp/bench.lock python benchmarks/demo_drafters.py --lora ADAPTER
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from mlx_spec.decode.prompts import encode_prompt
from mlx_spec.errors import SpecError
from mlx_spec.measure.benchmark import run_mlx_lm, run_mlx_spec
from mlx_spec.pairs.loading import load_pair, pair_config

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "chat_prompts.txt"
DEMO = "smollm2-demo"


def configurations(args) -> dict[str, dict]:
    """name -> pair_config keywords (over the demo target)."""
    made = {"plain": {"skip_draft": True}}
    # the demo pair's own head (shipped in the package) unless --head names others, at each
    # draft length of --head-k; two heads or more are told apart by their paths as given
    heads = args.head or [None]
    for where in heads:
        head = {"drafter": "eagle3", "head": where} if where else {}
        label = f" {where}" if len(heads) > 1 else ""
        for k in args.head_k.split(","):
            # k "1" or "auto": as --k
            made[f"EAGLE-3 head{label} k={k}"] = {**head, "num_draft_tokens": k}
    made["self-draft 3-bit"] = {"drafter": "model", "draft_bits": 3}
    made["self-draft 4-bit"] = {"drafter": "model", "draft_bits": 4}
    if args.lora:
        made["self-draft 3-bit + LoRA"] = {
            "drafter": "model",
            "draft_bits": 3,
            "draft_adapter": args.lora,
        }
    made["prompt lookup"] = {"drafter": "ngram"}
    return {n: c for n, c in made.items() if not args.only or n in args.only.split(",")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--head",
        action="append",
        help="an EAGLE-3 head directory (default: the demo's shipped head); again for another",
    )
    p.add_argument("--head-k", default="auto", help="the head's draft lengths, e.g. 1,auto")
    p.add_argument("--lora", help="a LoRA adapter for the 3-bit self-draft")
    p.add_argument("--temps", default="0,0.7")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--only", help="configurations to run, comma-separated")
    p.add_argument("--json", type=Path, help="write every run here")
    args = p.parse_args(argv)

    temps = [float(t) for t in args.temps.split(",")]
    prompts = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    # a bad --head-k or --lora: one line, exit 2, before anything loads; a --head that is not
    # a head folder: one line when its pair loads
    try:
        configs = {
            name: pair_config(DEMO, **changes) for name, changes in configurations(args).items()
        }
        pairs = {}
        for name, config in configs.items():
            print(f"loading {name}…", file=sys.stderr)
            pairs[name] = load_pair(config)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    names = ["mlx-lm plain", *pairs]
    runs = []  # (name, temperature, prompt index, run index, Run)
    for r in range(args.runs):
        for i, text in enumerate(prompts):
            plain = pairs["plain"]
            ids = encode_prompt(plain.tokenizer, [{"role": "user", "content": text}])
            for t in temps:
                shift = (r + i) % len(names)
                for name in names[shift:] + names[:shift]:
                    if name == "mlx-lm plain":
                        run = run_mlx_lm(plain, ids, args.max_tokens, t, 0, seed=r)
                    else:
                        pair = pairs[name]
                        k = 0 if name == "plain" else pair.config.num_draft_tokens
                        run = run_mlx_spec(pair, ids, args.max_tokens, t, k, seed=r)
                    runs.append((name, t, i, r, run))
                    print(
                        f"run {r + 1}/{args.runs} prompt {i + 1} T={t} {name}: "
                        f"{run.tokens_per_second:.1f} tok/s",
                        file=sys.stderr,
                    )
    print(table(runs, names, temps))
    if args.json:
        args.json.write_text(json.dumps([
            {"config": n, "temperature": t, "prompt": i, "run": r,
             "tokens_per_second": x.tokens_per_second, "tokens": x.tokens,
             "accepted": x.accepted, "drafted": x.drafted, "passes": x.target_passes}
            for n, t, i, r, x in runs
        ]))  # fmt: skip
    return 0


def table(runs, names, temps) -> str:
    lines = [
        "| configuration | T | median tok/s | × mlx-spec plain | tokens / target pass "
        "| acceptance | greedy output = plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in temps:
        med = {}
        for n in names:
            med[n] = statistics.median(x.tokens_per_second for m, tt, _, _, x in runs
                                       if m == n and tt == t)  # fmt: skip
        plain_out = {(i, r): x.tokens for m, tt, i, r, x in runs if m == "plain" and tt == t}
        for n in names:
            mine = [(i, r, x) for m, tt, i, r, x in runs if m == n and tt == t]
            tokens = sum(len(x.tokens) for _, _, x in mine)
            passes = sum(x.target_passes for _, _, x in mine)
            drafted = sum(x.drafted for _, _, x in mine)
            accepted = sum(x.accepted for _, _, x in mine)
            same = all(x.tokens == plain_out[i, r] for i, r, x in mine) if t == 0 else None
            lines.append(
                f"| {n} | {t:g} | {med[n]:.1f} | {med[n] / med['plain']:.2f}x | "
                + (f"{tokens / passes:.2f}" if passes else "–")
                + " | "
                + (f"{accepted / drafted:.0%}" if drafted else "–")
                + f" | {'–' if same is None else ('yes' if same else 'NO')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
