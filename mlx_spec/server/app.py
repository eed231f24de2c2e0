"""The HTTP side: a Starlette app with OpenAI's endpoints, Anthropic's Messages (anthropic.py),
OpenAI's Responses (responses.py), /health and /metrics.

Requests are checked (Host, Origin, key, content type, queue room) before their body is read,
validated (protocol.py), queued on the engine (worker.py) and answered from the job's items:
streamed as server-sent events (headers and keep-alive comments while queued or prefilling) or
collected into one JSON body. A client that disconnects leaves the queue at once, or cancels
its job mid-prefill or mid-stream.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import anthropic
from .connections import HEAD_TIMEOUT, SEND_TIMEOUT
from .jobs import Job
from .keymetrics import BATCH_BUCKETS, Exposition, KeyMetrics, key_metrics_text
from .openapi import document as openapi_document
from .prompts import make_pool, prepare
from .protocol import ApiError, GenRequest, Limits, parse_chat, parse_completion
from .responses import ResponsesEncoder, ResponseStore, not_found, parse_responses
from .streaming import Encoder, JobResponse, error_response
from .worker import Engine

DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this, then cut off
KEEPALIVE_SECONDS = 2.0  # a queued or prefilling stream gets its headers, then a comment this often
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
log = logging.getLogger("mlx_spec.server")


@dataclass
class Settings:
    api_key: str | None = None  # one key (kept for callers that set one)
    api_keys: list[str] = field(default_factory=list)  # any of these; each its own partition
    shared_history: bool = False  # every key in one partition (a single user)
    max_body_bytes: int = 8 << 20
    request_timeout: float = 600.0
    limits: Limits = field(default_factory=Limits)
    host: str = "127.0.0.1"  # the bound address: Host headers must name it (or localhost)
    allowed_hosts: list[str] = field(default_factory=list)  # more names for the Host header
    allowed_origins: list[str] = field(default_factory=list)  # browser origins ("*": any)
    keepalive: float = KEEPALIVE_SECONDS
    parse_special: bool = False  # chat text may hold special tokens (--parse-special-in-content)
    admin_keys: list[str] = field(default_factory=list)  # see every key's figures at /metrics
    send_timeout: float | None = SEND_TIMEOUT  # a client that reads nothing this long is cut off
    body_timeout: float | None = HEAD_TIMEOUT  # seconds between chunks of a request body

    def keys(self) -> list[str]:
        return [
            k for k in dict.fromkeys([*([self.api_key] if self.api_key else []), *self.api_keys])
        ]


def authorize(request: Request, settings: Settings, x_api_key: bool = False) -> str:
    """The request's partition: "" without keys (or with --shared-history), else an id of
    the key it presented (a digest: the key itself is kept nowhere else). `x_api_key`:
    Anthropic's header may carry the key instead of Authorization: Bearer."""
    keys = settings.keys()
    if not keys:
        return ""
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if x_api_key and "x-api-key" in request.headers:
        scheme, token = "bearer", request.headers["x-api-key"]
    token = token.strip().encode()
    match = None
    for key in keys:  # compare with every key: the time does not tell which one matched
        if hmac.compare_digest(token, key.encode()) and scheme.lower() == "bearer":
            match = key
    if match is None:
        raise ApiError(401, "Incorrect or missing API key", code="invalid_api_key")
    if settings.shared_history:
        return ""
    return hashlib.sha256(match.encode()).hexdigest()[:16]


def errors_for(path: str):
    """The error body's shape: Anthropic's on its endpoints, OpenAI's elsewhere."""
    return anthropic.error_response if path.startswith("/v1/messages") else error_response


def host_name(value: str) -> str:
    """The host part of a Host header or an origin's authority, lower case, no brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_allowed(host: str, settings: Settings) -> bool:
    name = host_name(host)
    bound = settings.host.lower()
    if name in LOCAL_NAMES or name == bound or name in (h.lower() for h in settings.allowed_hosts):
        return True
    try:  # any loopback address (127.0.0.0/8)
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    # bound to every interface: clients name this machine however they reach it
    return bound in ("0.0.0.0", "::", "")


def origin_allowed(origin: str, settings: Settings) -> bool:
    allowed = settings.allowed_origins
    return "*" in allowed or origin.rstrip("/").lower() in (o.rstrip("/").lower() for o in allowed)


class Guard:
    """ASGI middleware: refuses a Host that is not this server's (DNS rebinding) and an Origin
    that --allow-origin does not name (any web page could otherwise drive the model), answers
    CORS preflights for the allowed origins and adds CORS headers to their responses."""

    def __init__(self, app, settings: Settings):
        self.app, self.settings = app, settings

    async def refuse(self, scope, send, status: int, message: str, code: str) -> None:
        respond = errors_for(scope.get("path", ""))
        await respond(ApiError(status, message, code=code))(scope, None, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not host_allowed(host, self.settings):
            message = f"the Host {host!r} is not this server's (--allow-host names more)"
            return await self.refuse(scope, send, 403, message, "forbidden_host")
        origin = headers.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        if not origin_allowed(origin, self.settings):
            message = f"requests from the web origin {origin!r} are refused (--allow-origin)"
            return await self.refuse(scope, send, 403, message, "forbidden_origin")
        cors = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"vary", b"Origin"),
            (b"access-control-expose-headers", b"X-Ignored-Fields, Retry-After"),
        ]
        if scope["method"] == "OPTIONS":
            asked = headers.get("access-control-request-headers", "")
            allow = asked or "Authorization, Content-Type"
            await send(
                {
                    "type": "http.response.start",
                    "status": 204,
                    "headers": cors
                    + [
                        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                        (b"access-control-allow-headers", allow.encode("latin-1")),
                        (b"access-control-max-age", b"600"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def check_json_type(request: Request) -> None:
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise ApiError(
            415,
            f"the body must be JSON sent as Content-Type: application/json, got {kind or 'none'!r}",
            code="unsupported_media_type",
        )


async def body_chunks(request: Request, timeout: float | None):
    """The body's chunks; a 408 when the client pauses longer than `timeout` between two (a
    request that announced a body and sent none once held its connection for ever)."""
    chunks = request.stream().__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(chunks.__anext__(), timeout)
        except StopAsyncIteration:
            return
        except TimeoutError:
            message = f"the request body stalled for {timeout:g} s (--header-timeout)"
            raise ApiError(408, message, code="request_timeout") from None


async def read_json(request: Request, limit: int, timeout: float | None = None) -> dict:
    """The body as a JSON object; 413 past `limit` bytes. An oversized body is still read
    (and dropped) so the client gets the 413, not a reset connection."""
    body, size = bytearray(), 0
    async for chunk in body_chunks(request, timeout):
        size += len(chunk)
        if size <= limit:
            body += chunk
        elif size > DRAIN_LIMIT:
            break
    if size > limit:
        raise ApiError(
            413, f"the request body is {size} bytes; the limit is {limit}", code="request_too_large"
        )
    try:
        data = json.loads(body, parse_constant=not_finite, parse_float=finite_float)
    except NotFinite as err:
        raise ApiError(400, str(err), code="invalid_value") from None
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if depth(data) > MAX_DEPTH:  # templates and schema compilers recurse over it
        raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    try:  # a lone surrogate ("\ud800") parses but is no text: the tokenizer raises on it
        if SURROGATE_ESCAPE.search(body):  # (raw UTF-8 cannot hold one: only escapes can)
            json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        message = "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode"
        raise ApiError(400, message, code="invalid_value") from None
    return data


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
MAX_DEPTH = 64  # JSON nesting a request may have (600 levels of tools once made a 500)


def depth(value) -> int:
    """How deep objects and lists nest in `value` (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level)
            todo += [(v, level + 1) for v in item if isinstance(v, dict | list)]
    return deepest


class NotFinite(ValueError):
    pass


def not_finite(name: str):
    """JSON's NaN / Infinity (Python's parser accepts them): every bound compares false with
    NaN, so a NaN temperature once passed validation and killed the engine thread."""
    raise NotFinite(f"numbers must be finite, got {name}")


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise NotFinite(f"numbers must be finite, got {text[:32]}")
    return value


def metrics_text(engine: Engine) -> str:
    m, out = engine.metrics, Exposition()
    out.requests(m.requests, "Requests answered, by endpoint and status.")
    counters = [
        ("prompt_tokens_total", "Prompt tokens.", m.prompt_tokens),
        ("prompt_tokens_cached_total", "Prompt tokens reused from a kept KV cache.",
         m.prompt_tokens_cached),
        ("generated_tokens_total", "Generated tokens.", m.generated_tokens),
        ("drafted_tokens_total", "Draft tokens proposed.", m.drafted),
        ("accepted_tokens_total", "Draft tokens the target accepted.", m.accepted),
        ("target_passes_total", "Target forward passes while generating (a batched pass once).",
         m.target_passes),
        ("batch_passes_total", "Batched target passes (--max-batch).", m.batch_passes),
        ("generation_seconds_total", "Seconds spent generating, summed over requests.",
         round(m.generation_seconds, 4)),
        ("prefill_seconds_total", "Seconds spent prefilling prompts.", round(m.prefill_seconds, 4)),
        ("cancelled_total", "Jobs stopped because their client disconnected.", m.cancelled),
        ("timeouts_total", "Jobs stopped by the request timeout.", m.timeouts),
        ("batch_rows_alone_total",
         "Batch rows that went on as a single stream once the others had left.", m.rows_alone),
        ("batch_rows_rejoined_total",
         "Of those, rows that joined a batch again when a request came.", m.rows_rejoined),
        ("batch_streams_moved_total",
         "Lone streams that went on as batch rows when a request came.", m.streams_moved),
    ]  # fmt: skip
    disk = engine.resident.disk
    if disk is not None:  # the prompt cache's disk tier (disk_cache.py)
        d = disk.metrics
        counters += [
            ("disk_cache_hits_total", "Prompt cache entries loaded from disk.", d.hits),
            ("disk_cache_misses_total",
             "Requests whose prompt no RAM or disk entry shared more of.", d.misses),
            ("disk_cache_read_bytes_total", "Bytes of cache files loaded.", d.bytes_read),
            ("disk_cache_written_bytes_total", "Bytes of cache files written.", d.bytes_written),
            ("disk_cache_load_seconds_total", "Seconds spent loading cache files.",
             round(d.load_seconds, 4)),
            ("disk_cache_save_seconds_total", "Seconds spent writing cache files.",
             round(d.save_seconds, 4)),
            ("disk_cache_evictions_total", "Cache files removed by --cache-disk-bytes.",
             d.evictions),
            ("disk_cache_errors_total",
             "Cache files that did not read back (removed) or could not be written.", d.errors),
        ]  # fmt: skip
    out.each("counter", counters)
    rate = m.accepted / m.drafted if m.drafted else 0.0
    gauges = [
        ("acceptance_rate", "Accepted / drafted draft tokens since start.", round(rate, 4)),
        ("queue_waiting", "Requests waiting for the engine.", engine.scheduler.waiting),
        ("busy", "1 while a request is being generated.", int(engine.scheduler.busy)),
        ("prompt_cache_entries", "Token sequences whose caches are kept (prompt_cache.py).",
         sum(c.trie.size for c in engine.resident.all_caches())),
        ("prompt_cache_bytes", "Bytes of the kept KV caches.",
         sum(c.bytes for c in engine.resident.all_caches())),
        ("history_tokens", "Tokens in the history lookup indexes (all partitions).",
         engine.resident.history_size()),
        ("running", "Requests being generated (several when batched).",
         len(engine.scheduler.running)),
        ("max_batch", "Requests one batch may hold (1: not batched, or the pair cannot be).",
         engine.resident.max_batch if engine.resident.batch is not None else 1),
        ("batch_size", "Requests in the last batched pass (0: no batch running).", m.batch_size),
        ("batch_size_max", "Most requests in one batched pass since start.", m.batch_size_max),
        ("batch_rows_per_pass", "Mean requests per batched pass since start.",
         round(m.batch_rows / m.batch_passes, 4) if m.batch_passes else 0.0),
        ("batch_target_rows_per_pass",
         "Mean target rows per batched pass since start: requests x (drafted + 1).",
         round(m.batch_target_rows / m.batch_passes, 4) if m.batch_passes else 0.0),
    ]  # fmt: skip
    out.each("gauge", gauges)
    buckets, total = [], 0
    for bound, n in zip(BATCH_BUCKETS, m.batch_hist, strict=True):
        total += n
        buckets.append((f'_bucket{{le="{bound}"}}', total))
    buckets += [('_bucket{le="+Inf"}', m.batch_passes), ("_sum", m.batch_rows)]
    buckets.append(("_count", m.batch_passes))
    out.metric("batch_size_passes", "histogram", "Batched passes by their requests.", buckets)
    return out.text()


def create_app(engine: Engine, settings: Settings) -> Starlette:
    keyed = KeyMetrics(settings.admin_keys)  # each key's own figures (/metrics)

    def count(endpoint: str, status: int, partition: str | None = None) -> None:
        engine.metrics.count(endpoint, status)
        if partition is not None:
            keyed.of(partition).count(endpoint, status)

    logged: set[str] = set()  # ignored field names already logged
    prompt_pool = make_pool()  # templates and tokenisers run here, beside the engine thread

    preparing: dict[str, asyncio.Semaphore] = {}  # per partition (the keys are configured)

    stored = ResponseStore()  # /v1/responses kept for previous_response_id, by partition

    async def generation(
        request: Request, endpoint: str, parse, errors=error_response
    ) -> Response | JobResponse:
        """A generation request of any protocol: `parse(data, partition)` gives the internal
        request and a function making the protocol's encoder for its job (None: OpenAI's)."""
        partition = None
        try:
            partition = authorize(request, settings, x_api_key=errors is not error_response)
            check_json_type(request)
            engine.check_capacity(partition)  # before the body is read
            data = await read_json(request, settings.max_body_bytes, settings.body_timeout)
            req, make_encoder = parse(data, partition)
            req.partition = partition
            req.parse_special = settings.parse_special
            deadline = time.monotonic() + settings.request_timeout  # tokenising counts too
            # tokenised here, not on the engine thread; one request of a key at a time, so one
            # key's huge prompts hold at most one of the pool's threads
            async with preparing.setdefault(partition, asyncio.Semaphore(1)):
                engine.check_capacity(partition)  # (the queue may have filled meanwhile)
                await prepare(engine, req, prompt_pool)
            job = Job(req, asyncio.get_running_loop(), deadline)
            engine.submit(job)
        except ApiError as err:
            count(endpoint, err.status, partition)
            return errors(err)
        headers = {}
        if req.ignored:
            # printable ASCII only: a client's field name with CR/LF would make h11 refuse the
            # header after the whole generation (a 500)
            names = [re.sub(r"[^\x21-\x7e]", "?", n[:64]) for n in req.ignored[:32]]
            headers["X-Ignored-Fields"] = ", ".join(names)
            new = [n for n in names if n not in logged]
            if new and len(logged) < 1024:
                logged.update(new)
                log.warning("ignoring request fields this server does not know: %s", ", ".join(new))
        response = JobResponse(
            job,
            lambda status: count(endpoint, status, partition),
            engine,
            settings.keepalive,
            headers,
            settings.send_timeout,
            make_encoder(req, job.id) if make_encoder is not None else None,
        )
        response.figures = keyed.of(partition)
        return response

    async def chat(request: Request) -> Response | JobResponse:
        return await generation(
            request, "chat", lambda data, _: (parse_chat(data, settings.limits), None)
        )

    async def completions(request: Request) -> Response | JobResponse:
        return await generation(
            request, "completions", lambda data, _: (parse_completion(data, settings.limits), None)
        )

    async def messages(request: Request) -> Response | JobResponse:
        def parse(data: dict, _) -> tuple[GenRequest, type[Encoder]]:
            return anthropic.parse_messages(data, settings.limits), anthropic.MessagesEncoder

        return await generation(request, "messages", parse, anthropic.error_response)

    async def count_tokens(request: Request) -> Response:
        """Anthropic's count_tokens: the prompt's tokens as the resident pair renders it."""
        partition = None
        try:
            partition = authorize(request, settings, x_api_key=True)
            check_json_type(request)
            data = await read_json(request, settings.max_body_bytes, settings.body_timeout)
            req = anthropic.parse_messages(data, settings.limits, counting=True)
            if req.model != engine.resident.name:
                names = [engine.resident.name, *engine.resident.models]
                if req.model not in names:
                    message = f"The model {req.model!r} does not exist; see /v1/models"
                    raise ApiError(404, message, "model", "model_not_found")
                message = f"tokens are counted for the resident pair ({engine.resident.name}) only"
                raise ApiError(400, message, "model")
            req.parse_special = settings.parse_special
            if engine.resident.pair is None:  # loading or swapping: nothing to count with
                raise ApiError(503, "the pair is loading; retry", code="loading")
            # as a generation's: one request of a key at a time in the pool, within the timeout
            async with preparing.setdefault(partition, asyncio.Semaphore(1)):
                await asyncio.wait_for(prepare(engine, req, prompt_pool), settings.request_timeout)
        except TimeoutError:
            count("count_tokens", 504, partition)
            return anthropic.error_response(ApiError(504, "counting timed out"))
        except ApiError as err:
            count("count_tokens", err.status, partition)
            return anthropic.error_response(err)
        count("count_tokens", 200, partition)
        return JSONResponse({"input_tokens": len(req.prompt_ids or ())})

    async def responses(request: Request) -> Response | JobResponse:
        def parse(data: dict, partition: str):
            req, conversation = parse_responses(data, settings.limits, stored, partition)

            def encoder(req: GenRequest, job_id: str) -> ResponsesEncoder:
                return ResponsesEncoder(req, job_id, data, conversation, stored, partition)

            return req, encoder

        return await generation(request, "responses", parse)

    async def get_response(request: Request) -> Response:
        """A stored response, for its own API key only."""
        partition = authorize(request, settings)
        entry = stored.get(partition, request.path_params["rid"])
        if entry is None:
            raise not_found(request.path_params["rid"], "response_id")
        return JSONResponse(entry["response"])

    async def models(request: Request) -> Response:
        authorize(request, settings)
        # the served pair, and the pairs requests may swap in (--allow-swap)
        created = int(time.time())
        names = [engine.resident.name] if engine.resident.name else []
        names += [n for n in engine.resident.models if n != engine.resident.name]
        data = [model_entry(n, created, window(n)) for n in names]
        # one body both SDKs read: OpenAI's list and Anthropic's page
        first, last = (names[0], names[-1]) if names else (None, None)
        page = {"has_more": False, "first_id": first, "last_id": last}
        return JSONResponse({"object": "list", "data": data, **page})

    def window(name: str) -> tuple[int | None, int | None]:
        """(context, output cap) of a pair: known for the loaded one (others once loaded)."""
        pair = engine.resident.pair
        context = getattr(pair, "context_length", None) if name == engine.resident.name else None
        cap = settings.limits.max_tokens
        return context, min(filter(None, (cap, context)), default=None)

    async def health(request: Request) -> Response:
        if not engine.alive:  # a supervisor restarts the server on this (it exits too)
            reason = f"{type(engine.failure).__name__}: {engine.failure}" if engine.failure else ""
            return JSONResponse({"status": "dead", "error": reason}, status_code=503)
        # nothing of the traffic (busy, queue): /health needs no key, and a key must not be
        # able to follow another's requests (that is /metrics', behind the keys)
        return JSONResponse({"status": "ok", "model": engine.resident.name})

    async def root(request: Request) -> Response:
        """`GET /` and `HEAD /`: a 200 with no key, as Ollama and LM Studio answer. Claude Code
        sends `HEAD /` to its base URL before each session (a preconnect); a 404 there was the
        only error its sessions met. Nothing about the traffic or the model: see /health."""
        return JSONResponse({"status": "ok", "server": "mlx-spec", "openapi": "/openapi.json"})

    async def metrics(request: Request) -> Response:
        """The whole server's figures for an admin key, or for the only user (no keys, one
        key, --shared-history); with several keys, each key's own figures (keymetrics.py)."""
        kind = "text/plain; version=0.0.4"
        if keyed.is_admin(request.headers.get("authorization", "")):
            return PlainTextResponse(metrics_text(engine), media_type=kind)
        if not settings.keys() and keyed.admin_keys:
            message = "/metrics needs the admin key (--admin-key)"
            raise ApiError(401, message, code="invalid_api_key")
        partition = authorize(request, settings)
        if len(settings.keys()) <= 1 or settings.shared_history:  # one user: all is theirs
            return PlainTextResponse(metrics_text(engine), media_type=kind)
        waiting = len(engine.scheduler.queues.get(partition, ()))
        text = key_metrics_text(keyed.of(partition), waiting)
        return PlainTextResponse(text, media_type=kind)

    async def openapi(request: Request) -> Response:
        """The endpoints and their request bodies (server/openapi.py); no key needed."""
        return JSONResponse(openapi_document())

    async def api_error(request: Request, err: ApiError) -> Response:
        return errors_for(request.url.path)(err)

    async def http_error(request: Request, err: HTTPException) -> Response:
        message = {404: "no such endpoint", 405: "method not allowed"}.get(
            err.status_code, err.detail
        )
        respond = errors_for(request.url.path)
        return respond(ApiError(err.status_code, f"{message}: {request.url.path}"))

    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/openapi.json", openapi),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{rid}", get_response),
    ]
    app = Starlette(
        routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error}
    )
    app.add_middleware(Guard, settings=settings)
    return app


def model_entry(name: str, created: int, window: tuple[int | None, int | None]) -> dict:
    """A /v1/models entry in OpenAI's and Anthropic's shapes at once, with the context window
    where each client family reads it: vLLM's max_model_len (Codex, LiteLLM), LM Studio's
    max_context_length, Anthropic's max_input_tokens / max_tokens."""
    context, cap = window
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC)
    entry = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "mlx-spec",
        "type": "model",
        "display_name": name,
        "created_at": stamp.isoformat().replace("+00:00", "Z"),
        "lifecycle": "active",
    }
    if context is not None:
        entry |= {"max_model_len": context, "max_context_length": context}
        entry |= {"context_length": context, "max_input_tokens": context}
    if cap is not None:
        entry["max_tokens"] = cap
    return entry


class GracefulServer(uvicorn.Server):
    """uvicorn's server; on SIGTERM or SIGINT the engine first stops taking jobs, answers the
    queued ones 503 and gives the running one `grace` seconds."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_shutdown(self.grace)
        super().handle_exit(sig, frame)
