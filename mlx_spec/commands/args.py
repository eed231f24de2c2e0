"""The flags several commands share: the pair (--pair / --target / --draft / --drafter …) and
the number types argparse checks. Loading is imported inside the functions that load: every
command's parser is built for each invocation (`mlx-spec --help` too, which loads neither MLX
nor mlx-lm), and only the command that runs needs it.
"""

from __future__ import annotations

import argparse

from ..core.policies import Auto, Fixed
from ..errors import SpecError

# The package's drafter kinds and their help, for --drafter's help without importing the
# kinds' modules (they load MLX and mlx-lm: `mlx-spec --help` took ~1.3 s); tests/test_cli.py
# checks it equals the registry. The kind named is checked where the pair's config is built
# (drafters.kind), which also knows kinds registered at run time.
DRAFTER_KINDS = {
    "model": "the draft model",
    "ngram": "prompt lookup in the context, no second model",
    "ngram+model": "lookup first, the draft model when lookup finds nothing",
    "eagle3": "an EAGLE-3 head (--head DIR): drafts from three of the target's layers",
    "mtp": "the target's own multi-token-prediction layer (--head DIR from mlx-spec heads "
    "extract, or the original checkpoint: extracted once into the cache)",
    "dflash": "a DFlash or DFlash2 block-diffusion head (z-lab): one forward drafts a block",
    "dspark": "a DSpark head: a DFlash block drafter with a Markov head over the previous guess",
    "assistant": "a Gemma 4 assistant (MTP) drafter (--head DIR or hub id, model_type "
    "gemma4_assistant): attends to the target's own keys and values",
    "suffix": "suffix decoding: the longest match in the request and the key's history, drafts "
    "as long as the verify cost says (past K_MAX)",
}
DRAFTER_KINDS.update(
    {
        f"suffix+{base}": f"suffix decoding where the match is long, else {base}"
        for base in ("model", "eagle3", "mtp", "dflash", "dspark", "assistant")
    }
)

DEFAULT_PAIR = "smollm2-demo"


def int_at_least(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    return int_at_least(text, 0)


def seed(text: str) -> int:
    """--seed: an integer in [0, 2**64), the range MLX's random keys accept."""
    from ..core.sampling import check_seed  # (loads mlx-lm: only when a seed is given)

    try:
        return check_seed(int_at_least(text, 0))
    except SpecError:
        raise argparse.ArgumentTypeError(f"must be below 2**64, got {text}") from None


def draft_length(text: str):
    """--num-draft-tokens: an integer >= 1 (fixed), or "auto" (the controller picks k)."""
    return Auto() if text == "auto" else Fixed(positive_int(text))


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def add_pair_args(parser: argparse.ArgumentParser, adapter: bool = True) -> None:
    """The flags that name a pair; `adapter=False` leaves out --draft-adapter (distill trains
    one from the bare draft)."""
    g = parser.add_argument_group("model pair")
    g.add_argument("--pair", help=f"a pair from models.toml (default: {DEFAULT_PAIR})")
    g.add_argument("--target", help="target model: local path, .gguf file or Hugging Face id")
    g.add_argument("--draft", help="draft model: local path, .gguf file or Hugging Face id")
    g.add_argument(
        "--draft-bits", type=positive_int, help="draft = the target re-quantized to N bits"
    )
    if adapter:
        g.add_argument(
            "--draft-adapter",
            metavar="DIR",
            help="a LoRA adapter for the draft, as `mlx-spec distill` writes (default: the "
            "pair's draft_adapter in models.toml)",
        )
    g.add_argument("--no-draft", action="store_true", help="plain decoding (the baseline)")
    g.add_argument(
        "--drafter",
        metavar="KIND",
        help="; ".join(f"{name}: {text}" for name, text in DRAFTER_KINDS.items()),
    )
    g.add_argument(
        "--head",
        metavar="DIR",
        help="a drafting head's directory, for the kinds that read one (see --drafter)",
    )
    g.add_argument("--ngram-max", type=positive_int, help="longest n-gram to look up (3)")
    g.add_argument("--ngram-min", type=positive_int, help="shortest n-gram to look up (1)")
    g.add_argument(
        "--dtype",
        choices=["auto", "float16", "bfloat16", "float32"],
        help="dequantize .gguf models to this type (auto: float16 on Metal, float32 on CPU)",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=draft_length,
        help="draft tokens per round, k, or 'auto': chosen every round from measured costs and "
        "acceptance, 0 (plain decoding) when drafting does not pay (default: the pair's, "
        "auto unless models.toml fixes k)",
    )
    g.add_argument(
        "--draft-confidence",
        type=probability,
        metavar="P",
        help="a draft model stops drafting after a token whose top probability is below P "
        "(default: off)",
    )
    g.add_argument(
        "--force",
        action="store_true",
        help="load even when the models and KV cache look too big for this machine's memory",
    )


def pair_config_from_args(args, **changes):
    """The PairConfig the flags name (the demo pair when they name none); `changes` override
    flags (the chat app's pair picker names another pair)."""
    if args.pair and args.target:
        raise SpecError("give --pair or --target, not both")
    if args.draft and not (args.target or args.pair):
        raise SpecError("--draft needs --target")
    if args.no_draft and (args.draft or args.draft_bits or args.drafter or args.head):
        raise SpecError(
            "--no-draft cannot be combined with --draft, --draft-bits, --drafter or --head"
        )
    settings = {
        "num_draft_tokens": args.num_draft_tokens,
        "draft_bits": args.draft_bits,
        "dtype": args.dtype,
        "skip_draft": args.no_draft,
        "drafter": args.drafter,
        "draft_adapter": getattr(args, "draft_adapter", None),
        "ngram_max": args.ngram_max,
        "ngram_min": args.ngram_min,
        "draft_confidence": args.draft_confidence,
        "head": args.head,
    }
    if args.target:
        settings.update(target=args.target, draft=args.draft)
    else:
        settings["name"] = args.pair or DEFAULT_PAIR
    settings.update(changes)
    from ..pairs.loading import pair_config  # (lazy: start-up time, see above)

    return pair_config(**settings)


def pair_from_args(args, progress=None, **changes):
    """Load the pair the flags name (see pair_config_from_args)."""
    from ..pairs.loading import load_pair  # (lazy: start-up time, see above)

    return load_pair(
        pair_config_from_args(args, **changes),
        progress=progress,
        force=getattr(args, "force", False),
        # probe fills a KV cache of --context tokens: the memory check must count it
        context=getattr(args, "context", None),
    )
