"""A request as the worker holds it, and the one path that ends it.

`Job`: what the HTTP side (app.py) and the worker share — the request, its deadline, its
cancellation flag and the asyncio queue the worker puts ("delta", output.Delta) items on, then
("done", Outcome) or ("error", ApiError). `Reply`: one job's reply as it streams, alone or as a
batch row — its text through its stop strings and output parser, log-probabilities released
with the text they belong to, and its outcome.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

from ..core.stats import Stats
from .output import Output
from .protocol import ApiError, GenRequest, usage
from .stops import StopText


@dataclass
class Outcome:
    finish_reason: str
    usage: dict
    speculation: dict
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did


@dataclass
class Job:
    request: GenRequest
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the job gives up
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # in the response and the log
    shutdown: bool = False  # its deadline is the shutdown's grace period (SIGTERM)
    # (prompt tokens, of them read from a cache), once its prefill is done: what a Messages
    # stream's message_start says, in agreement with the usage at its end
    prompt_usage: tuple[int, int] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, *item) -> None:
        """From the worker thread: hand an item to the HTTP side."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Reply:
    """One job's reply as it streams: the text through its stop strings, logprobs released
    with the text they belong to, deltas and the outcome put on the job's queue. The
    single-stream and the batched paths both feed it events."""

    def __init__(self, job: Job, pair, tokens: list[int], raw_reasoning: bool, stats=None):
        req = job.request
        self.stats = stats  # the generation's Stats: its prompt figures go out with the text
        self.job, self.req = job, req
        self.stops = StopText(req.stop)
        self.output = Output(pair.tokenizer, req, tokens, raw_reasoning)
        self.ended: str | None = None  # why generation stopped early: stop, cancelled, timeout
        self.held: list = []  # (start offset in the raw text, logprob entry) not yet released
        self.produced = self.released = 0  # characters generated / let through the stops

    def check(self) -> str | None:
        """Whether the reply must end now: a stop string, the client gone, the deadline."""
        if self.ended is None:
            if self.stops.stopped:
                self.ended = "stop"
            elif self.job.cancelled.is_set():
                self.ended = "cancelled"
            elif time.monotonic() > self.job.deadline:
                self.ended = "timeout"
        return self.ended

    def feed(self, events: list) -> str | None:
        """A round's events -> a delta for the client; why the reply ends now, if it does."""
        text = self.stops.feed("".join(e.text for e in events))
        entries = None
        if self.req.logprobs is not None:
            for e in events:
                entry = self.output.entry(e.token, e.logprob, e.top_logprobs)
                self.held.append((self.produced, entry))
                self.produced += len(e.text)
            self.released += len(text)
            nothing_held = not self.stops.pending and not self.stops.stopped
            ready = [
                x
                for x in self.held
                if x[0] < self.released or (nothing_held and x[0] <= self.released)
            ]
            self.held = self.held[len(ready) :]
            entries = [x[1] for x in ready]
        delta = self.output.feed(text, entries)
        if self.job.prompt_usage is None and self.stats is not None:  # before the first delta
            self.job.prompt_usage = (self.stats.prompt_tokens, self.stats.prompt_tokens_reused)
        if delta:
            self.job.put("delta", delta)
        return self.check()

    def finish(self, stats: Stats, spec: dict) -> None:
        """The rest of the text and the outcome (a 504 after a timeout; nothing once the
        client left, or after an error the job already holds)."""
        if self.ended in ("cancelled", "error"):
            return
        if self.ended == "timeout":
            self.job.put("error", timeout_error(self.job))
            return
        if self.ended is None:
            held = [x[1] for x in self.held] if self.held else None
            tail = self.output.feed(self.stops.flush(), held)
            if tail:
                self.job.put("delta", tail)
        last = self.output.finish()
        if last:
            self.job.put("delta", last)
        finish = self.ended or stats.finish_reason
        if self.output.calls and finish == "stop":
            finish = "tool_calls"
        matched = self.stops.matched if self.ended == "stop" else None
        self.job.put("done", Outcome(finish, usage(stats), spec, matched))


def log_error(err: BaseException, job: Job) -> None:
    """A request's unexpected error: its traceback and, last, one line naming the request."""
    traceback.print_exception(err, file=sys.stderr)
    print(f"mlx-spec serve: request {job.id} failed: {type(err).__name__}: {err}", file=sys.stderr)


def internal(err: BaseException) -> ApiError:
    """A bug's 500 for the request it hit."""
    return ApiError(500, f"internal error: {type(err).__name__}: {err}")


def fail_taken(scheduler, jobs: list[Job], err: BaseException) -> None:
    """Jobs taken from the queue for a batch that will not run them: each answers 500."""
    for job in jobs:
        job.put("error", internal(err))
        scheduler.done(job)


def timeout_error(job: Job | None = None) -> ApiError:
    """Why a job's deadline passed: its own timeout, or the server's shutdown grace."""
    if job is not None and job.shutdown:
        message = "the server is shutting down: the reply was cut after --shutdown-timeout"
        return ApiError(503, message, code="shutting_down")
    return ApiError(504, "the request timed out (--request-timeout)", code="request_timeout")
