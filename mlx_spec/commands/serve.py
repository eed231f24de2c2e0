"""mlx-spec serve: an OpenAI-compatible local server that speculates (see mlx_spec/server/)."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import signal
import socket
import sys
from pathlib import Path

from ..errors import SpecError, one_line
from ..server.connections import (
    HEAD_TIMEOUT,
    SEND_TIMEOUT,
    default_max_connections,
    limit_log_rate,
    open_file_limit,
)
from ..server.prefill import DEFAULT_CHUNK
from .args import add_pair_args, int_at_least, nonnegative_int, pair_from_args, positive_int

API_KEY_ENV = "MLX_SPEC_API_KEY"
DEFAULT_MAX_TOKENS = 512
# requests decoded together (1: serial). benchmarks/serve_batch.py (smollm2-demo, this CPU,
# medians of 2 repetitions): the batch at 8 ran at 1.32x / 2.57x / 3.50x / 5.51x the serial
# server's tokens/s with 1 / 2 / 4 / 8 clients (a run with mlx-lm's servers too: 1.05x / 2.08x /
# 3.91x / 4.83x), first tokens 0.2-5 s against up to 126 s, every reply identical
DEFAULT_MAX_BATCH = 8


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < math.inf:  # (inf kept an idle connection, or a slow head, for ever)
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def size(text: str) -> int:
    """A byte count, with an optional K, M or G suffix (powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int_at_least(text[:-1] if scale > 1 else text, 1) * scale


def port(text: str) -> int:
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, got {value}")
    return value


def setup_arg_parser(parser):
    add_pair_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=port, default=8080, help="port (default 8080; 0: any free one)")
    g.add_argument(
        "--api-key",
        action="append",
        help=f"clients must send 'Authorization: Bearer KEY'; repeat for several clients, each"
        f" with its own history and prompt cache (default: ${API_KEY_ENV})",
    )
    g.add_argument(
        "--admin-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a key (Authorization: Bearer KEY) that sees the whole server's figures at /metrics;"
        " the --api-key keys see only their own requests' (default: none)",
    )
    g.add_argument(
        "--shared-history",
        action="store_true",
        help="all API keys share one history and prompt cache (a single user with several keys)",
    )
    g.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (https://app.example) whose pages may call the API, CORS answered;"
        " '*' for any (default: none: browser requests with an Origin are refused)",
    )
    g.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients use in the Host header (default: the bound address and"
        " localhost)",
    )
    g.add_argument(
        "--allow-swap",
        nargs="*",
        metavar="PAIR",
        help="requests may load another downloaded pair by name (the named ones only, if given);"
        " default: only the served pair",
    )
    g.add_argument(
        "--raw-reasoning",
        action="store_true",
        help="keep a thinking model's <think> text in content instead of reasoning_content",
    )
    g.add_argument(
        "--max-queue-per-key",
        type=nonnegative_int,
        help="requests one API key may have waiting (default: half of --max-queue when there are"
        " several keys)",
    )
    g.add_argument(
        "--max-queue", type=nonnegative_int, default=16, help="requests that may wait (429 past it)"
    )
    g.add_argument(
        "--max-batch",
        type=positive_int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests decoded together in one batch that still drafts (default"
        f" {DEFAULT_MAX_BATCH}; 1: one at a time). Requests a batch cannot take run alone, as a"
        " lone request to a pair with a head or a recurrent target does",
    )
    g.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=DEFAULT_CHUNK,
        help=f"prompt tokens prefilled between two decode rounds of the batch (default"
        f" {DEFAULT_CHUNK}): a long prompt is prefilled a chunk at a time, round robin with"
        " other keys' prompts, so running replies and cached turns are not held for it",
    )
    g.add_argument(
        "--request-timeout", type=seconds, default=600.0, help="seconds, queue wait included"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=10.0,
        help="on SIGTERM, seconds the running request may take to finish before it is cancelled",
    )
    g.add_argument("--max-body", type=size, default=8 << 20, help="request body limit (8M)")
    g.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        help="the most tokens a reply gets: a larger max_tokens is clamped to it, and the reply"
        " ends with finish_reason length (default: no limit but the model's context)",
    )
    g.add_argument(
        "--default-max-tokens",
        type=positive_int,
        help="when a request sets none (default: 512, or --max-tokens-limit if lower)",
    )
    g.add_argument(
        "--cache-dir",
        type=Path,
        help="folder of the prompt cache's disk tier: entries written as they are kept, found"
        " again after an eviction, a restart or a pair swap (default: ~/.cache/mlx-spec/"
        "prompt-cache, or $XDG_CACHE_HOME/mlx-spec/prompt-cache)",
    )
    g.add_argument(
        "--cache-disk-bytes",
        type=size,
        default=20 << 30,
        help="bytes the disk tier may hold; least recently used files go first (20G)",
    )
    g.add_argument("--no-disk-cache", action="store_true", help="keep the prompt cache in RAM only")
    g.add_argument(
        "--keep-attribution-header",
        action="store_true",
        help="keep Claude Code's x-anthropic-billing-header system block in prompts (dropped by"
        " default: it changes every request, so every session would prefill its whole prompt)",
    )
    g.add_argument(
        "--prompt-cache", type=size, default=2 << 30, help="bytes of KV caches kept (2G)"
    )
    g.add_argument(
        "--history-tokens",
        type=positive_int,
        default=100_000,
        help="tokens of earlier requests and replies that prompt lookup also searches",
    )
    g.add_argument(
        "--no-history",
        action="store_true",
        help="prompt lookup searches only the request's own context",
    )
    g.add_argument(
        "--parse-special-in-content",
        action="store_true",
        help="read special-token text in chat messages and tools (<|im_end|>, ...) as the"
        " tokens themselves, as before; by default it is plain text, so a message cannot forge"
        " a turn boundary",
    )
    g.add_argument(
        "--header-timeout",
        type=seconds,
        default=HEAD_TIMEOUT,
        help=f"seconds a connection may take to send a whole request head, and the longest"
        f" pause inside a request body (default {HEAD_TIMEOUT:g}); then it is closed",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=seconds,
        default=5.0,
        help="seconds an idle keep-alive connection stays open between requests (default 5)",
    )
    g.add_argument(
        "--keepalive",
        type=seconds,
        default=2.0,
        help="seconds between keep-alives of a stream that waits (queued, prefilling): its"
        " headers, then an SSE comment this often (default 2)",
    )
    g.add_argument(
        "--send-timeout",
        type=seconds,
        default=SEND_TIMEOUT,
        help=f"seconds a reply may wait for a client that stopped reading; then its request is"
        f" cancelled and the connection closed (default {SEND_TIMEOUT:g})",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        help="connections kept open at most; past it the one waiting longest for a request head"
        " is closed, or the new one gets a 503 (default: three quarters of the open-file limit,"
        f" here {default_max_connections()})",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading the models, so a busy port fails fast and clearly."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        raise SpecError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.listen(128)
    return sock


def served_name(args) -> str:
    from .args import DEFAULT_PAIR

    if args.target:
        return Path(args.target).stem if args.target.endswith(".gguf") else Path(args.target).name
    return args.pair or DEFAULT_PAIR


def per_key_queue(args, keys: list[str]) -> int | None:
    """Requests one key may have waiting: by default half the queue when keys are several
    (and partitioned), so one client cannot fill it."""
    if args.max_queue_per_key is not None:
        return args.max_queue_per_key
    if len(keys) > 1 and not args.shared_history:
        return max(1, args.max_queue // 2)
    return None


def connection_cap(asked: int | None) -> int:
    """--max-connections, or the default below the open-file limit; a cap at or above the
    limit would not keep descriptors for /health and the model's own files."""
    if asked is None:
        return default_max_connections()
    limit = open_file_limit()
    if asked >= limit - 16:
        raise SpecError(
            f"--max-connections {asked} leaves no file descriptors: the open-file limit is"
            f" {limit} (ulimit -n); use at most {limit - 17}, or raise the limit"
        )
    return asked


def main(args):
    try:
        import uvicorn

        from ..server.app import GracefulServer, Settings, create_app
        from ..server.bounded import bounded_protocol
        from ..server.protocol import Limits
        from ..server.worker import Engine
    except ImportError as err:
        raise SpecError(
            f"mlx-spec serve needs {err.name}, a dependency of mlx-spec that is missing here: "
            "reinstall mlx-spec"
        ) from None
    from ..pairs.loading import load_pair
    from ..pairs.registry import load_registry, pair_downloaded

    max_connections = connection_cap(args.max_connections)
    limit = args.max_tokens_limit
    default_max = args.default_max_tokens
    if default_max is None:
        default_max = min(DEFAULT_MAX_TOKENS, limit or DEFAULT_MAX_TOKENS)
    if limit is not None and default_max > limit:
        raise SpecError("--default-max-tokens must not exceed --max-tokens-limit")
    if args.api_key and not all(k.strip() for k in args.api_key):
        # (an unset variable, `--api-key "$KEY"`: the server started with no key at all)
        raise SpecError("--api-key must not be empty")
    keys = [k for k in (args.api_key or [os.environ.get(API_KEY_ENV) or ""]) if k]
    if not keys and not is_loopback(args.host):
        print(
            f"mlx-spec serve: warning: listening on {args.host} without --api-key: anyone who "
            "can reach this port can use the model",
            file=sys.stderr,
        )
    sock = bind(args.host, args.port)
    name = served_name(args)
    # on demand: only pairs already on this machine (a request never starts a download)
    registry = load_registry()
    local = {n for n, spec in registry.pairs.items() if pair_downloaded(spec)}

    def loader(model: str):
        if model == name:
            return pair_from_args(args)
        if not pair_downloaded(registry.pairs[model]):  # still there (files may go)
            raise SpecError("it is not downloaded on this machine")
        return load_pair(model)

    if args.allow_swap is None:  # only the served pair: no client makes the server swap
        local = set()
    elif args.allow_swap:
        unknown = sorted(set(args.allow_swap) - set(registry.pairs))
        if unknown:
            raise SpecError(f"--allow-swap names unknown pairs: {', '.join(unknown)}")
        local &= set(args.allow_swap)
    models = sorted({name, *local})
    disk = None
    if not args.no_disk_cache:
        from ..server.disk_cache import DiskStore, default_dir

        disk = DiskStore(args.cache_dir or default_dir(), args.cache_disk_bytes)
    engine = Engine(
        None,  # loaded by start(), on the engine thread: the one that generates (threads.py)
        name,
        loader,
        models,
        max_queue=args.max_queue,
        prompt_cache_bytes=args.prompt_cache,
        history_tokens=0 if args.no_history else args.history_tokens,
        max_queue_per_key=per_key_queue(args, keys),
        raw_reasoning=args.raw_reasoning,
        max_batch=args.max_batch,
        disk=disk,
        prefill_chunk=args.prefill_chunk,
    )
    settings = Settings(
        api_keys=keys,
        shared_history=args.shared_history,
        max_body_bytes=args.max_body,
        request_timeout=args.request_timeout,
        limits=Limits(limit, default_max, args.keep_attribution_header),
        host=args.host,
        allowed_hosts=args.allow_host,
        allowed_origins=args.allow_origin,
        send_timeout=args.send_timeout,
        keepalive=args.keepalive,
        parse_special=args.parse_special_in_content,
        admin_keys=args.admin_key,
        body_timeout=args.header_timeout,
    )
    config = uvicorn.Config(
        create_app(engine, settings),
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + 2,
        # connections bounded (server/bounded.py): a head timeout and a cap below the
        # open-file limit; uvicorn's own limit answers requests past the cap 503 too
        http=bounded_protocol(args.header_timeout, max_connections),
        timeout_keep_alive=args.keep_alive_timeout,
        limit_concurrency=max_connections + 1,
    )
    limit_log_rate()  # (after uvicorn.Config: it sets up the log handlers)
    server = GracefulServer(config, engine, args.shutdown_timeout)
    engine.on_death = lambda: setattr(server, "should_exit", True)  # uvicorn polls it
    try:
        engine.start()
    except (SpecError, KeyboardInterrupt) as err:
        # the engine thread has run MLX: leave through os._exit, as a finished server does
        # below (a normal interpreter exit may abort: "terminate called without an active
        # exception", status 134)
        if isinstance(err, SpecError):
            print(f"mlx-spec serve: error: {one_line(err)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2 if isinstance(err, SpecError) else 130)
    host, bound = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{bound}/v1"
    resident = engine.resident
    history = "on" if resident.history is not None else "off"
    batch = f"batch {args.max_batch}" if resident.batch is not None else "not batched"
    if resident.batch_plain:
        batch += ", plain: a request alone drafts"
    print(
        f"mlx-spec serve: {name} (drafter {resident.drafter}, history lookup {history}, {batch})"
        f" on {url}"
    )
    if resident.batch is None and args.max_batch > 1:
        print(f"mlx-spec serve: not batched: {one_line(resident.batch_refusal)}", file=sys.stderr)
    elif resident.batch_plain:  # why concurrent requests decode without drafts
        print(
            f"mlx-spec serve: requests that queue together batch without drafts: "
            f"{one_line(resident.batch_refusal)}",
            file=sys.stderr,
        )
    sys.stdout.flush()
    # uvicorn re-raises the signal that stopped it once it is done; after a graceful
    # shutdown that must not kill the process before the engine thread is joined
    signal.signal(signal.SIGTERM, lambda *_: None)
    status = 0
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        status = 130
    engine.stop(timeout=args.shutdown_timeout + 5)
    if disk is not None:  # the entries kept last go to disk before the exit
        try:
            disk.flush()
        except Exception as err:  # noqa: BLE001 - the exit must not wait on a broken disk
            print(f"mlx-spec serve: prompt cache writes not finished: {err}", file=sys.stderr)
    if engine.failure is not None:  # non-zero, so that a supervisor restarts the server
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # MLX's threads may abort the interpreter's normal exit after work in another thread
    # ("terminate called without an active exception"); everything is flushed and joined
    os._exit(status)
