"""The engine: one thread that runs queued jobs, one stream or one batch at a time.

Three parts: the queue (`scheduler.Scheduler`: partitions, round robin, capacity, deadlines),
the resident pair (`resident.Resident`: loading and swapping, the prompt caches and histories,
the batch decoder) and this runner, which takes jobs from the one and decodes them on the
other; every request, alone or a batch row, ends through `Engine._finish` (its decoder to the
prompt cache, its text to the history, its counters, its reply).

Requests queue and one thread decodes: one stream at a time (single-stream decoding is the
memory-bound regime speculation is for), or, with --max-batch N and a pair that batches, up to N
requests together as rows of one `batch.BatchDecoder` that still drafts (`_serve_batch`): rows
join between rounds as they are taken from the queue and leave as they finish. A request the
batch cannot take waits until the running rows finish, then runs alone. A pair whose drafter a
batch cannot take (a kind that does not say how; every head of the package drafts in it)
batches plainly, without drafts: a request that finds no other waiting drafts alone; requests
that queue together share plain passes. A lone stream (such a pair's, a head's or a recurrent
target's, which run faster alone) pauses between rounds when a batchable job comes and goes on
as a batch row beside it (`_generate`, `_into_batch`): it does not hold the queue for its
whole reply.
A long prompt is prefilled a chunk at a time outside the batch, between its rounds and round
robin with other keys' prompts (`prefill.py`, `_prefill_turn`); a lone stream's prefill goes on
that way when a batchable job comes between two of its chunks (`_lone_chunks`).
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

The prompt cache is prompt_cache.py, the job and its reply jobs.py.

Over 600 lines: the one engine thread's three ways to run a job (a single stream, a batch row,
a prompt prefilled in chunks between the batch's rounds) hand jobs to one another mid-way (a
lone stream becomes a row, a prefill joins as one) and share the live rows, the pending
prefills and the resident pair; their policies are in scheduler.py, prefill.py and resident.py.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from mlx_lm.utils import common_prefix_len

from ..core.grammar import GrammarStateError
from ..core.processors import check_vocab
from ..core.stats import Stats
from ..decode.batch_rows import into_decoder
from ..decode.events import EventMaker
from ..decode.generate import make_batch_decoder, stream_rounds
from ..decode.prompts import prompt_tokens
from ..errors import Aborted, SpecError
from .jobs import Job, Reply, fail_taken, internal, log_error, timeout_error
from .keymetrics import Metrics
from .prefill import DEFAULT_CHUNK, Prefill, chunk_end, order, plan, shared_length, waits_for
from .prompt_cache import PromptCache
from .prompts import request_config, request_system_end, request_tokens
from .protocol import ApiError, GenRequest, speculation
from .resident import Resident
from .scheduler import Scheduler

# Tokens a running row must share with a new one beyond the prompt cache's best for the new
# one to start from a copy of its caches (`Engine._beside`): a copy of every layer is cheap
# beside a prefill, but not free
SHARE_MIN = 32


class Engine:
    """Serves jobs on its own thread, one at a time or batched: the runner over a `Scheduler`
    (the queue, scheduler.py) and a `Resident` pair (its caches and batch, resident.py).

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
        disk=None,
        prefill_chunk: int = DEFAULT_CHUNK,
    ):
        self.metrics = Metrics()
        self.scheduler = Scheduler(self.metrics, max_queue, max_queue_per_key)
        self.resident = Resident(
            loader,
            models,
            prompt_cache_bytes=prompt_cache_bytes,
            history_tokens=history_tokens,
            max_batch=max_batch,
            disk=disk,
        )
        self.raw_reasoning = raw_reasoning  # think text stays in content
        self.prefill_chunk = prefill_chunk  # prompt tokens a turn prefills at most (prefill.py)
        self.prefill_turns = 0  # chunks and joins served, counted: the round robin's clock
        self.prefill_served: dict[str, int] = {}  # partition -> the turn it was last served
        self.thread = threading.Thread(target=self._run, name="mlx-spec-engine", daemon=True)
        self.on_death: Callable[[], None] | None = None  # called on that thread when it dies
        self.loaded: Future = Future()  # the start-up pair is resident (or failed to load)
        self.resident.install(pair, name)

    # the HTTP side's calls, answered by the queue
    def check_capacity(self, partition: str = "") -> None:
        self.scheduler.check_capacity(partition)

    def submit(self, job: Job) -> None:
        self.scheduler.submit(job)

    def withdraw(self, job: Job) -> bool:
        return self.scheduler.withdraw(job)

    def begin_shutdown(self, grace: float) -> None:
        self.scheduler.begin_shutdown(grace)

    @property
    def failure(self) -> BaseException | None:
        """Why the engine thread ended, if it broke."""
        return self.scheduler.failure

    def batchable(self, req: GenRequest) -> bool:
        return self.resident.batchable(req)

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        self.thread.start()
        try:
            self.loaded.result()  # the loader's error, if any, is raised here (before serving)
        except Exception:
            self.thread.join()  # it ends right after a failed load
            raise

    def stop(self, grace: float = 0.0, timeout: float | None = None) -> None:
        self.begin_shutdown(grace)
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        resident = self.resident
        try:
            if resident.pair is None and resident.name:  # the start-up pair, loaded here
                resident.install(resident.loader(resident.name), resident.name)
        except BaseException as err:
            self.loaded.set_exception(err)
            return
        self.loaded.set_result(None)
        job = None
        try:
            while True:
                job = self.scheduler.next_job()
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
            batched = lone = self.batchable(job.request)
            companion = None
            if batched and self.resident.lone_alone:  # alone, it runs faster as a stream
                companion = self.scheduler.companion(self.batchable)
                batched = companion is not None
            if batched:
                self._serve_batch([job] + ([companion] if companion is not None else []))
            else:  # (lone: it moves into the batch when a batchable job comes)
                batched = self._serve(job, lone)
        except Exception as err:  # a bug outside _serve's own guard: this job fails alone
            log_error(err, job)
            job.put("error", internal(err))
        except BaseException as err:  # the thread itself ends: every taken job hears it now
            self._die(err, job)
            raise
        finally:
            self.scheduler.idle()
            if not batched:  # (batched jobs are timed as each leaves)
                self.scheduler.timed(job.request.partition, time.monotonic() - start)

    def _die(self, err: BaseException, job: Job | None) -> None:
        """The engine thread is ending on an error: refuse new jobs, fail the queued and
        running ones (503), and tell the server (`on_death`) so that it exits non-zero."""
        self.scheduler.fail(err, job)
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
        return self.scheduler.closing or not self.thread.ident or self.thread.is_alive()

    # ------------------------------------------------------------------ the end of a request

    def _finish(
        self, reply: Reply, stats: Stats, partition: str, decoder, sequence, drafter: str,
        batched: bool,
    ) -> None:  # fmt: skip
        """The one end of every request, alone or a batch row: its decoder (None: none to
        keep) to its partition's prompt cache, its text to the partition's history, its
        counters, and its last items to its client (nothing when the client left)."""
        cache, history = self.resident.partition(partition)
        if decoder is not None:
            cache.save(decoder, "assistant")  # (not when a failure left it mid-round)
            self.resident.trim_caches()
        if not batched:  # (a row's prefill is timed where it joins)
            cache.note_prefill(stats.prompt_tokens - stats.prompt_tokens_reused,
                               stats.prefill_seconds or 0.0)  # fmt: skip
        self.metrics.add(stats, passes=not batched)  # a batch counts its passes itself
        if history is not None:  # later requests may draft from it
            history.add(sequence)
        spec = speculation(stats, drafter, history is not None and drafter != "none")
        spec["batched"] = batched
        if reply.ended == "cancelled":
            self.metrics.cancelled += 1
        elif reply.ended == "timeout":
            self.metrics.timeouts += 1
        reply.finish(stats, spec)

    # ------------------------------------------------------------------ one job alone

    def _serve(self, job: Job, lone: bool = False) -> bool:
        """Serve one job as a single stream; True when it moved into the batch (`lone`: the
        job is batchable, see `_generate`) and ended there."""
        if self.scheduler.expired(job):
            return False
        try:
            return self._generate(job, lone)
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
            job.put("error", internal(err))
        return False

    def _generate(self, job: Job, lone: bool = False) -> bool:
        """A job as a single stream. `lone`: a batchable job that found no company (the pair's
        lone request is faster alone, `Resident.lone_alone`): when a batchable job comes while
        it decodes, it pauses between rounds and goes on as a row of the batch beside that
        job (`_into_batch`; True), rather than holding the queue for its whole reply (an
        8-token request to the demo pair got its first token after 6.4 s behind a 150-token
        reply, now after 0.25 s: benchmarks/late_request.py, 2026-12-04). A prompt longer
        than a chunk is prefilled a chunk at a time first (`_lone_chunks`): when a batchable
        job comes meanwhile, its prefill goes on beside that job, a chunk a turn (True)."""
        req, began = job.request, time.monotonic()
        pair = self.resident.pair_for(req.model)
        cache, _ = self.resident.partition(req.partition)
        tokens = request_tokens(pair, req)

        def abort() -> bool:  # asked between prefill chunks
            return job.cancelled.is_set() or time.monotonic() > job.deadline

        if abort():  # the client left (or time ran out) while the template was rendered
            raise Aborted("stopped before the prefill")
        config = request_config(pair, req)  # before the decoder is taken: a bad schema is a 400
        decoder = cache.take(tokens)  # a copy of the best kept one: entries stay as they are
        stats = Stats()
        reply = Reply(job, pair, tokens, self.raw_reasoning, stats)
        marks = cache.marks(tokens, request_system_end(pair, req, tokens))

        def keep(mark: int) -> None:  # the prefill passed a segment's end: keep a copy there
            cache.keep_copy(decoder, "user" if mark == len(tokens) - 1 else "system")

        joining: list[Job] = []

        def pause() -> bool:  # asked between rounds
            # (a sampled recurrent stream with a replay pending waits for a round without:
            # as a row it would feed the replay otherwise and draw other keys)
            if config.sampling.greedy or decoder.unfed == 1:
                joining.extend(filter(None, [self.scheduler.take_batchable(self.batchable)]))
            return bool(joining)

        movable = lone and pair is self.resident.pair
        prefilled = None  # (tokens reused, seconds) when chunks were prefilled here
        if movable and len(tokens) - decoder.reusable(tokens) > self.prefill_chunk:
            checked, max_tokens = prompt_tokens(pair, tokens, config)  # a 400 before any chunk
            use_draft = self._prefill_drafts(decoder, config) or config.use_draft
            reused, begin = decoder.reusable(tokens, use_draft), time.perf_counter()
            company = self._lone_chunks(
                req.partition, decoder, checked, use_draft, marks, keep, abort
            )
            prefilled = (reused, time.perf_counter() - begin)
            if company is not None:  # the rest is prefilled a chunk a turn beside it
                taken = Prefill(job, config, checked, max_tokens, self._row_stats(checked),
                                decoder, use_draft, marks, reused, prefilled[1],
                                started=began)  # fmt: skip
                self._served(taken)  # it had its chunks: the newcomer's turn comes first
                self._serve_batch([company], prefills=[taken])
                return True
        rounds = stream_rounds(
            pair, tokens, config, decoder=decoder, stats=stats, abort=abort, marks=marks,
            on_mark=keep, pause=pause if movable else None,
        )  # fmt: skip
        paused = None
        try:
            while True:
                try:
                    events = next(rounds)
                except StopIteration as stop:  # the reply ended, or paused (its return value)
                    paused = stop.value
                    break
                if prefilled is not None:  # (read with the first delta: jobs.Reply.feed)
                    stats.prompt_tokens_reused = prefilled[0]
                    stats.prefill_seconds += prefilled[1]
                    prefilled = None
                if reply.feed(events):
                    break
        except Aborted:
            reply.ended = "cancelled" if job.cancelled.is_set() else "timeout"
        except BaseException as err:  # a job taken for the batch is answered too
            fail_taken(self.scheduler, joining, err)
            raise
        finally:
            rounds.close()  # between rounds: the decoder stays consistent for the next job
        if prefilled is not None:  # (no round came)
            stats.prompt_tokens_reused = prefilled[0]
        if paused is not None:
            self._into_batch(job, began, reply, stats, decoder, paused, config, joining[0])
            return True
        drafter = self.resident.drafter
        self._finish(reply, stats, req.partition, decoder, decoder.sequence, drafter, False)
        return False

    def _lone_chunks(
        self, partition, decoder, tokens, use_draft, marks, on_mark, abort
    ) -> Job | None:
        """Prefill a lone job's prompt into its decoder a chunk at a time, up to its last
        chunk (its stream's own prefill does the rest). Between chunks a batchable job that
        came is taken and returned: the lone job's prefill then goes on a chunk a turn beside
        it (`_serve_batch`), rather than holding its first token for the whole prefill."""
        while (held := decoder.reusable(tokens, use_draft)) < len(tokens) - 1 - self.prefill_chunk:
            if abort():
                self._keep_prefilled(partition, decoder)
                raise Aborted("stopped during the prefill")
            end = chunk_end(held, len(tokens), self.prefill_chunk)
            marks_in = tuple(m for m in marks if m <= end and m < len(tokens) - 1)
            decoder.prefill(tokens[: end + 1], use_draft=use_draft, marks=marks_in, on_mark=on_mark)
            company = self.scheduler.take_batchable(self.batchable)
            if company is not None:
                return company
        return None

    def _into_batch(self, job: Job, began: float, reply, stats, decoder, paused, config, joining):
        """A lone job paused between rounds (`_generate`) becomes a row of the batch from its
        caches (nothing is prefilled again; its key goes on), and the batch serves it beside
        `joining` and whatever queues after."""
        resident = self.resident
        sequence, key = list(decoder.sequence), decoder.key
        try:
            batch, cache = resident.batch, resident.partition(job.request.partition)
            rid = batch.add(sequence, config, max_tokens=paused.max_tokens, history=cache[1],
                            kept=decoder, keep=True, processors=paused.processors)  # fmt: skip
        except Exception as err:  # a bug: both jobs fail (500), the batch starts anew
            fail_taken(self.scheduler, [joining], err)
            resident.batch = make_batch_decoder(resident.pair, plain=resident.batch_plain)
            raise RuntimeError(f"the stream could not join the batch: {err}") from err
        self.metrics.target_passes += stats.target_passes  # its passes alone (a row's: add_pass)
        self.metrics.streams_moved += 1
        if batch.row(rid).key is not None:
            batch.row(rid).key = key  # its samples go on as they would alone
        row = BatchRow(job, reply, stats, paused.maker, sequence, began, cache[0], decoder, config)
        self._serve_batch([joining], {rid: row})

    # ------------------------------------------------------------------ a batch of jobs

    def _serve_batch(
        self, jobs: list[Job], live: dict | None = None, prefills: list | None = None
    ) -> None:
        """Serve `jobs` (already taken; beside the rows `live` already holds and the prompts
        `prefills` is prefilling) and every batchable job queued while they run in the
        resident BatchDecoder, up to max_batch requests, until none is left. The queue is
        served in its order: when the next job cannot be batched, no more rows join; it runs
        alone once these finish. Each turn prefills at most one chunk of the pending prompts
        (prefill.py), then runs one round of the rows: a cold prompt no longer holds the
        others' tokens, nor a cached turn's first one, for its whole prefill."""
        resident, scheduler = self.resident, self.scheduler
        live = live if live is not None else {}
        prefills = prefills if prefills is not None else []
        pending = jobs[::-1]
        try:
            while True:
                while len(live) + len(prefills) < resident.max_batch:
                    job = pending.pop() if pending else scheduler.take_batchable(self.batchable)
                    if job is None:
                        break
                    taken = self._take_prefill(job, live)
                    if taken is not None:
                        prefills.append(taken)
                for rid, row in list(live.items()):  # the client left, or time ran out
                    if row.reply.check():
                        self._leave(rid, live)
                for p in [p for p in prefills if self._stopped(p.job)]:  # frees its turn now
                    prefills.remove(p)
                    self._keep_prefilled(p.partition, p.kept if p.served >= 0 else None)
                    scheduler.done(p.job)
                self._prefill_turn(prefills, live)
                if not live:
                    if prefills:
                        continue
                    if len(resident.batch):
                        resident.batch.step()  # drops the rows cancelled above
                    self.metrics.batch_size = 0
                    return
                if not prefills and self._goes_alone(live):  # the batch drained to one row
                    self._alone(live, pending)
                    continue
                self._round(live)
        except Exception as err:  # a bug: every row answers 500; the next batch starts anew
            traceback.print_exc(file=sys.stderr)
            error = internal(err)
            waiting = [p.job for p in prefills] + pending  # (taken, not admitted)
            for job in [row.job for row in live.values()] + waiting:
                job.put("error", error)
                scheduler.done(job)
            self.metrics.batch_size = 0
            resident.batch = make_batch_decoder(resident.pair, plain=resident.batch_plain)

    def _stopped(self, job: Job) -> bool:
        """Whether a job being prefilled is over: its client left (counted) or its deadline
        passed (answered 504, or 503 in a shutdown): checked between chunks."""
        return self.scheduler.expired(job)

    def _keep_prefilled(self, partition: str, decoder) -> None:
        """The chunks a stopped request prefilled go to its partition's prompt cache: a
        client that gave up and retries (agents retry on a timeout) starts from there."""
        if decoder is not None and decoder.sequence:
            self.resident.partition(partition)[0].save(decoder, "user")
            self.resident.trim_caches()

    def _prefill_drafts(self, decoder, config) -> bool:
        """Whether a row's prefill outside the batch feeds its drafter: a head's always (the
        batch's head prefills every row, and a decoder without the head's features would be
        prefilled again from the start: `Decoder.hidden_gap`), a draft model's when the row
        will draft with it (as `BatchDecoder.add` decides)."""
        batch = self.resident.batch
        if decoder is None or decoder.drafter is None:
            return False
        if decoder.hidden_layers:
            return True
        drafts = config.use_draft and batch.draft is not None and not self.resident.batch_plain
        return drafts and not batch._draft_cannot_pay()

    def _row_stats(self, tokens: list[int]) -> Stats:
        """A batch row's counters before it joins."""
        decoder = self.resident.batch
        stats = Stats(prompt_tokens=len(tokens))
        if decoder.drafting:
            stats.num_draft_tokens = decoder.fixed_k or decoder.controller.k_max
            stats.adaptive = decoder.controller is not None
        return stats

    def _take_prefill(self, job: Job, live: dict) -> Prefill | None:
        """A job taken for the batch, as a `Prefill` (None: answered already: left, late,
        bad). It starts from its partition's best kept decoder, as a single stream would
        (only the new tokens are prefilled), or from a running row's caches (`_beside`)."""
        try:
            if self.scheduler.expired(job):
                return None
            req, pair = job.request, self.resident.pair
            try:
                config = request_config(pair, req)
                check_vocab(config.processors, pair.vocab_size)  # a 400, before the row joins
                tokens, max_tokens = prompt_tokens(pair, request_tokens(pair, req), config)
            except ApiError as err:
                job.put("error", err)
                return None
            except SpecError as err:  # a prompt too long, a token id out of range, ...
                job.put("error", ApiError(400, str(err), code="invalid_value"))
                return None
            stats = self._row_stats(tokens)
            cache, _ = self.resident.partition(req.partition)
            kept = cache.fetch(tokens)  # its own key's: no row reuses another's caches
            kept = self._beside(req.partition, tokens, kept, live) or kept
            # a recurrent or windowed target's row keeps a copy at its system part's end, as
            # a single stream does: sub-tasks that come together then share that part
            marks = cache.marks(tokens, request_system_end(pair, req, tokens))
            use_draft = self._prefill_drafts(kept, config)  # (no decoder yet: nothing held)
            taken = Prefill(job, config, tokens, max_tokens, stats, kept, use_draft, marks)
            taken.reused, taken.started = taken.held(), time.monotonic()
            job = None  # a prefill now: `_serve_batch` ends it
            return taken
        except Exception as err:  # a bug (the batch starts anew): this job answers 500 too
            job.put("error", internal(err))
            raise
        finally:
            if job is not None:
                self.scheduler.done(job)

    def _prefill_turn(self, prefills: list, live: dict) -> None:
        """One turn's prefill work (prefill.plan): pending prompts whose rest fits the chunk
        budget join the batch; else the first in turn (round robin over API keys, then
        prompts) is prefilled one chunk further, outside the batch."""
        if not prefills:
            return
        freely = self.resident.partition("")[0].freely  # (one pair: every key's alike)
        for p in prefills:
            self._share(p, prefills, live)
        turn = order(prefills, self.prefill_served)
        # one prefills the prefix others share; they copy it when it is done
        turn = [p for p in turn if waits_for(p, prefills, SHARE_MIN, freely) is None]
        for i, joins in plan([p.left() for p in turn], self.prefill_chunk):
            p = turn[i]
            self._served(p)
            if joins:
                prefills.remove(p)
                self._join(p, live)
            elif not self._chunk(p):
                prefills.remove(p)

    def _share(self, p: Prefill, prefills: list, live: dict) -> None:
        """`p` goes on from a copy of other caches of its key where they hold at least
        SHARE_MIN more of its prompt than `p` does: its prompt cache's best (an entry kept
        since it was taken: a checkpoint another request's prefill passed), a running row's
        (`_beside`) or, where caches roll back freely, another pending prefill's."""
        held, cache = p.held(), self.resident.partition(p.partition)[0]
        copy = cache.fetch(p.tokens) if kept_reuse(cache, p.tokens) >= held + SHARE_MIN else None
        if cache.freely:
            copy = self._beside(p.partition, p.tokens, copy or p.kept, live) or copy
            best, most = None, max(held, copy.reusable(p.tokens) if copy else 0) + SHARE_MIN
            for q in prefills:  # (one still inside the shared prefix is waited for instead)
                if q is not p and q.partition == p.partition and q.kept is not None:
                    shared = shared_length(q.tokens, p.tokens)
                    if shared >= most and q.held() >= shared:
                        best, most = q, shared
            try:
                copy = best.kept.fork() if best is not None else copy
            except SpecError:  # a kind that cannot be copied: it prefills on its own
                pass
        if copy is not None:
            p.kept, p.use_draft = copy, self._prefill_drafts(copy, p.config)
            p.reused += max(p.held() - held, 0)  # (counted as cached, as a row beside's)

    def _served(self, p: Prefill) -> None:
        """`p` (and its partition) had a turn: the round robin's clock moves on."""
        self.prefill_turns += 1
        p.served = self.prefill_served[p.partition] = self.prefill_turns

    def _chunk(self, p: Prefill) -> bool:
        """Prefill one chunk of `p`'s prompt into its own decoder; False when it failed (a
        bug: it answers 500 alone, the batch goes on)."""
        begin = time.perf_counter()
        try:
            cache, _ = self.resident.partition(p.partition)
            if p.kept is None:
                p.kept = cache.new()
                p.use_draft = self._prefill_drafts(p.kept, p.config)
            decoder, tokens = p.kept, p.tokens
            end = chunk_end(p.held(), len(tokens), self.prefill_chunk)

            def keep(mark: int) -> None:  # the chunks passed the system part's end: a copy
                cache.keep_copy(decoder, "system")

            marks = tuple(m for m in p.marks if m <= end and m < len(tokens) - 1)
            decoder.prefill(tokens[: end + 1], use_draft=p.use_draft, marks=marks, on_mark=keep)
        except Exception as err:
            log_error(err, p.job)
            p.job.put("error", internal(err))
            self.scheduler.done(p.job)
            return False
        p.seconds += time.perf_counter() - begin
        return True

    def _join(self, p: Prefill, live: dict) -> None:
        """`p`'s prompt, prefilled but for its last chunk at most, joins the batch as a row:
        `BatchDecoder.add` prefills the rest from `p`'s decoder (or answers it: a bug)."""
        job = p.job
        try:
            req, pair, decoder = job.request, self.resident.pair, self.resident.batch
            cache, history = self.resident.partition(req.partition)

            def keep(state) -> None:
                cache.save(into_decoder(cache.new(), state), "system")

            begin = time.perf_counter()
            rid = decoder.add(
                p.tokens, p.config, max_tokens=p.max_tokens, history=history, kept=p.kept,
                keep=True, marks=p.marks, on_mark=keep,
            )  # fmt: skip
            stats = p.stats
            # what its caches held when it was taken (the chunks' tokens were prefilled)
            stats.prompt_tokens_reused = min(p.reused, decoder.row(rid).reused)
            stats.prefill_seconds = p.seconds + time.perf_counter() - begin
            cache.note_prefill(len(p.tokens) - stats.prompt_tokens_reused, stats.prefill_seconds)
            # a copy of the detokenizer per row: rows are detokenized side by side
            maker = EventMaker(pair.tokenizer.detokenizer, stats, time.perf_counter(), p.max_tokens)
            reply = Reply(job, pair, p.tokens, self.raw_reasoning, stats)
            live[rid] = BatchRow(
                job, reply, stats, maker, list(p.tokens), p.started, cache, p.kept, p.config
            )
            job = None  # a row now: `_leave` ends it
        except Exception as err:  # a bug (the batch starts anew): this job answers 500 too
            job.put("error", internal(err))
            raise
        finally:
            if job is not None:
                self.scheduler.done(job)

    def _beside(self, partition: str, tokens: list[int], kept, live: dict):
        """A decoder holding a copy of a running row's caches, when that row (of the same
        partition: no request reuses another key's caches) shares at least SHARE_MIN more of
        `tokens` than `kept` (the prompt cache's best): requests that come together with one
        long system prompt, an agent's parallel sub-tasks, prefill it once. Only where caches
        roll back freely (a recurrent state or a window cannot go back to the shared part),
        and where the shared part is at least about half of the row (the copy is of the whole
        row: a 30k-token conversation of an 8B model is ~4 GB of keys and values)."""
        cache = self.resident.partition(partition)[0]
        if not cache.freely:
            return None
        best, most = None, (kept.reusable(tokens) if kept is not None else 0) + SHARE_MIN
        for rid, row in live.items():
            if row.job.request.partition == partition:
                shared = common_prefix_len(row.sequence, tokens)
                # the whole row is copied, then cut: not for a small part of a long one
                if shared >= most and len(row.sequence) <= 2 * shared + SHARE_MIN:
                    best, most = rid, shared
        if best is None:
            return None
        try:
            return into_decoder(cache.new(), self.resident.batch.copy_row(best))
        except Exception as err:  # the new row prefills instead; the batch goes on
            log_error(err, live[best].job)
            return None

    def _round(self, live: dict) -> None:
        """One batch step: every row's tokens through its own reply; finished rows leave."""
        decoder = self.resident.batch
        updates = decoder.step()
        stepped = sum(u.finish_reason != "cancelled" for u in updates.values())
        if stepped:  # (a step that only dropped cancelled rows ran no pass)
            self.metrics.add_pass(stepped, decoder.timing.rows)
        for rid, u in updates.items():
            row = live.get(rid)
            if row is None or u.finish_reason == "cancelled":  # left before this round
                continue
            if u.error is not None:  # its grammar failed: it fails alone, as it would alone
                row.job.put("error", internal(u.error))
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

    def _goes_alone(self, live: dict) -> bool:
        """Whether the one row left would run faster as a single stream: where a lone request
        does (`Resident.lone_alone`: a head's batch of one ran at 0.68x the single stream on
        the demo pair)."""
        resident = self.resident
        if len(live) != 1 or not resident.lone_alone or resident.batch_plain:
            return False
        r = resident.batch.row(next(iter(live)))
        return r.max_tokens > r.emitted

    def _alone(self, live: dict, pending: list) -> None:
        """The one row left leaves the batch with its caches (and its head's state, its key,
        its processors and grammar) and decodes on as a single stream, through its own reply,
        until it ends (then it ends as a row does) or a batchable job is queued: that job goes
        to `pending`, to be admitted (and answered with the rows, should the row's joining
        the batch again fail), and the row joins again from its caches (nothing prefilled
        again)."""
        resident, (rid, row) = self.resident, next(iter(live.items()))
        batch = resident.batch
        r = batch.row(rid)  # (its processors and grammar go on with it, their state kept)
        key, remaining = r.key, r.max_tokens - r.emitted
        decoder = into_decoder(row.kept or row.prompt_cache.new(), batch.remove(rid))
        self.metrics.batch_size = 0
        self.metrics.rows_alone += 1
        pair, config = resident.pair, row.config
        speculative = config.use_draft and pair.speculative
        epoch = decoder.begin()
        if key is not None:
            decoder.key = key  # its samples go on as they would in the batch, or alone
        decoder.prefill(decoder.sequence, use_draft=speculative)  # (a replay's tokens only)
        policy = decoder.policy_for(config.draft_length(pair.config))
        rounds = decoder.rounds(
            remaining, config.sampling, policy, use_draft=speculative, processors=r.processors,
            logprobs=r.logprobs, forced=r.grammar,
        )  # fmt: skip
        joining = failed = None
        try:
            for rnd in rounds:
                row.sequence += rnd.tokens
                remaining -= len(rnd.tokens)
                events = row.maker.feed(rnd)
                done = rnd.finished or remaining <= 0
                row.reply.feed(events + (row.maker.close() if done else []))
                if done or row.reply.ended or row.reply.check():
                    break
                joining = self.scheduler.take_batchable(self.batchable)
                if joining is not None:
                    pending.append(joining)
                    break
        except (GrammarStateError, SpecError) as err:  # it fails alone, as a row in the batch
            failed = err
        finally:
            rounds.close()  # between rounds: the caches hold the sequence (as stream_rounds)
            if decoder.epoch == epoch:
                decoder.active = decoder.stale
                decoder.settle()
        if failed is not None:  # (its caches may be mid-round: not kept)
            row.job.put("error", internal(failed))
            row.reply.ended, decoder = "error", None
        if joining is None:
            self._end_row(live.pop(rid), decoder, resident.drafter)
            return
        _, history = resident.partition(row.job.request.partition)
        again = batch.add(decoder.sequence, config, max_tokens=remaining, history=history,
                          kept=decoder, keep=True, processors=r.processors)  # fmt: skip
        if key is not None:
            batch.row(again).key = decoder.key
        self.metrics.rows_rejoined += 1
        live.pop(rid)
        live[again], row.kept = row, decoder

    def _leave(self, rid: int, live: dict, state=None) -> None:
        """A row's reply ends: its caches (`state`, or taken out of the batch now when it is
        still there) become a decoder for its partition's prompt cache, and it ends as a
        request alone does (`_finish`)."""
        row = live.pop(rid)
        resident = self.resident
        if state is None:
            state = resident.batch.remove(rid)
        decoder = None
        if state is not None:
            decoder = into_decoder(row.kept or row.prompt_cache.new(), state)
        # a plain batch's row could not draft: the pair's drafter is not batched
        self._end_row(row, decoder, "none" if resident.batch_plain else resident.drafter)

    def _end_row(self, row: BatchRow, decoder, drafter: str) -> None:
        """A row's request ends as every request does (`_finish`), its time counted to its key."""
        partition = row.job.request.partition
        self._finish(row.reply, row.stats, partition, decoder, row.sequence, drafter, True)
        self.scheduler.timed(partition, time.monotonic() - row.started)
        self.scheduler.done(row.job)


def kept_reuse(cache: PromptCache, tokens: list[int]) -> int:
    """How many of `tokens` the prompt cache's best entry would give (`PromptCache.fetch`'s
    choice), without copying it."""
    along, _, below = cache.trie.search(tokens)
    return max((entry.decoder.reusable(tokens) for entry in along + below), default=0)


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
    config: object | None = None  # its GenerationConfig
