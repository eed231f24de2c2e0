"""One generation worker: a FIFO queue of jobs, one stream at a time, caches kept across requests.

Single-stream decoding is the memory-bound regime speculation is for, so requests queue and one
thread decodes. The HTTP side (app.py) talks to the worker through `Job`: the worker puts
("text", str), then ("done", Outcome) or ("error", ApiError) on the job's asyncio queue; the
HTTP side sets `job.cancelled` when its client leaves. The worker checks that flag, the job's
deadline and shutdown between verify rounds, so a stopped job frees the engine within a round.
"""

from __future__ import annotations

import asyncio
import gc
import math
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
from jinja2 import TemplateError
from mlx.utils import tree_flatten
from mlx_lm.utils import common_prefix_len

from ..drafters import LookupThenModel, ModelDrafter, NGramDrafter
from ..engine import constraint_for, encode_prompt, make_decoder, stream_rounds
from ..errors import SpecError
from ..history import HistoryIndex
from ..stats import Stats
from .protocol import ApiError, GenRequest, speculation, usage
from .stops import StopText

LOOKUP_DRAFTERS = ("ngram", "ngram+model")


@dataclass
class Outcome:
    finish_reason: str
    usage: dict
    speculation: dict


@dataclass
class Job:
    request: GenRequest
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which the job gives up
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, *item) -> None:
        """From the worker thread: hand an item to the HTTP side."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def cache_bytes(cache: list) -> int:
    total = 0
    for c in cache:
        try:
            total += c.nbytes
        except (AttributeError, NotImplementedError):  # a cache kind without nbytes
            total += sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    return total


def lookup_of(drafter) -> NGramDrafter | None:
    if isinstance(drafter, NGramDrafter):
        return drafter
    return drafter.lookup if isinstance(drafter, LookupThenModel) else None


def model_of(drafter) -> ModelDrafter | None:
    if isinstance(drafter, ModelDrafter):
        return drafter
    return drafter.model if isinstance(drafter, LookupThenModel) else None


def decoder_bytes(decoder) -> int:
    total = cache_bytes(decoder.cache)
    model = model_of(decoder.drafter)
    return total + (cache_bytes(model.cache) if model is not None else 0)


class PromptCache:
    """Decoders (KV caches and drafter state) by the tokens they hold, least recently used
    first, bounded in bytes. A prompt that extends a kept sequence takes its decoder, so only
    its new tokens are prefilled; anything else gets a fresh decoder."""

    def __init__(self, pair, max_bytes: int, history: HistoryIndex | None):
        self.pair, self.max_bytes, self.history = pair, max_bytes, history
        self.entries: list = []  # Decoder, least recently used first
        self.bytes = 0

    def take(self, tokens: list[int]):
        # reuse a decoder whose sequence the prompt mostly continues (a re-rendered reply or
        # a stop string may cut its end); rolling back more would discard another
        # conversation's cache. The longest shared prefix wins, ties the most recent.
        best, shared = None, 0
        for d in self.entries:
            n = common_prefix_len(d.sequence, tokens)
            if n and n >= shared and 2 * n >= len(d.sequence):
                best, shared = d, n
        if best is not None:
            self.entries.remove(best)
        else:
            best = make_decoder(self.pair)
            lookup = lookup_of(best.drafter)
            if lookup is not None:
                lookup.history = self.history
        self.entries.append(best)
        return best

    def trim(self) -> None:
        """Drop least recently used decoders until the kept caches fit in max_bytes (and
        those that hold nothing: a request that failed before its prefill)."""
        self.entries = [d for d in self.entries if d.sequence]
        sizes = [decoder_bytes(d) for d in self.entries]
        while self.entries and sum(sizes) > self.max_bytes:
            self.entries.pop(0)
            sizes.pop(0)
        self.bytes = sum(sizes)

    def clear(self) -> None:
        self.entries, self.bytes = [], 0


@dataclass
class Metrics:
    """Totals since start (counters) for /metrics; written by the worker thread only."""

    requests: dict = field(default_factory=dict)  # (endpoint, status) -> count (HTTP side)
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    generation_seconds: float = 0.0
    prefill_seconds: float = 0.0
    cancelled: int = 0
    timeouts: int = 0

    def add(self, stats: Stats) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.prompt_tokens_cached += stats.prompt_tokens_reused
        self.generated_tokens += stats.generated_tokens
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        self.target_passes += stats.target_passes
        self.generation_seconds += stats.generation_seconds
        self.prefill_seconds += stats.prefill_seconds


class Engine:
    """Holds the resident pair and serves jobs one at a time on its own thread.

    `loader(name)` loads a pair by name (the startup pair or one from models.toml): a request
    for another model than the resident one swaps it (one pair resident at a time). Pairs are
    loaded on the engine thread, the one that generates (threads.py): with `pair=None`,
    `start()` loads `name` there and returns once it is resident (or raises the loader's error).
    """

    def __init__(
        self,
        pair,
        name: str,
        loader: Callable[[str], object],
        models: list[str],
        *,
        max_queue: int = 16,
        prompt_cache_bytes: int = 2 << 30,
        history_tokens: int = 0,
    ):
        self.loader, self.models = loader, models
        self.max_queue, self.prompt_cache_bytes = max_queue, prompt_cache_bytes
        self.history_tokens = history_tokens  # 0: no history lookup
        self.metrics = Metrics()
        self.pending: queue.Queue = queue.Queue()
        self.lock = threading.RLock()  # begin_shutdown may run in a signal handler
        self.waiting = 0  # jobs queued, not yet taken
        self.busy = False
        self.closing = False
        self.current: Job | None = None
        self.recent_seconds: list[float] = []  # durations of the last jobs (Retry-After)
        self.thread = threading.Thread(target=self._run, name="mlx-spec-engine", daemon=True)
        self.ready: Future = Future()  # the start-up pair is resident (or failed to load)
        self._install(pair, name)

    # ------------------------------------------------------------------ pair and caches

    def _install(self, pair, name: str) -> None:
        self.pair, self.name = pair, name
        lookup = pair is not None and pair.drafter in LOOKUP_DRAFTERS
        self.history = HistoryIndex(self.history_tokens) if lookup and self.history_tokens else None
        self.cache = PromptCache(pair, self.prompt_cache_bytes, self.history)

    @property
    def drafter(self) -> str:
        if self.pair is None or not self.pair.speculative:
            return "none"
        return self.pair.drafter

    def _pair_for(self, model: str):
        if model == self.name and self.pair is not None:
            return self.pair
        if model not in self.models:
            message = f"The model {model!r} does not exist; see /v1/models"
            raise ApiError(404, message, "model", "model_not_found")
        # one pair resident: free the old one before loading the next
        self._install(None, "")
        gc.collect()
        mx.clear_cache()
        try:
            pair = self.loader(model)
        except SpecError as err:
            raise ApiError(404, f"the pair {model!r} cannot be loaded: {err}", "model") from None
        except Exception as err:  # a broken file, out of memory, ...: the next request retries
            message = f"the pair {model!r} failed to load: {type(err).__name__}: {err}"
            raise ApiError(503, message, "model") from None
        self._install(pair, model)
        return pair

    # ------------------------------------------------------------------ queue

    def start(self) -> None:
        self.thread.start()
        try:
            self.ready.result()  # the loader's error, if any, is raised here (before serving)
        except Exception:
            self.thread.join()  # it ends right after a failed load
            raise

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the mean recent job time, at least 1."""
        mean = sum(self.recent_seconds) / len(self.recent_seconds) if self.recent_seconds else 1
        return max(1, min(60, math.ceil(mean)))

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.closing:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            # --max-queue 0: a request is taken only when the engine is idle
            if self.waiting >= self.max_queue and (self.busy or self.waiting):
                raise ApiError(
                    429,
                    f"{self.waiting} requests are already queued (--max-queue {self.max_queue});"
                    " retry later",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(self.retry_after())},
                )
            self.waiting += 1
        self.pending.put(job)

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new jobs, answer queued ones 503, give the running one `grace` seconds."""
        with self.lock:
            self.closing = True
            while True:
                try:
                    job = self.pending.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self.waiting -= 1
                    job.put("error", ApiError(503, "the server is shutting down"))
            current = self.current
            if current is not None:
                current.deadline = min(current.deadline, time.monotonic() + grace)
        self.pending.put(None)

    def stop(self, grace: float = 0.0, timeout: float | None = None) -> None:
        self.begin_shutdown(grace)
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            if self.pair is None and self.name:
                self._install(self.loader(self.name), self.name)
        except BaseException as err:
            self.ready.set_exception(err)
            return
        self.ready.set_result(None)
        while True:
            job = self.pending.get()
            if job is None:
                return
            with self.lock:
                self.waiting -= 1
                self.busy, self.current = True, job
            start = time.monotonic()
            try:
                self._serve(job)
            finally:
                with self.lock:
                    self.busy, self.current = False, None
                self.recent_seconds = [*self.recent_seconds[-7:], time.monotonic() - start]

    # ------------------------------------------------------------------ one job

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while queued
            self.metrics.cancelled += 1
            return
        if time.monotonic() > job.deadline:
            self.metrics.timeouts += 1
            job.put("error", timeout_error())
            return
        try:
            self._generate(job)
        except ApiError as err:
            job.put("error", err)
        except SpecError as err:  # bad input found by the engine: a prompt too long, ...
            job.put("error", ApiError(400, str(err), code="invalid_value"))
        except Exception as err:  # a bug: answer 500 and keep serving
            traceback.print_exc(file=sys.stderr)
            job.put("error", ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    def _generate(self, job: Job) -> None:
        req = job.request
        pair = self._pair_for(req.model)
        try:
            tokens = encode_prompt(
                pair.tokenizer, req.prompt, template_kwargs=req.chat_template_kwargs
            )
        except TemplateError as err:  # e.g. "roles must alternate": the messages, not a bug
            raise ApiError(
                400, f"the chat template rejected the messages: {err}", "messages"
            ) from None
        constraint = None
        if req.constraint is not None:  # before the decoder is taken: a bad schema is a 400
            try:
                constraint = constraint_for(pair, **req.constraint)
            except SpecError as err:
                raise ApiError(400, str(err), "response_format", "invalid_value") from None
        decoder = self.cache.take(tokens)
        stats, stops = Stats(), StopText(req.stop)
        rounds = stream_rounds(
            pair,
            tokens,
            req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            decoder=decoder,
            stats=stats,
            grammar=constraint,
        )
        ended = None  # why generation stopped early: "stop", "cancelled", "timeout"
        try:
            for batch in rounds:
                text = stops.feed("".join(e.text for e in batch))
                if text:
                    job.put("text", text)
                if stops.stopped:
                    ended = "stop"
                elif job.cancelled.is_set():
                    ended = "cancelled"
                elif time.monotonic() > job.deadline:
                    ended = "timeout"
                if ended:
                    break
        finally:
            rounds.close()  # between rounds: the decoder stays consistent for the next job
            self.cache.trim()
        self.metrics.add(stats)
        if self.history is not None:
            self.history.add(decoder.sequence)
        if ended == "cancelled":
            self.metrics.cancelled += 1
            return
        if ended == "timeout":
            self.metrics.timeouts += 1
            job.put("error", timeout_error())
            return
        if ended is None:
            tail = stops.flush()
            if tail:
                job.put("text", tail)
        spec = speculation(stats, self.drafter, self.history is not None)
        job.put("done", Outcome(ended or stats.finish_reason, usage(stats), spec))


def timeout_error() -> ApiError:
    return ApiError(504, "the request timed out (--request-timeout)", code="request_timeout")
