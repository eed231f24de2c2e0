"""Prompt lookup: find the last few tokens earlier in the context (prompt or output) and
propose the tokens that followed them. No model, almost no cost."""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from ..errors import SpecError
from .base import Drafter


class NGramIndex:
    """Every n-gram (ngram_min <= n <= ngram_max) of `tokens` -> the position right after its
    latest occurrence, updated as tokens are added, so a look-up costs a handful of dictionary
    operations whatever the length. Keys are the hashes of n-gram tuples: a collision only
    makes a wrong guess, which the target rejects (drafting stays lossless whatever it
    proposes)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise SpecError(f"need 1 <= ngram-min <= ngram-max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.reset()

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.index: dict[int, int] = {}

    def copy(self) -> NGramIndex:
        twin = NGramIndex(self.ngram_min, self.ngram_max)
        twin.tokens, twin.index = list(self.tokens), dict(self.index)
        return twin

    def extend(self, new: list[int]) -> None:
        start = len(self.tokens)
        self.tokens += new
        self._index_from(start)

    def _index_from(self, start: int) -> None:
        """Index the n-grams that end just before each position >= start."""
        tokens, index = self.tokens, self.index
        for i in range(max(start, 1), len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                index[hash(tuple(tokens[i - n : i]))] = i

    def after(self, ngram: list[int], k: int) -> list[int]:
        """Up to k tokens that followed `ngram` at its latest occurrence ([] if never seen, or
        if its length is outside [ngram_min, ngram_max])."""
        if not self.ngram_min <= len(ngram) <= self.ngram_max:
            return []
        start = self.index.get(hash(tuple(ngram)))
        return [] if start is None else self.tokens[start : start + k]


class NGramDrafter(Drafter):
    """Looks the context's last n-gram up in the context itself (longest first), then, given
    a `HistoryIndex` (history.py), in what this process saw before: at each length the context
    first, so a longer match in the history beats a shorter one here. Its q is a point mass on
    the guess."""

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, history=None):
        self.context = NGramIndex(ngram_min, ngram_max)
        self.history = history

    @property
    def tokens(self) -> list[int]:
        return self.context.tokens

    def use_history(self, history) -> None:
        self.history = history

    def reset(self) -> None:
        self.context.reset()

    def fork(self) -> NGramDrafter:
        twin = copy.copy(self)  # the history index shared (other requests' tokens, read-only)
        twin.context = self.context.copy()
        return twin

    def prefill(self, tokens, timed=False, output=None):
        reuse = common_prefix_len(self.context.tokens, tokens)
        if reuse < len(self.context):  # a different history: entries may point past its end
            self.context.reset()
            reuse = 0
        self.context.extend(list(tokens[reuse:]))
        return 0.0  # drafting costs a dictionary look-up

    def lookup(self, k: int) -> list[int]:
        tokens, history = self.context.tokens, self.history
        longest = max(self.context.ngram_max, history.ngram_max if history is not None else 0)
        for n in range(min(longest, len(tokens)), 0, -1):
            ngram = tokens[-n:]
            guess = self.context.after(ngram, k)
            if not guess and history is not None:
                guess = history.after(ngram, k)
            if guess:
                return guess
        return []

    def has_proposal(self) -> bool:
        return bool(self.lookup(1))

    def propose(self, k, params, key, *, processors=()):
        # the guess is not masked: a token a processor forbids gets probability 0 from the
        # target's row, so verification rejects it
        return mx.array(self.lookup(k), mx.uint32), None  # None: a point mass on the guess

    def commit(self, kept, output=None):
        self.context.extend(kept)
