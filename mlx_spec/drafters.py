"""Drafters propose tokens for the target to verify.

A drafter keeps its own view of the sequence. The engine calls `prefill` with the prompt,
then each round `propose(k, ...)` and, after verification, `commit(kept)` with the tokens
the round emitted (the accepted draft tokens followed by the target's own token).
"""

from __future__ import annotations

import time
from typing import Protocol

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from . import caches
from .errors import Aborted, SpecError
from .processors import apply as apply_processors
from .sampling import SamplingParams, probabilities, sample


class Drafter(Protocol):
    def prefill(self, tokens: list[int], timed: bool = False) -> float | None:
        """Start a new sequence (or continue a cached one) from these tokens. `timed`: return
        the seconds of one draft step, measured on the prompt's last tokens (0 without a model;
        None if the prompt was too short to time)."""

    def reset(self) -> None:
        """Forget everything (the next prefill starts from nothing)."""

    def propose(
        self,
        k: int,
        params: SamplingParams,
        key: mx.array,
        stop_below: float = 0.0,
        *,
        processors=(),
    ) -> tuple[mx.array, mx.array | None]:
        """Up to k draft tokens (k,) and, unless greedy or deterministic, their distributions
        q (k, vocab). Lazy. A drafter with its own distribution may stop early after a token
        whose top probability is below `stop_below`. `processors` (processors.py) transform
        each draft step's logits as the target's are transformed, before sampling."""

    def commit(self, kept: list[int]) -> None:
        """The round emitted `kept`: the accepted draft tokens, then the target's one."""

    def settle(self) -> None:
        """Evaluate any state kept between replies (see Decoder.settle)."""

    steps: int  # draft-model forward passes the last `propose` queued (0 without a model)


def prefill_cache(
    model, cache: list, tokens: list[int], step: int = 2048, timed: bool = False, abort=None
) -> float | None:
    """Run `tokens` through `model`, filling `cache`, in chunks that bound peak memory.
    `abort()`, asked before each chunk, stops it with `engine.Aborted`.

    `timed`: the last two tokens go in one at a time, as decoding steps, and the second one's
    wall time is returned (the first pays the one-time costs of that shape: allocation, kernel
    compilation on Metal). None when there are too few tokens to do so."""
    timed = timed and len(tokens) >= 3
    batched = tokens[:-2] if timed else tokens
    for start in range(0, len(batched), step):
        if abort is not None and abort():
            raise Aborted("stopped during the prefill")
        model(mx.array(batched[start : start + step])[None], cache=cache)
        caches.eval_state(cache)
        mx.clear_cache()  # a long prompt's activations would otherwise stay in MLX's pool
    if not timed:
        return None
    for token in tokens[-2:]:
        start = time.perf_counter()
        logits = model(mx.array([token])[None], cache=cache)
        caches.eval_state(cache, logits)
        seconds = time.perf_counter() - start
    return seconds


class ModelDrafter:
    """A small language model from the target's family, with its own KV cache.

    Invariant between rounds: the cache holds every token of the sequence except `pending`
    (one token; two after a round where every draft token was accepted and the draft never
    ran on its own last proposal; more after rounds another drafter proposed for).
    """

    def __init__(self, model, vocab: int | None = None):
        self.model = model
        self.vocab = vocab  # the target's: a draft head with extra rows must not propose them
        self.steps = 0  # forward passes this round, one of them wasted after an early stop
        self.reset()
        self.recurrent = caches.is_recurrent(self.cache)

    def reset(self) -> None:
        self.cache = caches.make_cache(self.model, "draft")
        self.snapshots: list = []  # recurrent state after each step of this round's proposal
        self.cached: list[int] = []  # tokens in the cache
        self.pending: list[int] = []
        self.ran = False  # whether the model ran this round
        self.fed = 0  # draft tokens of this round's proposal the cache has seen

    def prefill(self, tokens: list[int], timed: bool = False) -> float | None:
        reuse = min(common_prefix_len(self.cached, tokens), len(tokens) - 1)
        if caches.can_rollback(self.cache, len(self.cached) - reuse):
            caches.rollback(self.cache, len(self.cached) - reuse)
        else:  # e.g. a recurrent state cannot forget: start over
            self.cache, reuse = caches.make_cache(self.model, "draft"), 0
        seconds = prefill_cache(self.model, self.cache, tokens[reuse:-1], timed=timed)
        self.cached = list(tokens[:-1])
        self.pending = [tokens[-1]]
        self.ran, self.fed = False, 0
        return seconds

    def catch_up(self) -> None:
        """Take in the tokens emitted since the model last ran (all but the last, which the
        next proposal feeds) in one batched, evaluated pass."""
        if len(self.pending) > 1:
            prefill_cache(self.model, self.cache, self.pending[:-1])
            self.cached += self.pending[:-1]
            self.pending = self.pending[-1:]

    def propose(self, k, params, key, stop_below=0.0, *, processors=()):
        self.ran, self.fed, self.steps, self.snapshots = k > 0, 0, 0, []
        if k == 0:
            return mx.zeros((0,), mx.uint32), None
        keys = None if params.greedy else mx.random.split(key, k)
        y = mx.array(self.pending)
        tokens, qs, top = [], [], []
        context = self.cached + self.pending if processors else None
        for i in range(k):
            logits = self.model(y[None], cache=self.cache)[0, -1]  # (vocab,)
            if self.vocab is not None and logits.shape[-1] > self.vocab:
                logits = logits[: self.vocab]  # padding rows the target cannot embed
            if processors:  # after context + x1..xi, as the target's row i
                so_far = mx.concatenate(tokens) if tokens else []
                logits = apply_processors(processors, context, so_far, logits)
            if self.recurrent:  # the state after pending + x1..xi: commit may return to it
                self.snapshots.append(caches.snapshot(self.cache))
            self.steps += 1
            self.fed += i > 0  # y is x_i, a draft token (before that: the pending tokens)
            if params.greedy:
                y = mx.argmax(logits, axis=-1, keepdims=True)
                confidence = mx.softmax(logits.astype(mx.float32)).max() if stop_below else y
            else:
                q = probabilities(logits, params)
                y = sample(q, keys[i])[None]
                confidence = q.max()
            mx.async_eval(y, confidence)  # the device starts while Python builds the next step
            # Confidence stop: read the previous token's top probability only now, with this
            # step already queued, so the device never waits on the host. Stopping wastes
            # this one step (x_i is in the cache either way: commit keeps it if accepted).
            if stop_below > 0 and i > 0 and top[-1].item() < stop_below:
                break
            tokens.append(y)
            top.append(confidence)
            if not params.greedy:
                qs.append(q)
        return mx.concatenate(tokens), (mx.stack(qs) if qs else None)

    def settle(self) -> None:
        caches.eval_state(self.cache)

    def commit(self, kept):
        if not self.ran:  # nothing drafted (k = 0, or another drafter proposed)
            self.pending = self.pending + kept
            return
        # the cache saw pending + the first `fed` draft tokens; the accepted ones are kept[:-1]
        valid = min(len(kept) - 1, self.fed)
        if self.recurrent:  # step `valid` fed x_valid (step 0: the pending tokens)
            caches.restore(self.cache, self.snapshots[valid])
        caches.rollback(self.cache, self.fed - valid, skip_recurrent=True)
        self.snapshots = []
        self.cached += self.pending + kept[:valid]
        self.pending = kept[valid:]
        self.ran, self.fed = False, 0


class NGramDrafter:
    """Prompt lookup: find the last few tokens earlier in the context (prompt or output) and
    propose the tokens that followed them. No model, almost no cost.

    The index maps every n-gram (ngram_min <= n <= ngram_max) to the position right after its
    latest occurrence; it is updated with each emitted token, so a round costs a handful of
    dictionary operations whatever the context length. Its q is a point mass on the guess.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, history=None):
        if not 1 <= ngram_min <= ngram_max:
            raise SpecError(f"need 1 <= ngram-min <= ngram-max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # a history.HistoryIndex over earlier requests (the server's): searched after the
        # context at each n-gram length, so a longer match there beats a shorter one here
        self.history = history
        self.steps = 0  # no model
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def _index_from(self, start: int) -> None:
        """Index the n-grams that end just before each position >= start."""
        for i in range(max(start, 1), len(self.tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                self.index[tuple(self.tokens[i - n : i])] = i

    def reset(self) -> None:
        self.tokens, self.index = [], {}

    def prefill(self, tokens: list[int], timed: bool = False) -> float | None:
        reuse = common_prefix_len(self.tokens, tokens)
        if reuse < len(self.tokens):  # a different history: entries may point past its end
            self.index, reuse = {}, 0
        self.tokens = list(tokens)
        self._index_from(reuse)
        return 0.0  # drafting costs a dictionary look-up

    def lookup(self, k: int) -> list[int]:
        history = self.history
        longest = max(self.ngram_max, history.ngram_max if history is not None else 0)
        for n in range(min(longest, len(self.tokens)), 0, -1):
            ngram = self.tokens[-n:]
            if self.ngram_min <= n <= self.ngram_max:
                start = self.index.get(tuple(ngram))
                if start is not None:
                    return self.tokens[start : start + k]
            if history is not None:
                guess = history.after(ngram, k)
                if guess:
                    return guess
        return []

    def has_proposal(self) -> bool:
        """Whether a round now would draft anything (a dictionary look-up: free)."""
        return bool(self.lookup(1))

    def propose(self, k, params, key, stop_below=0.0, *, processors=()):
        # the guess is not masked: a token a processor forbids gets probability 0 from the
        # target's row, so verification rejects it
        return mx.array(self.lookup(k), mx.uint32), None  # None: a point mass on the guess

    def settle(self) -> None:
        pass  # token ids only

    def commit(self, kept):
        start = len(self.tokens)
        self.tokens += kept
        self._index_from(start)


class LookupThenModel:
    """Prompt lookup first; the draft model only in rounds where lookup finds nothing.

    Rounds drafted by lookup skip the draft model; it catches up on their tokens (one batched
    forward pass) the next time it drafts.
    """

    def __init__(self, lookup: NGramDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model
        self.steps = 0

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    def prefill(self, tokens, timed=False):
        self.lookup.prefill(tokens)
        return self.model.prefill(tokens, timed)  # the model's step: lookup's is free

    def catch_up(self) -> None:
        self.model.catch_up()

    def propose(self, k, params, key, stop_below=0.0, *, processors=()):
        guess = self.lookup.lookup(k)
        if guess:
            self.steps = 0
            return mx.array(guess, mx.uint32), None  # a point mass on each guess
        kwargs = {"processors": processors} if processors else {}
        proposal = self.model.propose(k, params, key, stop_below, **kwargs)
        self.steps = self.model.steps
        return proposal

    def settle(self) -> None:
        self.model.settle()

    def commit(self, kept):
        self.lookup.commit(kept)
        self.model.commit(kept)
