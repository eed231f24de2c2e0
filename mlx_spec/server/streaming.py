"""Answering a job over HTTP: `JobResponse` streams its items as server-sent events (headers
and keep-alive comments while it is queued or prefilling) or collects them into one JSON body,
and cancels the job when its client leaves or stops reading.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.responses import JSONResponse

from .output import completion_logprobs
from .protocol import ApiError, choice, envelope
from .worker import Engine, Job, timeout_error

log = logging.getLogger("mlx_spec.server")


def sse(data) -> dict:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return {"type": "http.response.body", "body": f"data: {text}\n\n".encode(), "more_body": True}


class JobResponse:
    """An ASGI response that answers one job: the status is chosen when its first item
    arrives (an error before any text is a plain HTTP error), then SSE chunks or one JSON
    body; a stream that waits longer than `keepalive` (queued, prefilling) gets its headers
    and SSE comments meanwhile. Watches for the client leaving at the same time: a queued job
    then leaves the queue at once, a running one is cancelled."""

    def __init__(
        self, job: Job, on_status, engine: Engine, keepalive: float, headers=None, send_timeout=None
    ):
        self.job, self.on_status, self.engine = job, on_status, engine
        self.keepalive, self.headers = keepalive, headers or {}
        self.send_timeout = send_timeout  # None: a write may wait for the client for ever
        self.figures = None  # the key's own figures (keymetrics.KeyFigures), when counted
        self.rid = ("chatcmpl-" if job.request.kind == "chat" else "cmpl-") + job.id
        self.created = int(time.time())
        self.started = False  # the stream's headers went out
        self.offset = 0  # completions logprobs: text offset of the next token

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
        gets its headers after `keepalive` seconds and a comment every `keepalive` seconds."""
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
                    await send(
                        {
                            "type": "http.response.body",
                            "body": b": keep-alive\n\n",
                            "more_body": True,
                        }
                    )

    def record(self, outcome) -> None:
        if self.figures is not None:
            self.figures.add(outcome.usage, outcome.speculation)

    async def send_error(self, send, err: ApiError) -> None:
        if err.status == 504 and self.figures is not None:
            self.figures.timeouts += 1
        if self.started:  # after the headers: OpenAI's way is an error event
            await send(sse(err.body()))
            await send(sse("[DONE]"))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        self.on_status(err.status)
        await error_response(err)(self.scope, None, send)

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
        req = self.job.request
        content, reasoning, calls, entries = [], [], [], []
        while item[0] == "delta":
            d = item[1]
            content.append(d.content)
            reasoning.append(d.reasoning)
            calls += d.tool_calls
            entries += d.logprobs
            item = await self.job.items.get()
        if item[0] == "error":
            await self.send_error(send, item[1])
            return
        outcome = item[1]
        self.record(outcome)
        body = envelope(req, self.rid, self.created, chunk=False)
        text = "".join(content)
        out = choice(req, text, outcome.finish_reason, full=True)
        if req.kind == "chat":
            message = out["message"]
            if reasoning := "".join(reasoning):
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [
                    {k: v for k, v in c.items() if k != "index"} for c in calls
                ]
                message["content"] = text or None
        if req.logprobs is not None:
            out["logprobs"] = self.logprobs(entries)
        body["choices"] = [out]
        body["usage"] = outcome.usage
        body["speculation"] = outcome.speculation
        self.on_status(200)
        await JSONResponse(body, headers=self.headers)(self.scope, None, send)

    def logprobs(self, entries: list[dict]) -> dict:
        if self.job.request.kind == "chat":
            return {"content": entries, "refusal": None}
        out = completion_logprobs(entries, self.offset)
        self.offset += sum(len(e["token"]) for e in entries)
        return out

    def chunk(self, delta=None, finish=None, first=False) -> dict:
        req = self.job.request
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
        if self.job.request.kind == "chat":
            await send(sse(self.chunk(None, first=True)))

    async def stream(self, send, item) -> None:
        req = self.job.request
        await self.start_stream(send)
        while item[0] == "delta":
            await send(sse(self.chunk(item[1])))
            item = await self.job.items.get()
        if item[0] == "error":  # after the headers: OpenAI's way is an error event
            if item[1].status == 504 and self.figures is not None:
                self.figures.timeouts += 1
            await send(sse(item[1].body()))
        else:
            outcome = item[1]
            self.record(outcome)
            last = self.chunk(None, outcome.finish_reason)
            if req.kind != "chat":
                last["choices"][0]["text"] = ""
            last["speculation"] = outcome.speculation
            await send(sse(last))
            if req.include_usage:
                tail = envelope(req, self.rid, self.created, chunk=True)
                tail.update(choices=[], usage=outcome.usage, speculation=outcome.speculation)
                await send(sse(tail))
        await send(sse("[DONE]"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class SlowClient(Exception):
    """A write to the client waited longer than --send-timeout."""


async def wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
