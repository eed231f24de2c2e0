"""`mlx-spec` command line: a dispatcher over one module per subcommand.

Each subcommand module has `setup_arg_parser(parser)` and `main(args)`. Bad input raises
`SpecError`; here it becomes one line on stderr and exit status 2. Anything else that escapes
is a bug: one line asking for a report, exit status 1 (`--debug` shows the traceback).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import traceback

from .errors import SpecError, one_line

COMMANDS = {
    "generate": "Generate a reply with speculative decoding",
    "chat": "Chat in the terminal app and watch speculation happen",
    "models": "List the curated pairs and which are downloaded",
    "convert": "Convert a GGUF file into an MLX model directory",
    "probe": "Measure whether decoding is memory-bound here and which k pays",
    "bench": "Benchmark against mlx-lm, plain and speculative, in one process",
    "serve": "Serve an OpenAI-compatible API on this machine, speculating",
    "distill": "Teach the draft to agree with its target on your text (a LoRA adapter)",
    "heads": "Extract a model's own drafting head (MTP layer) from its checkpoint",
    "cache": "List, remove or prune the server's prompt cache on disk",
}
# commands that time, draw or listen on one machine; under mlx.launch every rank would run its
# own (the server's requests reach rank 0 only, and every rank must run each generation)
SINGLE_PROCESS = ("chat", "probe", "serve", "distill")


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error on one line (exit status 2), not two."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def version() -> str:
    """The installed distribution's version (package metadata, one source of truth)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("mlx-spec")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> Parser:
    parser = Parser(prog="mlx-spec", description="Lossless speculative decoding on MLX")
    parser.add_argument("--version", action="version", version=f"mlx-spec {version()}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error"
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, help_text in COMMANDS.items():
        # the chat app lives in the `tui` package; the library itself never imports it
        module = importlib.import_module(
            "tui.command" if name == "chat" else f"mlx_spec.commands.{name}"
        )
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.setup_arg_parser(p)
        # also after the subcommand; SUPPRESS keeps a global --debug from being overwritten
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        p.set_defaults(run=module.main)
    return parser


def _refuse_group(command: str) -> None:
    from .models.distributed import world

    if world() is not None:
        raise SpecError(
            f"{command} runs in one process; under mlx.launch use generate or bench "
            "(or the Python API)"
        )


def _not_utf8(args) -> str | None:
    """The first argument that was not valid UTF-8 (Python keeps such bytes as lone
    surrogates, which no tokenizer or file system call can take)."""
    for key, value in vars(args).items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return key
    return None


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):  # stdout closed or replaced: nothing to do
        pass


def _flush_stdout() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"mlx-spec {args.command}"
    try:
        bad = _not_utf8(args)
        if bad is not None:
            raise SpecError(f"the {bad.replace('_', '-')} argument is not valid UTF-8")
        if args.command in SINGLE_PROCESS:
            _refuse_group(args.command)
        status = args.run(args) or 0
        _flush_stdout()  # a full disk or a closed pipe shows here, inside the handlers
        return status
    except SpecError as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `mlx-spec models | head`: the reader left; that is fine
        _silence_stdout()
        return 0
    except UnicodeDecodeError as err:  # stdin or a file the user named held other bytes
        print(f"{prog}: error: the input is not valid UTF-8 ({one_line(err)})", file=sys.stderr)
        return 2
    except OSError as err:
        # `> /dev/full`, a full disk, a closed stdout: the machine's state, not a bug
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EBADF, errno.EIO):
            _silence_stdout()
            where = f": {err.filename}" if err.filename else " (the output)"
            print(f"{prog}: error: cannot write{where}: {err.strerror}", file=sys.stderr)
            return 1
        return _internal_error(prog, err, args)
    except Exception as err:
        return _internal_error(prog, err, args)


def _internal_error(prog: str, err: BaseException, args) -> int:
    debug = getattr(args, "debug", False)
    if debug:
        traceback.print_exception(err)
    hint = "please report it" if debug else "run with --debug for the traceback; please report it"
    print(
        f"{prog}: internal error: {type(err).__name__}: {one_line(err)} ({hint})",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
