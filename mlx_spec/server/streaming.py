"""Answering a job over HTTP: `JobResponse` streams its items as server-sent events (headers
and keep-alives while it is queued or prefilling) or collects them into one JSON body, and
cancels the job when its client leaves or stops reading. The wire format is an `Encoder`, one
per protocol fed the same items: OpenAI's chat completions and completions here, Anthropic's
Messages (anthropic.py) and OpenAI's Responses (responses.py) beside.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.responses import JSONResponse, Response

from .jobs import Job, timeout_error
from .output import Delta, completion_logprobs
from .protocol import ApiError, GenRequest, choice, envelope
from .worker import Engine

log = logging.getLogger("mlx_spec.server")


def sse(data, event: str | None = None) -> dict:
    """One server-sent event as an ASGI body message (`event`: its `event:` line)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return {
        "type": "http.response.body",
        "body": f"{head}data: {text}\n\n".encode(),
        "more_body": True,
    }


KEEPALIVE = {"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True}


def merge(deltas: list[Delta]) -> Delta:
    """A reply's deltas as one (a body that is not streamed)."""
    return Delta(
        content="".join(d.content for d in deltas),
        reasoning="".join(d.reasoning for d in deltas),
        tool_calls=[c for d in deltas for c in d.tool_calls],
        logprobs=[e for d in deltas for e in d.logprobs],
    )


class Encoder:
    """One protocol's wire format for a job's items: `JobResponse` does the waiting, the
    client watching and the status; an encoder turns the items into bodies and events. This
    one is OpenAI's chat completions and completions."""

    def __init__(self, req: GenRequest, job_id: str):
        self.req = req
        self.rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + job_id
        self.created = int(time.time())
        self.offset = 0  # completions logprobs: text offset of the next token

    def error_response(self, err: ApiError) -> Response:
        """An error before any of the answer went out: a plain HTTP error."""
        return error_response(err)

    def keepalive(self) -> dict:
        """What a waiting stream gets every `keepalive` seconds."""
        return KEEPALIVE

    opens_late = False  # the opening waits for the first item (it carries prompt figures)

    def opening(self, prompt: tuple[int, int] | None = None) -> list[dict]:
        """The events right after a stream's headers (`prompt`: the job's prompt tokens and
        cached tokens, for an encoder that `opens_late`)."""
        return [sse(self.chunk(None, first=True))] if self.req.kind == "chat" else []

    def delta(self, delta: Delta) -> list[dict]:
        return [sse(self.chunk(delta))]

    def done(self, outcome) -> list[dict]:
        """A stream's last events."""
        req = self.req
        last = self.chunk(None, outcome.finish_reason)
        if req.kind != "chat":
            last["choices"][0]["text"] = ""
        last["speculation"] = outcome.speculation
        out = [sse(last)]
        if req.include_usage:
            tail = envelope(req, self.rid, self.created, chunk=True)
            tail.update(choices=[], usage=outcome.usage, speculation=outcome.speculation)
            out.append(sse(tail))
        return [*out, sse("[DONE]")]

    def failed(self, err: ApiError) -> list[dict]:
        """An error after a stream's headers: OpenAI's way is an error event."""
        return [sse(err.body()), sse("[DONE]")]

    def body(self, d: Delta, outcome) -> dict:
        """The whole answer as one JSON body."""
        req = self.req
        body = envelope(req, self.rid, self.created, chunk=False)
        out = choice(req, d.content, outcome.finish_reason, full=True)
        if req.kind == "chat":
            message = out["message"]
            if d.reasoning:
                message["reasoning_content"] = d.reasoning
            if d.tool_calls:
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in d.tool_calls
                ]
                message["content"] = d.content or None
        if req.logprobs is not None:
            out["logprobs"] = self.logprobs(d.logprobs)
        body["choices"] = [out]
        body["usage"] = outcome.usage
        body["speculation"] = outcome.speculation
        return body

    def logprobs(self, entries: list[dict]) -> dict:
        if self.req.kind == "chat":
            return {"content": entries, "refusal": None}
        out = completion_logprobs(entries, self.offset)
        self.offset += sum(len(e["token"]) for e in entries)
        return out

    def chunk(self, delta=None, finish=None, first=False) -> dict:
        req = self.req
        body = envelope(req, self.rid, self.created, chunk=True)
        out = choice(req, delta.content if delta is not None else None, finish, first=first)
        if delta is not None and req.kind == "chat":
            if not delta.content:
                out["delta"].pop("content", None)
            if delta.reasoning:
                out["delta"]["reasoning_content"] = delta.reasoning
            if delta.tool_calls:
                out["delta"]["tool_calls"] = delta.tool_calls
        if delta is not None and req.logprobs is not None and delta.logprobs:
            out["logprobs"] = self.logprobs(delta.logprobs)
        body["choices"] = [out]
        if req.include_usage:
            body["usage"] = None
        return body


class JobResponse:
    """An ASGI response that answers one job: the status is chosen when its first item
    arrives (an error before any text is a plain HTTP error), then a stream of events or one
    JSON body, in the wire format of its `encoder` (OpenAI's by default); a stream that waits
    longer than `keepalive` (queued, prefilling) gets its headers and keep-alives meanwhile.
    Watches for the client leaving at the same time: a queued job then leaves the queue at
    once, a running one is cancelled."""

    def __init__(
        self,
        job: Job,
        on_status,
        engine: Engine,
        keepalive: float,
        headers=None,
        send_timeout=None,
        encoder: Encoder | None = None,
    ):
        self.job, self.on_status, self.engine = job, on_status, engine
        self.keepalive, self.headers = keepalive, headers or {}
        self.send_timeout = send_timeout  # None: a write may wait for the client for ever
        self.figures = None  # the key's own figures (keymetrics.KeyFigures), when counted
        self.encoder = encoder or Encoder(job.request, job.id)
        self.started = False  # the stream's headers went out

    async def __call__(self, scope, receive, send):
        self.scope = scope
        answer = asyncio.ensure_future(self.answer(self.bounded(send)))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done() and not answer.done() and self.figures is not None:
                self.figures.cancelled += 1  # the client left
        finally:
            if not self.engine.withdraw(self.job):  # still queued: out of the queue now
                self.job.cancel()  # a no-op when the job is done; frees the engine otherwise
            watch.cancel()
            if not answer.done():
                answer.cancel()
        if answer.done() and not answer.cancelled():
            try:
                answer.result()
            except OSError:  # the client went away while we wrote
                pass
            except SlowClient as err:  # the job was cancelled above: the engine is free
                log.warning("request %s cancelled: %s", self.job.id, err)
                if self.figures is not None:
                    self.figures.cancelled += 1

    def bounded(self, send):
        """`send`, failing with SlowClient when one write waits longer than send_timeout: a
        client that stops reading a stream (its socket open) once kept its generation
        running, and the requests behind it waiting, until max_tokens."""
        if not self.send_timeout:
            return send
        timeout = self.send_timeout

        async def timed(message):
            try:
                await asyncio.wait_for(send(message), timeout)
            except TimeoutError:
                raise SlowClient(f"its client read nothing for {timeout:g} s") from None

        return timed

    def header_list(self, extra) -> list:
        return [*extra, *((k.lower().encode(), v.encode()) for k, v in self.headers.items())]

    async def first_item(self, send):
        """The job's first item, or a 504 once the deadline passes while queued. A stream
        gets its headers after `keepalive` seconds and a keep-alive every `keepalive` seconds."""
        while True:
            remaining = self.job.deadline - time.monotonic()
            if remaining <= 0:
                self.job.cancel()
                self.engine.withdraw(self.job)
                return ("error", timeout_error(self.job))
            wait = min(remaining, self.keepalive) if self.job.request.stream else remaining
            try:
                return await asyncio.wait_for(self.job.items.get(), max(wait, 0.001))
            except TimeoutError:
                if self.job.request.stream and time.monotonic() < self.job.deadline:
                    await self.start_stream(send)
                    await send(self.encoder.keepalive())

    def record(self, outcome) -> None:
        if self.figures is not None:
            self.figures.add(outcome.usage, outcome.speculation)

    async def send_error(self, send, err: ApiError) -> None:
        if err.status == 504 and self.figures is not None:
            self.figures.timeouts += 1
        if self.started:  # after the headers: an error event
            await self.send_all(send, self.encoder.failed(err))
            return
        self.on_status(err.status)
        await self.encoder.error_response(err)(self.scope, None, send)

    async def send_all(self, send, messages: list[dict], end: bool = True) -> None:
        for message in messages:
            await send(message)
        if end:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def answer(self, send) -> None:
        item = await self.first_item(send)
        if item[0] == "error":
            await self.send_error(send, item[1])
            return
        if self.job.request.stream:
            await self.stream(send, item)
        else:
            await self.collect(send, item)

    async def collect(self, send, item) -> None:
        deltas = []
        while item[0] == "delta":
            deltas.append(item[1])
            item = await self.job.items.get()
        if item[0] == "error":
            await self.send_error(send, item[1])
            return
        outcome = item[1]
        self.record(outcome)
        body = self.encoder.body(merge(deltas), outcome)
        self.on_status(200)
        await JSONResponse(body, headers=self.headers)(self.scope, None, send)

    async def start_stream(self, send) -> None:
        if self.started:
            return
        self.started = True
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.on_status(200)
        await send(
            {"type": "http.response.start", "status": 200, "headers": self.header_list(headers)}
        )
        if not self.encoder.opens_late:
            await self.send_all(send, self.encoder.opening(), end=False)

    async def stream(self, send, item) -> None:
        await self.start_stream(send)
        if self.encoder.opens_late and item[0] != "error":
            prompt = self.job.prompt_usage
            if prompt is None and item[0] == "done":  # no text at all: the outcome's figures
                u = item[1].usage
                prompt = (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
            await self.send_all(send, self.encoder.opening(prompt), end=False)
        while item[0] == "delta":
            await self.send_all(send, self.encoder.delta(item[1]), end=False)
            item = await self.job.items.get()
        if item[0] == "error":
            await self.send_error(send, item[1])
            return
        self.record(item[1])
        await self.send_all(send, self.encoder.done(item[1]))


class SlowClient(Exception):
    """A write to the client waited longer than --send-timeout."""


async def wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
