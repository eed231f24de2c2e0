"""The HTTP side: a Starlette app with OpenAI's endpoints, /health and /metrics.

Requests are validated here (protocol.py), queued on the engine (worker.py) and answered from
the job's items: streamed as server-sent events or collected into one JSON body. A client
that disconnects, while queued or mid-stream, cancels its job.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .protocol import (
    ApiError,
    GenRequest,
    Limits,
    choice,
    envelope,
    parse_chat,
    parse_completion,
)
from .worker import Engine, Job, timeout_error

DRAIN_LIMIT = 64 << 20  # an oversized body is read (and dropped) up to this, then cut off


@dataclass
class Settings:
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    request_timeout: float = 600.0
    limits: Limits = field(default_factory=Limits)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def authorize(request: Request, settings: Settings) -> None:
    if settings.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), settings.api_key.encode()
    ):
        raise ApiError(401, "Incorrect or missing API key", code="invalid_api_key")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes. An oversized body is still read
    (and dropped) so the client gets the 413, not a reset connection."""
    body, size = bytearray(), 0
    async for chunk in request.stream():
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
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def sse(data) -> dict:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return {"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True}


class JobResponse:
    """An ASGI response that answers one job: the status is chosen when its first item
    arrives (an error before any text is a plain HTTP error), then SSE chunks or one JSON
    body. Watches for the client leaving at the same time and cancels the job when it does."""

    def __init__(self, job: Job, on_status):
        self.job, self.on_status = job, on_status
        self.rid = ("chatcmpl-" if job.request.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def __call__(self, scope, receive, send):
        self.scope = scope
        answer = asyncio.ensure_future(self.answer(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.job.cancel()  # a no-op when the job is done; frees the engine otherwise
            watch.cancel()
            if not answer.done():
                answer.cancel()
        if answer.done() and not answer.cancelled():
            try:
                answer.result()
            except OSError:  # the client went away while we wrote
                pass

    async def first_item(self):
        """The job's first item, or a 504 once the deadline passes while queued."""
        remaining = self.job.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(self.job.items.get(), max(remaining, 0.001))
        except TimeoutError:
            self.job.cancel()
            return ("error", timeout_error())

    async def send_error(self, send, err: ApiError) -> None:
        self.on_status(err.status)
        await error_response(err)(self.scope, None, send)

    async def answer(self, send) -> None:
        item = await self.first_item()
        if item[0] == "error":
            await self.send_error(send, item[1])
            return
        if self.job.request.stream:
            await self.stream(send, item)
        else:
            await self.collect(send, item)

    async def collect(self, send, item) -> None:
        req, texts = self.job.request, []
        while item[0] == "text":
            texts.append(item[1])
            item = await self.job.items.get()
        if item[0] == "error":
            await self.send_error(send, item[1])
            return
        outcome = item[1]
        body = envelope(req, self.rid, self.created, chunk=False)
        body["choices"] = [choice(req, "".join(texts), outcome.finish_reason, full=True)]
        body["usage"] = outcome.usage
        body["speculation"] = outcome.speculation
        self.on_status(200)
        await JSONResponse(body)(self.scope, None, send)

    def chunk(self, text, finish=None, first=False) -> dict:
        req = self.job.request
        body = envelope(req, self.rid, self.created, chunk=True)
        body["choices"] = [choice(req, text, finish, first=first)]
        if req.include_usage:
            body["usage"] = None
        return body

    async def stream(self, send, item) -> None:
        req = self.job.request
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.on_status(200)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if req.kind == "chat":
            await send(sse(self.chunk(None, first=True)))
        while item[0] == "text":
            await send(sse(self.chunk(item[1])))
            item = await self.job.items.get()
        if item[0] == "error":  # after the headers: OpenAI's way is an error event
            await send(sse(item[1].body()))
        else:
            outcome = item[1]
            last = self.chunk(None if req.kind == "chat" else "", outcome.finish_reason)
            last["speculation"] = outcome.speculation
            await send(sse(last))
            if req.include_usage:
                tail = envelope(req, self.rid, self.created, chunk=True)
                tail.update(choices=[], usage=outcome.usage, speculation=outcome.speculation)
                await send(sse(tail))
        await send(sse("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def metrics_text(engine: Engine) -> str:
    m = engine.metrics
    lines = []

    def metric(name, kind, help_text, samples):
        lines.append(f"# HELP mlx_spec_{name} {help_text}")
        lines.append(f"# TYPE mlx_spec_{name} {kind}")
        for labels, value in samples:
            lines.append(f"mlx_spec_{name}{labels} {value}")

    requests = [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(m.requests.items())]
    metric("requests_total", "counter", "Requests answered, by endpoint and status.", requests)
    counters = [
        ("prompt_tokens_total", "Prompt tokens.", m.prompt_tokens),
        ("prompt_tokens_cached_total", "Prompt tokens reused from a kept KV cache.",
         m.prompt_tokens_cached),
        ("generated_tokens_total", "Generated tokens.", m.generated_tokens),
        ("drafted_tokens_total", "Draft tokens proposed.", m.drafted),
        ("accepted_tokens_total", "Draft tokens the target accepted.", m.accepted),
        ("target_passes_total", "Target forward passes while generating.", m.target_passes),
        ("generation_seconds_total", "Seconds spent generating.", round(m.generation_seconds, 4)),
        ("prefill_seconds_total", "Seconds spent prefilling prompts.", round(m.prefill_seconds, 4)),
        ("cancelled_total", "Jobs stopped because their client disconnected.", m.cancelled),
        ("timeouts_total", "Jobs stopped by the request timeout.", m.timeouts),
    ]  # fmt: skip
    for name, help_text, value in counters:
        metric(name, "counter", help_text, [("", value)])
    rate = m.accepted / m.drafted if m.drafted else 0.0
    history = engine.history
    gauges = [
        ("acceptance_rate", "Accepted / drafted draft tokens since start.", round(rate, 4)),
        ("queue_waiting", "Requests waiting for the engine.", engine.waiting),
        ("busy", "1 while a request is being generated.", int(engine.busy)),
        ("prompt_cache_entries", "Conversations whose KV caches are kept.",
         len(engine.cache.entries)),
        ("prompt_cache_bytes", "Bytes of the kept KV caches.", engine.cache.bytes),
        ("history_tokens", "Tokens in the history lookup index.",
         len(history) if history is not None else 0),
    ]  # fmt: skip
    for name, help_text, value in gauges:
        metric(name, "gauge", help_text, [("", value)])
    return "\n".join(lines) + "\n"


def create_app(engine: Engine, settings: Settings) -> Starlette:
    def count(endpoint: str, status: int) -> None:
        key = (endpoint, str(status))
        engine.metrics.requests[key] = engine.metrics.requests.get(key, 0) + 1

    async def generation(request: Request, endpoint: str, parse) -> Response | JobResponse:
        try:
            authorize(request, settings)
            data = await read_json(request, settings.max_body_bytes)
            req: GenRequest = parse(data, settings.limits)
            job = Job(req, asyncio.get_running_loop(), time.monotonic() + settings.request_timeout)
            engine.submit(job)
        except ApiError as err:
            count(endpoint, err.status)
            return error_response(err)
        return JobResponse(job, lambda status: count(endpoint, status))

    async def chat(request: Request) -> Response | JobResponse:
        return await generation(request, "chat", parse_chat)

    async def completions(request: Request) -> Response | JobResponse:
        return await generation(request, "completions", parse_completion)

    async def models(request: Request) -> Response:
        authorize(request, settings)
        created = int(time.time())
        names = [engine.name] if engine.name else []
        names += [n for n in engine.models if n != engine.name]
        data = [
            {"id": n, "object": "model", "created": created, "owned_by": "mlx-spec"} for n in names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": engine.name, "busy": engine.busy})

    async def metrics(request: Request) -> Response:
        authorize(request, settings)
        return PlainTextResponse(metrics_text(engine), media_type="text/plain; version=0.0.4")

    async def api_error(request: Request, err: ApiError) -> Response:
        return error_response(err)

    async def http_error(request: Request, err: HTTPException) -> Response:
        message = {404: "no such endpoint", 405: "method not allowed"}.get(
            err.status_code, err.detail
        )
        return error_response(ApiError(err.status_code, f"{message}: {request.url.path}"))

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(
        routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error}
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server; on SIGTERM or SIGINT the engine first stops taking jobs, answers the
    queued ones 503 and gives the running one `grace` seconds."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_shutdown(self.grace)
        super().handle_exit(sig, frame)
