"""One generation worker: queued jobs, one stream or one batch at a time, caches kept across
requests.

Requests queue and one thread decodes: one stream at a time (single-stream decoding is the
memory-bound regime speculation is for), or, with --max-batch N and a pair that batches, up to N
requests together as rows of one `batch.BatchDecoder` that still drafts (`_serve_batch`): rows
join between rounds as they are taken from the queue and leave as they finish. A request the
batch cannot take waits until the running rows finish, then runs alone. A pair whose drafter a
batch cannot take (a head: EAGLE-3, DFlash, MTP) batches plainly, without drafts: a request
that finds no other waiting drafts alone; requests that queue together share plain passes.
A batched row starts from its partition's kept decoder as a single stream does (only new
tokens are prefilled) and gives its caches back when it leaves; its lookup searches its own
text and its partition's history, as a single stream does.

The HTTP side (app.py) talks to the worker through `Job` (jobs.py): the worker puts ("delta",
output.Delta) items, then ("done", Outcome) or ("error", ApiError) on the job's
asyncio queue; the HTTP side calls `Engine.withdraw` (a queued job leaves the queue at once) or
sets `job.cancelled` when its client leaves. The worker checks that flag, the job's deadline and
shutdown between verify rounds and between prefill chunks, so a stopped job frees the engine
within a round or a chunk.

Partitions: every API key (one partition when there is no key, or with --shared-history) has
its own prompt cache and history index, so no request drafts from, reuses the KV cache of, or
can time another key's text. The queue is one per partition, served round robin. Rows of
different partitions share batched passes, but each drafts from its own text only.

Over 600 lines: the `Engine` holds the queue, the resident pair with its prompt caches and
the two runners (alone and as a batch row, both ending a request through jobs.Reply); the
prompt cache is prompt_cache.py, the job and its reply jobs.py.
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx

from ..core.processors import check_vocab, make_processors
from ..core.stats import Stats
from ..decode.batch import into_decoder, make_batch_decoder
from ..decode.engine import stream_rounds
from ..decode.events import EventMaker
from ..decode.history import HistoryIndex
from ..decode.prompts import constraint_for, prompt_tokens
from ..errors import Aborted, SpecError
from .jobs import Job, Reply, log_error, timeout_error
from .output import check_tool_choice, tool_grammar
from .prompt_cache import PromptCache, trim
from .prompts import prompt_ids, system_end
from .protocol import ApiError, GenRequest, speculation

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the batch-size histogram's upper bounds
# How long a lone request to a pair that batches only plainly waits for company before it
# drafts alone: requests a client sends together arrive within milliseconds of each other
# here, and 30 ms is a quarter of one token of the demo target on this CPU.
JOIN_WAIT = 0.03


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
    batch_size: int = 0  # rows in the batch's last pass (0 when no batch runs)
    batch_size_max: int = 0
    batch_passes: int = 0  # batched target passes
    batch_rows: int = 0  # requests in them, summed over passes
    batch_target_rows: int = 0  # target rows in them (B x (k+1)), summed over passes
    batch_hist: list[int] = field(default_factory=lambda: [0] * len(BATCH_BUCKETS))

    def add(self, stats: Stats, passes: bool = True) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.prompt_tokens_cached += stats.prompt_tokens_reused
        self.generated_tokens += stats.generated_tokens
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        if passes:  # a batched pass is counted once by add_pass, not once per row
            self.target_passes += stats.target_passes
        self.generation_seconds += stats.generation_seconds
        self.prefill_seconds += stats.prefill_seconds

    def add_pass(self, rows: int, target_rows: int) -> None:
        """One batched target pass over `rows` requests (`target_rows` token rows)."""
        self.batch_size = rows
        self.batch_size_max = max(self.batch_size_max, rows)
        self.target_passes += 1
        self.batch_passes += 1
        self.batch_rows += rows
        self.batch_target_rows += target_rows
        for i, bound in enumerate(BATCH_BUCKETS):
            if rows <= bound:
                self.batch_hist[i] += 1
                break


class Engine:
    """Holds the resident pair and serves jobs on its own thread, one at a time or batched.

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
        max_queue_per_key: int | None = None,
        raw_reasoning: bool = False,
        max_batch: int = 1,
    ):
        self.loader, self.models = loader, models
        self.max_queue, self.prompt_cache_bytes = max_queue, prompt_cache_bytes
        self.history_tokens = history_tokens  # 0: no history lookup
        self.max_queue_per_key = max_queue_per_key  # None: the whole queue
        self.raw_reasoning = raw_reasoning  # think text stays in content
        self.max_batch = max_batch  # 1: one stream at a time
        self.batch = None  # the resident pair's BatchDecoder, when it batches
        self.batch_plain = False  # it batches without drafts (the pair's drafter cannot)
        self.batch_refusal = "--max-batch 1"  # why the pair is not batched (or not drafted)
        self.metrics = Metrics()
        self.queues: dict[str, deque] = {}  # partition -> its waiting jobs
        self.turns: deque = deque()  # partitions with waiting jobs, next to serve first
        self.partitions: dict[str, tuple] = {}  # key -> (PromptCache, HistoryIndex | None)
        self.lock = threading.RLock()  # begin_shutdown may run in a signal handler
        self.ready = threading.Condition(self.lock)
        self.waiting = 0  # jobs queued, not yet taken
        self.busy = False
        self.closing = False
        self.running: list[Job] = []  # the jobs being generated (several when batched)
        # durations of each partition's last jobs (its Retry-After: never another key's)
        self.recent_seconds: dict[str, list[float]] = {}
        self.thread = threading.Thread(target=self._run, name="mlx-spec-engine", daemon=True)
        self.failure: BaseException | None = None  # why the engine thread ended, if it broke
        self.on_death: Callable[[], None] | None = None  # called on that thread when it does
        self.loaded: Future = Future()  # the start-up pair is resident (or failed to load)
        self._install(pair, name)

    # ------------------------------------------------------------------ pair and caches

    def _install(self, pair, name: str) -> None:
        self.pair, self.name = pair, name
        self.history = self._new_history()
        self.cache = PromptCache(pair, self.prompt_cache_bytes, self.history)
        self.batch, self.batch_plain = None, False
        if pair is not None and self.max_batch > 1:
            try:  # checked once: the caches' kinds and the drafter's (batch_drafting)
                self.batch = make_batch_decoder(pair)
            except SpecError as err:
                self.batch_refusal = str(err)
            unbatched = pair.speculative and pair.config.kind.batch_drafting(pair) is None
            if self.batch is None and unbatched:
                try:  # a drafter a batch cannot take: its target may still batch plainly
                    self.batch, self.batch_plain = make_batch_decoder(pair, plain=True), True
                    self.batch_refusal = f"the {pair.config.drafter} drafter is not batched yet"
                except SpecError as err:
                    self.batch_refusal = str(err)

    def _new_history(self) -> HistoryIndex | None:
        """A history for lookup across requests, when the drafter kind uses one."""
        kind = self.pair.config.kind if self.pair is not None else None
        uses = kind is not None and kind.uses_history
        return HistoryIndex(self.history_tokens) if uses and self.history_tokens else None

    @property
    def drafter(self) -> str:
        if self.pair is None or not self.pair.speculative:
            return "none"
        return self.pair.config.drafter

    def _partition(self, key: str) -> tuple:
        """The prompt cache and history of one partition (the default one is `cache` and
        `history`, made by `_install`); made again after a swap."""
        if key == "":
            return self.cache, self.history
        entry = self.partitions.get(key)
        if entry is None or entry[0].pair is not self.pair:
            history = self._new_history()
            entry = (PromptCache(self.pair, self.prompt_cache_bytes, history), history)
            self.partitions[key] = entry
        return entry

    def all_caches(self) -> list:
        caches = [self.cache]
        caches += [c for c, _ in self.partitions.values() if c.pair is self.pair]
        return caches

    def history_size(self) -> int:
        histories = [self.history] + [h for c, h in self.partitions.values() if c.pair is self.pair]
        return sum(len(h) for h in histories if h is not None)

    def trim_caches(self) -> None:
        """Keep all partitions' kept caches within --prompt-cache together, in mlx-lm's
        eviction order (prompt_cache.trim; a partition's size says how much was kept, never
        what)."""
        trim(self.all_caches(), self.prompt_cache_bytes)

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
            self.loaded.result()  # the loader's error, if any, is raised here (before serving)
        except Exception:
            self.thread.join()  # it ends right after a failed load
            raise

    def timed(self, partition: str, seconds: float) -> None:
        recent = self.recent_seconds.get(partition, [])
        self.recent_seconds[partition] = [*recent[-7:], seconds]

    def retry_after(self, partition: str = "") -> int:
        """Seconds until a queue slot is likely free: the mean recent job time, at least 1."""
        recent = self.recent_seconds.get(partition)
        mean = sum(recent) / len(recent) if recent else 1
        return max(1, min(60, math.ceil(mean)))

    def check_capacity(self, partition: str = "") -> None:
        """A 503 or 429 now, before a request's body is read, when it could not be queued."""
        with self.lock:
            if self.failure is not None:
                raise ApiError(503, "the engine stopped; the server is exiting", code="engine_dead")
            if self.closing:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            # --max-queue 0: a request is taken only when the engine is idle
            if self.waiting >= self.max_queue and (self.busy or self.waiting):
                raise ApiError(
                    429,
                    f"the server's queue is full (--max-queue {self.max_queue}); retry later",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(self.retry_after(partition))},
                )
            mine = len(self.queues.get(partition, ()))
            if self.max_queue_per_key is not None and mine >= max(self.max_queue_per_key, 1):
                raise ApiError(
                    429,
                    f"this API key already has {mine} requests queued"
                    f" (--max-queue-per-key {self.max_queue_per_key}); retry later",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(self.retry_after(partition))},
                )

    def submit(self, job: Job) -> None:
        key = job.request.partition
        with self.lock:
            self.check_capacity(key)
            self.waiting += 1
            if key not in self.queues or not self.queues[key]:
                self.queues[key] = deque()
                self.turns.append(key)
            self.queues[key].append(job)
            self.ready.notify()

    def withdraw(self, job: Job) -> bool:
        """A queued job whose client left: out of the queue now (True), not when its turn
        would have come. False when the worker already took it."""
        key = job.request.partition
        with self.lock:
            waiting = self.queues.get(key)
            if not waiting or job not in waiting:
                return False
            waiting.remove(job)
            self.waiting -= 1
            if not waiting:
                self.turns.remove(key)
                del self.queues[key]
            self.metrics.cancelled += 1
            return True

    def _next_job(self) -> Job | None:
        """The next job, round robin over partitions; None once shutting down and empty."""
        with self.ready:
            while not self.turns:
                if self.closing:
                    return None
                self.ready.wait()
            job = self._pop()
            self.busy, self.running = True, [job]
            return job

    def _pop(self) -> Job:
        """(With the lock.) The first job of the partition whose turn it is."""
        key = self.turns.popleft()
        waiting = self.queues[key]
        job = waiting.popleft()
        if waiting:
            self.turns.append(key)  # its next job after the other partitions' next ones
        else:
            del self.queues[key]
        self.waiting -= 1
        return job

    def _take_batchable(self) -> Job | None:
        """The next job if it can join the running batch (None: none waits, or the next in
        turn cannot be batched, so it waits for the batch to finish). Never blocks."""
        with self.lock:
            if self.closing or not self.turns:
                return None
            try:  # a request that breaks the check waits, and fails alone when its turn comes
                if not self.batchable(self.queues[self.turns[0]][0].request):
                    return None
            except Exception:
                return None
            job = self._pop()
            self.running.append(job)
            return job

    def _companion(self) -> Job | None:
        """A batchable job waiting beside the one just taken, or coming within JOIN_WAIT
        (clients that start together), taken from the queue: a plain batch then serves them
        at once, where alone the first would draft and the others wait for its whole reply.
        With --max-queue 0 nothing can wait beside a running job: no wait."""
        deadline = time.monotonic() + (JOIN_WAIT if self.max_queue else 0.0)
        with self.ready:
            while not self.turns and not self.closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.ready.wait(left)
            return self._take_batchable()  # (the lock is reentrant)

    def _done(self, job: Job) -> None:
        with self.lock:
            if job in self.running:
                self.running.remove(job)

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new jobs, answer queued ones 503, give the running one `grace` seconds."""
        with self.lock:
            self.closing = True
            for waiting in self.queues.values():
                for job in waiting:
                    job.put("error", ApiError(503, "the server is shutting down"))
            self.queues.clear()
            self.turns.clear()
            self.waiting = 0
            for job in self.running:
                if time.monotonic() + grace < job.deadline:  # cut by the shutdown: say so
                    job.deadline, job.shutdown = time.monotonic() + grace, True
            self.ready.notify_all()

    def stop(self, grace: float = 0.0, timeout: float | None = None) -> None:
        self.begin_shutdown(grace)
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            if self.pair is None and self.name:
                self._install(self.loader(self.name), self.name)
        except BaseException as err:
            self.loaded.set_exception(err)
            return
        self.loaded.set_result(None)
        job = None
        try:
            while True:
                job = self._next_job()
                if job is None:
                    return
                self._take(job)
                job = None
        except BaseException as err:  # the loop itself broke: nobody may wait on it
            if self.failure is None:  # (_take has told its jobs already)
                self._die(err, job)
            raise

    def _take(self, job: Job) -> None:
        """Serve one job taken from the queue (with what batches beside it). Whatever goes
        wrong fails that job alone: once, a ValueError raised before `_serve` ended the engine
        thread, and every later request hung while /health said ok."""
        start = time.monotonic()
        batched = False
        try:
            batched = self.batchable(job.request)
            companion = None
            if batched and self.batch_plain:  # alone, the request drafts
                companion = self._companion()
                batched = companion is not None
            if batched:
                self._serve_batch(job, companion)
            else:
                self._serve(job)
        except Exception as err:  # a bug outside _serve's own guard: this job fails alone
            log_error(err, job)
            job.put("error", ApiError(500, f"internal error: {type(err).__name__}: {err}"))
        except BaseException as err:  # the thread itself ends: every taken job hears it now
            self._die(err, job)
            raise
        finally:
            with self.lock:
                self.busy, self.running = False, []
            if not batched:  # (batched jobs are timed as each leaves)
                self.timed(job.request.partition, time.monotonic() - start)

    def _die(self, err: BaseException, job: Job | None) -> None:
        """The engine thread is ending on an error: refuse new jobs, fail the queued and
        running ones (503), and tell the server (`on_death`) so that it exits non-zero."""
        with self.lock:
            self.failure = err
            self.closing = True
            error = ApiError(503, f"the engine stopped: {type(err).__name__}: {err}")
            jobs = [job] if job is not None else []
            jobs += [j for j in self.running if j is not job]
            for j in [*jobs, *(j for q in self.queues.values() for j in q)]:
                j.put("error", error)
            self.queues.clear()
            self.turns.clear()
            self.waiting = 0
            self.running = []
        print(
            f"mlx-spec serve: the engine thread died: {type(err).__name__}: {err}", file=sys.stderr
        )
        if self.on_death is not None:
            self.on_death()

    @property
    def alive(self) -> bool:
        """False once the engine thread has ended on an error (or ended at all, not closing)."""
        if self.failure is not None:
            return False
        return self.closing or not self.thread.ident or self.thread.is_alive()

    # ------------------------------------------------------------------ one job

    def _gone(self, job: Job) -> bool:
        """Whether a job just taken from the queue is over already: its client left (counted)
        or its deadline passed (answered 504)."""
        if job.cancelled.is_set():
            self.metrics.cancelled += 1
            return True
        if time.monotonic() > job.deadline:
            self.metrics.timeouts += 1
            job.put("error", timeout_error(job))
            return True
        return False

    def _serve(self, job: Job) -> None:
        if self._gone(job):
            return
        try:
            self._generate(job)
        except Aborted:  # before the prefill: the client left or the deadline passed
            if job.cancelled.is_set():
                self.metrics.cancelled += 1
            else:
                self.metrics.timeouts += 1
                job.put("error", timeout_error(job))
        except ApiError as err:
            job.put("error", err)
        except SpecError as err:  # bad input found by the engine: a prompt too long, ...
            job.put("error", ApiError(400, str(err), code="invalid_value"))
        except Exception as err:  # a bug: answer 500 and keep serving
            log_error(err, job)
            job.put("error", ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    def _prompt(self, pair, req: GenRequest) -> list[int]:
        """The request's tokens: made by the HTTP side for this pair (server/prompts.py), or
        rendered here (a request that swapped the pair in)."""
        if req.prompt_ids is not None and req.prompt_pair is pair:
            return list(req.prompt_ids)
        return prompt_ids(pair, req, req.parse_special)

    def _config(self, pair, req: GenRequest):
        """The request's generation settings with its processors (penalties, logit_bias) and
        grammar (response_format, or tool_choice required / named: the call follows the
        tools' schemas), alone or in a batch; a grammar that cannot compile is a 400."""
        if req.kind == "chat" and req.tools and req.tool_choice not in ("auto", "none"):
            check_tool_choice(pair.tokenizer, req)
        constraint = None
        if req.constraint is not None:
            try:
                constraint = constraint_for(pair, **req.constraint)
            except SpecError as err:
                raise ApiError(400, str(err), "response_format", "invalid_value") from None
        lark = tool_grammar(pair.tokenizer, pair.vocab_size, req)
        if lark is not None:
            try:
                constraint = constraint_for(pair, grammar=lark)
            except SpecError as err:
                message = f"the tools cannot constrain the call: {err}"
                raise ApiError(400, message, "tools", "invalid_value") from None
        processors = make_processors(**req.penalties)
        return req.generation.replace(processors=processors, grammar=constraint)

    def _system_end(self, pair, req: GenRequest, tokens: list[int]) -> int | None:
        """Where the system prompt and tools end in `tokens` (made with the ids when the
        HTTP side made them)."""
        if req.prompt_ids is not None and req.prompt_pair is pair:
            return req.prompt_system_end
        return system_end(pair, req, tokens)

    def _generate(self, job: Job) -> None:
        req = job.request
        pair = self._pair_for(req.model)
        cache, history = self._partition(req.partition)
        tokens = self._prompt(pair, req)

        def abort() -> bool:  # asked between prefill chunks
            return job.cancelled.is_set() or time.monotonic() > job.deadline

        if abort():  # the client left (or time ran out) while the template was rendered
            raise Aborted("stopped before the prefill")
        config = self._config(pair, req)  # before the decoder is taken: a bad schema is a 400
        decoder = cache.take(tokens)  # a copy of the best kept one: entries stay as they are
        stats = Stats()
        reply = Reply(job, pair, tokens, self.raw_reasoning)
        marks = cache.marks(tokens, self._system_end(pair, req, tokens))

        def keep(mark: int) -> None:  # the prefill passed a segment's end: keep a copy there
            cache.keep_copy(decoder, "user" if mark == len(tokens) - 1 else "system")

        rounds = stream_rounds(
            pair, tokens, config, decoder=decoder, stats=stats, abort=abort, marks=marks,
            on_mark=keep,
        )  # fmt: skip
        try:
            for events in rounds:
                if reply.feed(events):
                    break
        except Aborted:
            reply.ended = "cancelled" if job.cancelled.is_set() else "timeout"
        finally:
            rounds.close()  # between rounds: the decoder stays consistent for the next job
            cache.save(decoder, "assistant")  # (not when a failure left it mid-round)
            self.trim_caches()
        self.metrics.add(stats)
        if history is not None:
            history.add(decoder.sequence)
        spec = speculation(stats, self.drafter, history is not None)
        spec["batched"] = False
        self._conclude(reply, stats, spec)

    def _conclude(self, reply: Reply, stats: Stats, spec: dict) -> None:
        """The job's last items (or nothing, when its client left) and its counters."""
        if reply.ended == "cancelled":
            self.metrics.cancelled += 1
        elif reply.ended == "timeout":
            self.metrics.timeouts += 1
        reply.finish(stats, spec)

    # ------------------------------------------------------------------ a batch of jobs

    def batchable(self, req: GenRequest) -> bool:
        """Whether this request may join the batch: the resident pair batches and it needs
        no swap (a row takes processors, logprobs and grammars as a single stream does). In a
        plain batch (a head pair) a seeded sampled request is not batched: alone it drafts,
        and its samples are the ones it gets every time only if it always runs alone."""
        if self.batch is None or req.model != self.name:
            return False
        config = req.generation
        return not (self.batch_plain and config.seed is not None and not config.sampling.greedy)

    def _serve_batch(self, first: Job, second: Job | None = None) -> None:
        """Serve `first` (and `second`, already taken) and every batchable job queued while
        they run in one BatchDecoder, up to max_batch rows, until no row is left. The queue is
        served in its order: when the next job cannot be batched, no more rows join; it runs
        alone once these finish."""
        live: dict[int, BatchRow] = {}
        pending = [second, first] if second is not None else [first]
        try:
            while True:
                while len(live) < self.max_batch:
                    job = pending.pop() if pending else self._take_batchable()
                    if job is None:
                        break
                    self._admit(job, live)
                for rid, row in list(live.items()):  # the client left, or time ran out
                    if row.reply.check():
                        self._leave(rid, live)
                if not live:
                    if len(self.batch):
                        self.batch.step()  # drops the rows cancelled above
                    self.metrics.batch_size = 0
                    return
                self._round(live)
        except Exception as err:  # a bug: every row answers 500; the next batch starts anew
            traceback.print_exc(file=sys.stderr)
            error = ApiError(500, f"internal error: {type(err).__name__}: {err}")
            for job in [row.job for row in live.values()] + pending:  # (taken, not admitted)
                job.put("error", error)
                self._done(job)
            self.metrics.batch_size = 0
            self.batch = make_batch_decoder(self.pair, plain=self.batch_plain)

    def _admit(self, job: Job, live: dict) -> None:
        """Prefill a job's prompt and add it to the batch (or answer it: left, late, bad).
        The row starts from its partition's best kept decoder, as a single stream would
        (only the new tokens are prefilled), and gives its caches back when it leaves."""
        try:
            if self._gone(job):
                return
            req, pair = job.request, self.pair
            try:
                config = self._config(pair, req)
                check_vocab(config.processors, pair.vocab_size)  # a 400, before the row joins
                tokens, max_tokens = prompt_tokens(pair, self._prompt(pair, req), config)
            except ApiError as err:
                job.put("error", err)
                return
            except SpecError as err:  # a prompt too long, a token id out of range, ...
                job.put("error", ApiError(400, str(err), code="invalid_value"))
                return
            decoder = self.batch
            stats = Stats(prompt_tokens=len(tokens))
            if decoder.drafting:
                stats.num_draft_tokens = decoder.fixed_k or decoder.controller.k_max
                stats.adaptive = decoder.controller is not None
            begin = time.perf_counter()
            cache, history = self._partition(req.partition)
            kept = cache.fetch(tokens)  # its own key's: no row reuses another's caches
            rid = decoder.add(
                tokens, config, max_tokens=max_tokens, history=history, kept=kept, keep=True
            )
            stats.prompt_tokens_reused = decoder.row(rid).reused
            stats.prefill_seconds = time.perf_counter() - begin
            # a copy of the detokenizer per row: rows are detokenized side by side
            maker = EventMaker(pair.tokenizer.detokenizer, stats, time.perf_counter(), max_tokens)
            reply = Reply(job, pair, tokens, self.raw_reasoning)
            live[rid] = BatchRow(
                job, reply, stats, maker, list(tokens), time.monotonic(), cache, kept
            )
            job = None  # a row now: `_leave` ends it
        except Exception as err:  # a bug (the batch starts anew): this job answers 500 too
            job.put("error", ApiError(500, f"internal error: {type(err).__name__}: {err}"))
            raise
        finally:
            if job is not None:
                self._done(job)

    def _round(self, live: dict) -> None:
        """One batch step: every row's tokens through its own reply; finished rows leave."""
        decoder = self.batch
        updates = decoder.step()
        stepped = sum(u.finish_reason != "cancelled" for u in updates.values())
        if stepped:  # (a step that only dropped cancelled rows ran no pass)
            self.metrics.add_pass(stepped, decoder.timing.rows)
        for rid, u in updates.items():
            row = live.get(rid)
            if row is None or u.finish_reason == "cancelled":  # left before this round
                continue
            if u.error is not None:  # its grammar failed: it fails alone, as it would alone
                message = f"internal error: {type(u.error).__name__}: {u.error}"
                row.job.put("error", ApiError(500, message))
                row.reply.ended = "error"
                self._leave(rid, live)
                continue
            row.sequence += u.tokens
            events = row.maker.feed(u.round)
            if u.done:
                events += row.maker.close()
            row.reply.feed(events)  # a stop string ends the reply: the row leaves now
            if u.done or row.reply.ended:
                self._leave(rid, live, u.state if u.done else None)

    def _leave(self, rid: int, live: dict, state=None) -> None:
        """A row's reply ends: its caches go back to its partition's prompt cache (`state`,
        or taken out of the batch now when it is still there), its outcome to its client."""
        row = live.pop(rid)
        if state is None:
            state = self.batch.remove(rid)
        if state is not None:
            decoder = into_decoder(row.kept or row.prompt_cache.new(), state)
            row.prompt_cache.save(decoder, "assistant")
            self.trim_caches()
        self.metrics.add(row.stats, passes=False)  # the batch counts its passes itself
        _, history = self._partition(row.job.request.partition)
        if history is not None:  # later single-stream requests may draft from it
            history.add(row.sequence)
        if self.batch_plain:  # the row could not draft: the pair's drafter is not batched
            spec = speculation(row.stats, "none", False)
        else:
            spec = speculation(row.stats, self.drafter, history is not None)
        spec["batched"] = True
        self._conclude(row.reply, row.stats, spec)
        self.timed(row.job.request.partition, time.monotonic() - row.started)
        self._done(row.job)


@dataclass
class BatchRow:
    """A job decoding as one row of the batch."""

    job: Job
    reply: Reply
    stats: Stats
    maker: EventMaker  # its rounds -> events, with its own detokenizer
    sequence: list[int]  # prompt + reply tokens (for the partition's history)
    started: float
    prompt_cache: PromptCache  # its partition's: the row's caches go back there
    kept: object | None = None  # the copy of a kept engine.Decoder it started from (emptied)
