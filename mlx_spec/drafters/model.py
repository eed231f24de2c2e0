"""The draft model: a small language model from the target's family, with its own KV cache."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from ..core import caches
from ..core.caches import prefill_cache
from ..core.processors import apply as apply_processors
from ..core.sampling import draw
from .base import Drafter


class ModelDrafter(Drafter):
    """Invariant between rounds: the cache holds every token of the sequence except `unfed`
    (one token; two after a round where every draft token was accepted and the draft never
    ran on its own last proposal; more after rounds another drafter proposed for).

    `confidence`: a proposal stops after a token whose top probability is below it (0: off).
    """

    def __init__(self, model, vocab: int | None = None, confidence: float = 0.0):
        self.model = model
        self.vocab = vocab  # the target's: a draft head with extra rows must not propose them
        self.confidence = confidence
        self.steps = 0  # forward passes this round, one of them wasted after an early stop
        self.reset()
        self.recurrent = caches.is_recurrent(self.cache)

    def reset(self) -> None:
        self.cache = caches.make_cache(self.model, "draft")
        self.snapshots: list = []  # recurrent state after each step of this round's proposal
        self.cached: list[int] = []  # tokens in the cache
        self.unfed: list[int] = []
        self.ran = False  # whether the model ran this round
        self.fed = 0  # draft tokens of this round's proposal the cache has seen

    def fork(self) -> ModelDrafter:
        twin = copy.copy(self)  # the model and settings shared; ran, fed, steps are ints
        twin.cache = caches.copy(self.cache)
        twin.snapshots = [caches.copy_snapshot(s) for s in self.snapshots]
        twin.cached, twin.unfed = list(self.cached), list(self.unfed)
        return twin

    def prefill(self, tokens, timed=False, output=None):
        reuse = min(common_prefix_len(self.cached, tokens), len(tokens) - 1)
        if caches.can_rollback(self.cache, len(self.cached) - reuse):
            caches.rollback(self.cache, len(self.cached) - reuse)
        else:  # e.g. a recurrent state cannot forget: start over
            self.cache, reuse = caches.make_cache(self.model, "draft"), 0
        seconds = prefill_cache(self.model, self.cache, tokens[reuse:-1], timed=timed)
        self.cached = list(tokens[:-1])
        self.unfed = [tokens[-1]]
        self.ran, self.fed = False, 0
        return seconds

    def held_cache(self) -> tuple[list, list[int]]:
        return self.cache, self.cached

    def adopt(self, cache: list, cached: list[int], unfed: list[int]) -> None:
        self.reset()
        self.cache, self.cached, self.unfed = cache, list(cached), list(unfed)

    def catch_up(self) -> None:
        """Take in the tokens emitted since the model last ran (all but the last, which the
        next proposal feeds) in one batched, evaluated pass."""
        if len(self.unfed) > 1:
            prefill_cache(self.model, self.cache, self.unfed[:-1])
            self.cached += self.unfed[:-1]
            self.unfed = self.unfed[-1:]

    def propose(self, k, params, key, *, processors=()):
        self.ran, self.fed, self.steps, self.snapshots = k > 0, 0, 0, []
        if k == 0:
            return mx.zeros((0,), mx.uint32), None
        stop_below = self.confidence
        keys = None if params.greedy else mx.random.split(key, k)
        y = mx.array(self.unfed)
        tokens, qs, top = [], [], []
        context = self.cached + self.unfed if processors else None
        for i in range(k):
            logits = self.model(y[None], cache=self.cache)[0, -1]  # (vocab,)
            if self.vocab is not None and logits.shape[-1] > self.vocab:
                logits = logits[: self.vocab]  # padding rows the target cannot embed
            if processors:  # after context + x1..xi, as the target's row i
                so_far = mx.concatenate(tokens) if tokens else []
                logits = apply_processors(processors, context, so_far, logits)
            if self.recurrent:  # the state after unfed + x1..xi: commit may return to it
                self.snapshots.append(caches.snapshot(self.cache))
            self.steps += 1
            self.fed += i > 0  # y is x_i, a draft token (before that: the unfed tokens)
            y, q = draw(logits, params, None if keys is None else keys[i])
            if q is not None:
                confidence = q.max()
            else:
                confidence = mx.softmax(logits.astype(mx.float32)).max() if stop_below else y
            mx.async_eval(y, confidence)  # the device starts while Python builds the next step
            # Confidence stop: read the previous token's top probability only now, with this
            # step already queued, so the device never waits on the host. Stopping wastes
            # this one step (x_i is in the cache either way: commit keeps it if accepted).
            if stop_below > 0 and i > 0 and top[-1].item() < stop_below:
                break
            tokens.append(y)
            top.append(confidence)
            if q is not None:
                qs.append(q)
        return mx.concatenate(tokens), (mx.stack(qs) if qs else None)

    def settle(self) -> None:
        caches.eval_state(self.cache)

    def cache_bytes(self) -> int:
        return caches.nbytes(self.cache)

    def commit(self, kept, output=None):
        if not self.ran:  # nothing drafted (k = 0, or another drafter proposed)
            self.unfed = self.unfed + kept
            return
        # the cache saw unfed + the first `fed` draft tokens; the accepted ones are kept[:-1]
        valid = min(len(kept) - 1, self.fed)
        if self.recurrent:  # step `valid` fed x_valid (step 0: the unfed tokens)
            caches.restore(self.cache, self.snapshots[valid])
        caches.rollback(self.cache, self.fed - valid, skip_recurrent=True)
        self.snapshots = []
        self.cached += self.unfed + kept[:valid]
        self.unfed = kept[valid:]
        self.ran, self.fed = False, 0
