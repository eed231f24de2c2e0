"""mlx-spec bench: mlx-lm plain and speculative against mlx-spec, interleaved in one process."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ..errors import SpecError
from ..measure.plots import check_plot
from .args import add_pair_args, pair_from_args, positive_int


def float_list(text: str) -> list[float]:
    """e.g. "0,0.7": temperatures, each finite and >= 0."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,0.7, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and >= 0, got {text!r}")
    return values


def k_list(text: str) -> list:
    """e.g. "2,4,auto": draft lengths, "auto" for the adaptive policy."""
    try:
        return [x.strip() if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected draft lengths like 2,4,auto, got {text!r}"
        ) from None


def setup_arg_parser(parser):
    add_pair_args(parser)
    parser.add_argument("--prompts", help="a file of prompts, one per line (default: built-in set)")
    parser.add_argument(
        "--only", metavar="NAMES", help="built-in prompts to run, e.g. summarisation,'code edit'"
    )
    parser.add_argument("--temps", type=float_list, default=[0.0, 0.7], help="e.g. 0,0.7")
    parser.add_argument("--k", type=k_list, default=[2, 4, 6], help="draft lengths, e.g. 2,4,auto")
    parser.add_argument(
        "--runs", type=positive_int, default=3, help="repetitions of every configuration"
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=128, help="tokens per generation"
    )
    parser.add_argument("--by-prompt", action="store_true", help="a row per prompt as well")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of the speedups")


def read_prompts(path: str | None, only: str | None = None) -> dict[str, str]:
    from ..measure.benchmark import PROMPTS

    if path is not None and only is not None:
        raise SpecError("--only picks built-in prompts; it does not go with --prompts")
    if only is not None:
        names = [name.strip() for name in only.split(",") if name.strip()]
        unknown = [name for name in names if name not in PROMPTS]
        if unknown or not names:
            known = ", ".join(PROMPTS)
            raise SpecError(f"unknown built-in prompt {', '.join(unknown)!r}; known: {known}")
        return {name: PROMPTS[name] for name in names}
    if path is None:
        return PROMPTS
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read prompts file {path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise SpecError(f"prompts file {path} is not UTF-8 (byte {err.start})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise SpecError(f"prompts file {path} has no prompts")
    return {f"prompt {i + 1}": line for i, line in enumerate(lines)}


def plot(rows, path: str) -> None:
    from ..measure.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    labels = [f"{r.config}\nk={r.k or '-'} t={r.temperature:g}" for r in rows]
    ax.bar(range(len(rows)), [r.speedup for r in rows])
    ax.axhline(1, color="red", ls="--")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speedup over mlx-lm plain (median tok/s)")
    fig.tight_layout()
    fig.savefig(path)


def main(args):
    from ..models.distributed import rank_zero_prints

    if not args.k or any(k != "auto" and k < 1 for k in args.k):
        raise SpecError("--k takes draft lengths >= 1 or auto, e.g. 2,4,auto")
    if args.runs < 1:
        raise SpecError("--runs must be >= 1")
    prompts = read_prompts(args.prompts, args.only)
    check_plot(args.plot)
    pair = pair_from_args(args)
    with rank_zero_prints(pair):  # a target sharded over mlx.launch's ranks: rank 0 prints
        return report(pair, args, prompts)


def report(pair, args, prompts) -> int:
    from ..measure.benchmark import bench_configs, format_rows, run_bench, summarise, to_json
    from ..runtime.blas import describe
    from .progress import Stages

    if args.json:
        results = run_bench(pair, prompts, args.temps, args.k, args.runs, args.max_tokens)
    else:  # stage lines on stderr; on a terminal, a bar over the runs with the time left
        total = args.runs * len(prompts) * len(args.temps) * len(bench_configs(pair, args.k))
        with Stages(total) as say:
            say(f"BLAS: {describe()}")
            results = run_bench(
                pair, prompts, args.temps, args.k, args.runs, args.max_tokens, say, say.step
            )
    rows = summarise(results)
    if args.plot and (pair.link is None or pair.link.rank == 0):
        plot(rows, args.plot)
    if args.json:
        print(json.dumps(to_json(results)))
    else:
        print(format_rows(rows))
        if args.by_prompt:
            print()
            print(format_rows(summarise(results, by_prompt=True)))
    return 0
