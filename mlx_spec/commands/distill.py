"""mlx-spec distill: train a LoRA adapter that makes the draft agree with its target, or with
--drafter eagle3 an EAGLE-3 head for the target (train/eagle_head.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import SpecError
from ..measure.plots import check_plot
from .args import add_pair_args, nonnegative_int, pair_from_args, positive_int

DEFAULT_OUT = "draft-adapter"
DEFAULT_HEAD_OUT = "eagle3-head"


def fraction(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def setup_arg_parser(parser):
    from ..train.settings import LOSSES, HeadSettings, Settings

    d, h = Settings(), HeadSettings()

    def both(name):
        return f"(default: {getattr(d, name)}; {getattr(h, name)} with --drafter eagle3)"

    add_pair_args(parser, adapter=False)
    parser.add_argument(
        "--data",
        help="prompts to distil on: a .txt file (one per line), .jsonl (strings, or objects "
        "with prompt, text or messages), a .json chat saved by `mlx-spec chat`, any other "
        "text file or a folder (e.g. a code repository: its text files cut into prompts); "
        "default: a built-in mixed set",
    )
    parser.add_argument(
        "--out",
        help=f"the folder to write: the adapter (default: {DEFAULT_OUT}) or, with --drafter "
        f"eagle3, the head (default: {DEFAULT_HEAD_OUT})",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    g = parser.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, help=f"optimizer steps {both('steps')}")
    g.add_argument("--batch-size", type=positive_int, help=both("batch_size"))
    g.add_argument("--learning-rate", type=float, help=both("learning_rate"))
    g.add_argument("--rank", type=positive_int, default=d.rank, help="LoRA rank")
    g.add_argument(
        "--lora-layers",
        type=int,
        default=d.num_layers,
        help="LoRA in the last N blocks (-1: all)",
    )
    g.add_argument(
        "--loss",
        choices=LOSSES,
        default=d.loss,
        help="tv: 1 - Σ min(p, q), what acceptance measures; kl: forward KL(p || q)",
    )
    g.add_argument(
        "--reply-tokens", type=positive_int, help=f"tokens per reply {both('reply_tokens')}"
    )
    g.add_argument(
        "--max-length", type=positive_int, default=d.max_length, help="longest sequence trained"
    )
    g.add_argument(
        "--max-prompts", type=positive_int, help="use at most N prompts (a fixed random subset)"
    )
    g.add_argument(
        "--held-out", type=fraction, default=d.held_out, help="share of prompts never trained on"
    )
    g.add_argument("--temp", type=float, default=d.temperature, help="temperature of the replies")
    g.add_argument(
        "--eval-every", type=positive_int, default=d.eval_every, help="held-out check interval"
    )
    g.add_argument(
        "--save-every", type=positive_int, default=d.save_every, help="checkpoint interval"
    )
    g.add_argument("--seed", type=nonnegative_int, default=d.seed)
    g.add_argument(
        "--k", type=positive_int, default=d.k, help="draft length when measuring tokens per pass"
    )
    g.add_argument(
        "--eval-prompts",
        type=positive_int,
        default=d.eval_prompts,
        help="held-out prompts decoded with the pair before and after to count tokens per pass",
    )
    e = parser.add_argument_group(
        "an EAGLE-3 head (--drafter eagle3; --head DIR fine-tunes that published head)"
    )
    e.add_argument(
        "--ttt-steps",
        type=positive_int,
        default=h.ttt_steps,
        help="draft steps of test-time training (EAGLE-3's recipe: 7)",
    )
    e.add_argument(
        "--ttt-warmup",
        type=nonnegative_int,
        default=h.ttt_warmup,
        help="first steps that train draft step 1 alone, before all --ttt-steps (default 0)",
    )
    e.add_argument(
        "--draft-vocab",
        type=positive_int,
        default=h.draft_vocab,
        help="tokens the head can propose: the training replies' most frequent",
    )
    e.add_argument(
        "--head-intermediate",
        type=positive_int,
        help="the head's MLP width (default: the target's)",
    )
    e.add_argument(
        "--float32", action="store_true", help="write float32 weights (default: float16)"
    )
    parser.add_argument("--plot", metavar="FILE.png", help="plot the held-out acceptance curve")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def settings_from_args(args):
    from ..train.settings import HeadSettings, Settings

    head = args.drafter == "eagle3"
    d = HeadSettings() if head else Settings()
    extra = {}
    if head:
        extra = {
            "ttt_steps": args.ttt_steps,
            "ttt_warmup": args.ttt_warmup,
            "draft_vocab": args.draft_vocab,
            "intermediate": args.head_intermediate,
            "half": not args.float32,
        }
    return (HeadSettings if head else Settings)(
        **extra,
        steps=args.steps or d.steps,
        batch_size=args.batch_size or d.batch_size,
        learning_rate=d.learning_rate if args.learning_rate is None else args.learning_rate,
        rank=args.rank,
        num_layers=args.lora_layers,
        loss=args.loss,
        reply_tokens=args.reply_tokens or d.reply_tokens,
        max_length=args.max_length,
        held_out=args.held_out,
        eval_every=args.eval_every,
        save_every=args.save_every,
        seed=args.seed,
        temperature=args.temp,
        k=args.k,
        eval_prompts=args.eval_prompts,
        max_prompts=args.max_prompts,
    )


def base_of(args, pair) -> dict:
    """What the adapter was trained on: loading it over another draft kind is refused."""
    return {
        "target": args.target or args.pair,
        "draft": args.draft,
        "draft_bits": pair.config.draft_bits,
        "draft_group_size": pair.config.draft_group_size if pair.config.draft_bits else None,
    }


class Bar:
    """One status line on stderr: redrawn in place on a terminal, a line per check elsewhere."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # the one in place now, not at import
        self.tty = self.stream.isatty()

    def message(self, text: str) -> None:
        self.stream.write(("\r\x1b[2K" if self.tty else "") + text + ("" if self.tty else "\n"))
        self.stream.flush()

    def __call__(self, state, loss: float, settings) -> None:
        last = state.history[-1] if state.history else None
        checked = bool(last) and last["step"] == state.step
        if not (self.tty or checked):
            return
        width = 24
        done = int(width * state.step / settings.steps)
        accept = f" held-out acceptance {last['acceptance_t1']:.3f}" if last else ""
        self.message(
            f"[{'#' * done}{'.' * (width - done)}] step {state.step}/{settings.steps} "
            f"loss {loss:.4f}{accept} ({state.seconds / max(state.step, 1):.1f} s/step)"
        )

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")


def main(args):
    from ..drafters import kind
    from ..pairs.loading import NO_ADAPTER
    from ..train.common import read_data
    from ..train.lora import distill, format_table

    if args.drafter == "eagle3":
        return main_head(args)
    if args.head:
        raise SpecError("--head is for --drafter eagle3 (the head to fine-tune)")
    if args.no_draft or (args.drafter and not kind(args.drafter).needs_model):
        flag = "--no-draft" if args.no_draft else f"--drafter {args.drafter}"
        raise SpecError(f"distill trains a draft model; drop {flag}")
    settings = settings_from_args(args)
    settings.check()
    prompts = read_data(args.data, args.max_prompts, args.seed)  # bad data fails before loading
    out = Path(args.out or DEFAULT_OUT).expanduser()
    check_plot(args.plot)
    bar = Bar()
    # train from the bare draft, whatever models.toml names
    pair = pair_from_args(args, progress=bar.message, draft_adapter=NO_ADAPTER)
    report = distill(
        pair, prompts, out, settings, base_of(args, pair), args.resume, bar.message, bar
    )
    bar.end()
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
        seconds = report["seconds"]
        print(
            f"\nadapter: {out} (replies {seconds['replies']:.0f} s, training "
            f"{seconds['training']:.0f} s); use it with --draft-adapter {out}"
        )
    if args.plot:
        plot_report(report, args.plot)
    return 0


def main_head(args):
    """--drafter eagle3: an EAGLE-3 head for the target, on its own replies."""
    from ..models.hub import resolve_head
    from ..train.common import read_data
    from ..train.eagle_head import check_out, format_table, train_head

    if args.no_draft or args.draft or args.draft_bits:
        raise SpecError("an EAGLE-3 head drafts from the target alone; drop the draft flags")
    settings = settings_from_args(args)
    settings.check()
    prompts = read_data(args.data, args.max_prompts, args.seed)  # bad data fails before loading
    out = Path(args.out or DEFAULT_HEAD_OUT).expanduser()
    init = resolve_head(args.head) if args.head else None
    check_target(args)  # a target a head can read, before its weights load
    check_out(out, args.resume)
    check_plot(args.plot)  # no matplotlib, no folder: said before the training, not after
    bar = Bar()
    pair = pair_from_args(args, progress=bar.message, drafter=None, head=None, skip_draft=True)
    report = train_head(pair, prompts, out, settings, init, args.resume, bar.message, bar)
    bar.end()
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report))
        seconds = report["seconds"]
        print(
            f"\nhead: {out} (replies {seconds['replies']:.0f} s, training "
            f"{seconds['training']:.0f} s); use it with --drafter eagle3 --head {out}"
        )
    if args.plot:
        plot_report(report, args.plot)
    return 0


def check_target(args) -> None:
    from ..models.model_dir import json_object
    from ..models.resolve import resolve_model
    from ..train.eagle_build import head_config
    from .args import pair_config_from_args

    config = pair_config_from_args(args, drafter=None, head=None, skip_draft=True)
    path = resolve_model(config.target, config.dtype)
    if (path / "config.json").is_file():
        head_config(json_object(path / "config.json", "config.json"), (0, 0, 0), 2)


def plot_report(report: dict, path: str) -> None:
    from ..train.eagle_head import plot

    plot(report, path)
