"""Prompt lookup first; the draft model only in rounds where lookup finds nothing."""

from __future__ import annotations

import copy

import mlx.core as mx

from .base import Drafter
from .model import ModelDrafter
from .ngram import NGramDrafter


class LookupThenModel(Drafter):
    """Rounds drafted by lookup skip the draft model; it catches up on their tokens (one
    batched forward pass) the next time it drafts."""

    def __init__(self, lookup: NGramDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model

    def use_history(self, history) -> None:
        self.lookup.use_history(history)

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    def fork(self) -> LookupThenModel:
        twin = copy.copy(self)  # steps: an int
        twin.lookup, twin.model = self.lookup.fork(), self.model.fork()
        return twin

    def prefill(self, tokens, timed=False, output=None):
        self.lookup.prefill(tokens)
        return self.model.prefill(tokens, timed)  # the model's step: lookup's is free

    def catch_up(self) -> None:
        self.model.catch_up()

    def held_cache(self) -> tuple[list, list[int]]:
        return self.model.held_cache()  # (lookup rebuilds its index from the next prompt)

    def adopt(self, cache: list, cached: list[int], unfed: list[int]) -> None:
        self.lookup.reset()
        self.model.adopt(cache, cached, unfed)

    def propose(self, k, params, key, *, processors=()):
        guess = self.lookup.lookup(k)
        if guess:
            self.steps = 0
            return mx.array(guess, mx.uint32), None  # a point mass on each guess
        proposal = self.model.propose(k, params, key, processors=processors)
        self.steps = self.model.steps
        return proposal

    def settle(self) -> None:
        self.model.settle()

    def cache_bytes(self) -> int:
        return self.model.cache_bytes()

    def commit(self, kept, output=None):
        self.lookup.commit(kept)
        self.model.commit(kept)
