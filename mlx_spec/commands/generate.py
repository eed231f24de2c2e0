"""mlx-spec generate: one reply, streamed, with accepted draft tokens coloured."""

from __future__ import annotations

import json
import os
import sys

from ..core.provenance import EMITTED, paint
from ..errors import SpecError
from .args import add_pair_args, pair_from_args, seed


def setup_arg_parser(parser):
    add_pair_args(parser)
    g = parser.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p filter, in [0, 1]")
    g.add_argument("--seed", type=seed, help="random seed for a reproducible run, in [0, 2**64)")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--system", help="system message for the chat template")
    parser.add_argument(
        "--raw", action="store_true", help="use the prompt as raw text, no chat template"
    )
    g = parser.add_argument_group("structured output (the reply is constrained exactly)")
    g.add_argument("--json-schema", metavar="FILE", help="a JSON Schema file: reply valid JSON")
    g.add_argument("--grammar", metavar="FILE", help="a Lark grammar file (llguidance's dialect)")
    g.add_argument("--regex", metavar="RE", help="the reply matches this regular expression")
    g.add_argument(
        "--no-forced-tokens",
        action="store_true",
        help="do not draft the tokens the grammar forces (they are drafted for free by default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--no-color", action="store_true", help="no colours (also: NO_COLOR)")
    parser.add_argument("prompt", help="the prompt, or - to read it from stdin")


def read_prompt(args) -> str:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:  # undecodable stdin bytes arrive as lone surrogates (surrogateescape), or raise
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError("the prompt is not valid UTF-8") from None
    if not prompt.strip():
        raise SpecError("the prompt is empty")
    return prompt


def build_prompt(pair, args, text: str):
    if args.raw or not pair.tokenizer.has_chat_template:
        if args.system:
            raise SpecError("--system needs a chat template (drop --raw)")
        return text
    return [{"role": "user", "content": text}]


def hint(stats) -> str | None:
    """The verdict on this run by what it measured (its policy's `payoff`: the rounds' wall
    time against a plain step, the draft's acceptance), in the words `probe` and the chat use;
    None when nothing was measured (no draft, or too short a reply)."""
    payoff = stats.payoff
    if payoff is None:
        return None
    line = f"{payoff.sentence()} ({payoff.figures()}, measured by this run)"
    if payoff.pays:
        return line
    if stats.adaptive:  # auto drafts only where it predicts a gain
        return f"hint: {line}; auto decodes plainly where drafting does not pay"
    if payoff.k > 1:
        return f"hint: {line}; compare with --num-draft-tokens auto and --no-draft"
    return f"hint: {line}; compare with --no-draft"


def read_constraint(args) -> dict:
    """--json-schema / --grammar / --regex -> keyword arguments for the engine; files are read
    (and a schema parsed) before any model loads, so bad input fails fast."""
    given = [f for f in ("json_schema", "grammar", "regex") if getattr(args, f) is not None]
    if len(given) > 1:
        raise SpecError("give one of --json-schema, --grammar or --regex")
    if not given:
        return {}
    if args.regex is not None:
        if not args.regex:
            raise SpecError("--regex is empty")
        return {"regex": args.regex}
    path = args.json_schema if args.json_schema is not None else args.grammar
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError(f"no such file: {path}") from None
    except IsADirectoryError:
        raise SpecError(f"{path} is a directory, not a file") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path} is not valid UTF-8") from None
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}") from None
    if args.grammar is not None:
        if not text.strip():
            raise SpecError(f"the grammar file {path} is empty")
        return {"grammar": text}
    from ..core.grammar import read_schema

    return {"schema": read_schema(text, f"the schema file {path}")}


def main(args):
    from ..models.distributed import rank_zero_prints

    text = read_prompt(args)
    constraint = read_constraint(args)
    config = generation_config(args)  # bad sampling flags fail before anything loads
    pair = pair_from_args(args)
    if constraint:  # compiled once, against the loaded tokenizer: errors before generating
        from ..decode.prompts import constraint_for

        forced = not (args.no_forced_tokens or args.no_draft)  # the baseline drafts nothing
        config = config.replace(grammar=constraint_for(pair, **constraint), forced_tokens=forced)
    with rank_zero_prints(pair):  # a target sharded over mlx.launch's ranks: rank 0 prints
        return reply(pair, args, text, config)


def generation_config(args):
    from ..decode.config import GenerationConfig

    return GenerationConfig(
        args.max_tokens, args.temp, args.top_p, args.top_k, args.min_p, args.seed,
        system=args.system,
    )  # fmt: skip


def reply(pair, args, text: str, config) -> int:
    from ..core.stats import Stats
    from ..decode.generate import generate, stream
    from ..runtime import blas

    prompt = build_prompt(pair, args, text)
    if args.json:
        out = generate(pair, prompt, config).to_json()
        out["stats"]["blas_notice"] = blas.notice()  # None unless on the slow reference BLAS
        print(json.dumps(out))
        return 0

    color = sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ
    stats = Stats()
    if color and pair.speculative:  # the legend: the kinds' names in their colours
        print(" · ".join(paint(kind, kind) for kind in EMITTED), file=sys.stderr)
    for ev in stream(pair, prompt, config, stats=stats):
        if color:
            sys.stdout.write(paint(ev.text, ev.kind))
        else:
            sys.stdout.write(ev.text)
        sys.stdout.flush()
    print()
    print(stats.summary(), file=sys.stderr)
    for line in (hint(stats), blas.notice()):
        if line:
            print(line, file=sys.stderr)
    return 0
