"""`mlx-spec chat`: opens the Textual app (the CLI dispatches here by name)."""

from __future__ import annotations

import os
import sys


def setup_arg_parser(parser):
    from mlx_spec.commands.args import add_pair_args, positive_int, seed

    add_pair_args(parser)
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=1024, help="most tokens per reply"
    )
    parser.add_argument("--seed", type=seed, help="random seed, in [0, 2**64)")
    parser.add_argument("--system", help="a system message for every turn (also: /system TEXT)")
    parser.add_argument(
        "--load", metavar="FILE", help="go on with a chat saved with ctrl+s (its .json file)"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="race every reply against plain decoding (f9 does it for the last one)",
    )


def check_models(config) -> None:
    """A pair's local models must exist before the app opens (a hub id may still download
    inside the app, with its progress bar): one line and exit status 2 otherwise."""
    from mlx_spec.errors import SpecError
    from mlx_spec.models.hub import expand_path, looks_like_path, package_file

    for name in (config.target, config.draft, config.head):
        if name is None:
            continue
        if name.startswith("package:"):
            for directory in (False, True):  # a model file, or a head's folder
                try:
                    package_file(name, directory)
                    break
                except SpecError:
                    if directory:
                        raise
        elif looks_like_path(name) and not expand_path(name).exists():
            raise SpecError(f"model path does not exist: {name}")


def main(args):
    from mlx_spec import GenerationConfig
    from mlx_spec.commands.args import DEFAULT_PAIR, pair_config_from_args, pair_from_args
    from mlx_spec.core.sampling import SamplingParams

    from .app import ChatApp
    from .saved import read_saved

    SamplingParams(args.temp)  # bad flags fail here, before the screen opens
    check_models(pair_config_from_args(args))  # and a bad --pair / --target / --draft
    saved = read_saved(args.load) if args.load else None
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # tqdm would tear the screen

    def loader(name, progress):
        if name is None or (name == (args.pair or DEFAULT_PAIR) and not args.target):
            return pair_from_args(args, progress)
        # a picked pair comes with its own draft, drafter and adapter (an adapter fits the
        # draft it was trained for only); the flags' k, dtype and lookup settings stay
        picked = dict(target=None, draft=None, draft_bits=None, drafter=None, head=None)
        picked["skip_draft"] = False
        return pair_from_args(args, progress, name=name, draft_adapter=None, **picked)

    generation = GenerationConfig(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        seed=args.seed,
        num_draft_tokens=args.num_draft_tokens,
        system=args.system,
    )
    app = ChatApp(
        loader=loader,
        pair_name=None if args.target else (args.pair or DEFAULT_PAIR),
        generation=generation,
        compare=args.compare,
        saved=saved,
    )
    app.run()
    # A worker thread may still be inside MLX; leave without C++ static teardown racing it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(app.return_code or 0)
