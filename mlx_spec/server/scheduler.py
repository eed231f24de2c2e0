"""The server's queue: one per partition (API key), served round robin, bounded, with deadlines.

The HTTP side asks `check_capacity` before it reads a body (a 429 or 503 at once), then
`submit`s the job; a client that leaves while its job waits is `withdraw`n at once. The engine
thread takes jobs with `next_job` (blocking), `take_batchable` (a job that can join the running
batch, never blocking) and `companion` (one that arrives within JOIN_WAIT), and says when a
taken job is `done`. `expired` answers a job whose client left or whose deadline passed.
The engine's own rules — which request may join a batch — come in as `batchable`.

Nothing here touches MLX: every method may run on any thread (the lock is reentrant, since
`begin_shutdown` may run in a signal handler).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from .jobs import Job, timeout_error
from .protocol import ApiError

# How long a lone request to a pair that batches only plainly waits for company before it
# drafts alone: requests a client sends together arrive within milliseconds of each other
# here, and 30 ms is a quarter of one token of the demo target on this CPU.
JOIN_WAIT = 0.03


class Scheduler:
    """Per-partition queues served round robin; what runs, what waits, and whether more fit.

    `metrics` (keymetrics.Metrics) counts the jobs that leave early (cancelled, timed out)."""

    def __init__(self, metrics, max_queue: int = 16, max_queue_per_key: int | None = None):
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_queue_per_key = max_queue_per_key  # None: the whole queue
        self.queues: dict[str, deque] = {}  # partition -> its waiting jobs
        self.turns: deque = deque()  # partitions with waiting jobs, next to serve first
        self.lock = threading.RLock()  # begin_shutdown may run in a signal handler
        self.ready = threading.Condition(self.lock)
        self.waiting = 0  # jobs queued, not yet taken
        self.busy = False
        self.closing = False
        self.failure: BaseException | None = None  # why the engine thread ended, if it broke
        self.running: list[Job] = []  # the jobs being generated (several when batched)
        # durations of each partition's last jobs (its Retry-After: never another key's)
        self.recent_seconds: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ the HTTP side

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

    # ------------------------------------------------------------------ the engine thread

    def next_job(self) -> Job | None:
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

    def take_batchable(self, batchable: Callable) -> Job | None:
        """The next job if `batchable(request)` (None: none waits, or the next in turn cannot
        be batched, so it waits for the batch to finish). Never blocks."""
        with self.lock:
            if self.closing or not self.turns:
                return None
            try:  # a request that breaks the check waits, and fails alone when its turn comes
                if not batchable(self.queues[self.turns[0]][0].request):
                    return None
            except Exception:
                return None
            job = self._pop()
            self.running.append(job)
            return job

    def companion(self, batchable: Callable) -> Job | None:
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
            return self.take_batchable(batchable)  # (the lock is reentrant)

    def done(self, job: Job) -> None:
        with self.lock:
            if job in self.running:
                self.running.remove(job)

    def idle(self) -> None:
        """The taken jobs are all answered."""
        with self.lock:
            self.busy, self.running = False, []

    def expired(self, job: Job) -> bool:
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

    # ------------------------------------------------------------------ the end

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new jobs, answer queued ones 503, give the running ones `grace` seconds."""
        with self.lock:
            self.closing = True
            for waiting in self.queues.values():
                for job in waiting:
                    job.put("error", ApiError(503, "the server is shutting down"))
            self._clear()
            for job in self.running:
                if time.monotonic() + grace < job.deadline:  # cut by the shutdown: say so
                    job.deadline, job.shutdown = time.monotonic() + grace, True
            self.ready.notify_all()

    def fail(self, err: BaseException, first: Job | None) -> None:
        """The engine thread is ending on `err`: refuse new jobs and answer the taken and
        queued ones 503 (`first`, the job it was serving, first)."""
        with self.lock:
            self.failure = err
            self.closing = True
            error = ApiError(503, f"the engine stopped: {type(err).__name__}: {err}")
            jobs = [first] if first is not None else []
            jobs += [j for j in self.running if j is not first]
            for j in [*jobs, *(j for q in self.queues.values() for j in q)]:
                j.put("error", error)
            self._clear()
            self.running = []

    def _clear(self) -> None:
        self.queues.clear()
        self.turns.clear()
        self.waiting = 0
