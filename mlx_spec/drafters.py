"""Drafters propose tokens for the target to verify.

A drafter keeps its own view of the sequence. The engine calls `prefill` with the prompt,
then each round `propose(k)` and, after verification, `commit(kept, k)` with the tokens the
round emitted (the accepted draft tokens followed by the target's own token).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import common_prefix_len

from .errors import SpecError
from .sampling import SamplingParams, probabilities, sample


class Drafter(Protocol):
    def prefill(self, tokens: list[int]) -> None:
        """Start a new sequence (or continue a cached one) from these tokens."""

    def propose(
        self, k: int, params: SamplingParams, key: mx.array
    ) -> tuple[mx.array, mx.array | None]:
        """k draft tokens (k,) and, unless greedy, their distributions q (k, vocab). Lazy."""

    def commit(self, kept: list[int], k: int) -> None:
        """The round emitted `kept`: the first len(kept)-1 drafted tokens, then one more."""


def prefill_cache(model, cache: list, tokens: list[int], step: int = 2048) -> None:
    """Run `tokens` through `model`, filling `cache`, in chunks that bound peak memory."""
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def check_trimmable(cache: list, role: str) -> None:
    if not can_trim_prompt_cache(cache):
        kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
        raise SpecError(
            f"the {role} model's KV cache ({', '.join(kinds)}) cannot be rolled back, "
            "so it cannot be used for speculative decoding"
        )


class ModelDrafter:
    """A small language model from the target's family, with its own KV cache.

    Invariant between rounds: the cache holds every token of the sequence except `pending`
    (one token; two after a round where every draft token was accepted, since the draft never
    ran on its own last proposal; one more for each round that drafted nothing).
    """

    def __init__(self, model):
        self.model = model
        self.cache = make_prompt_cache(model)
        check_trimmable(self.cache, "draft")
        self.cached: list[int] = []  # tokens in the cache
        self.pending: list[int] = []

    def prefill(self, tokens: list[int]) -> None:
        reuse = min(common_prefix_len(self.cached, tokens), len(tokens) - 1)
        trim_prompt_cache(self.cache, len(self.cached) - reuse)
        prefill_cache(self.model, self.cache, tokens[reuse:-1])
        self.cached = list(tokens[:-1])
        self.pending = [tokens[-1]]

    def propose(self, k, params, key):
        if k == 0:
            return mx.zeros((0,), mx.uint32), None
        keys = mx.random.split(key, k)
        y = mx.array(self.pending)
        tokens, qs = [], []
        for i in range(k):
            logits = self.model(y[None], cache=self.cache)[0, -1]  # (vocab,)
            if params.greedy:
                y = mx.argmax(logits, axis=-1, keepdims=True)
            else:
                q = probabilities(logits, params)
                y = sample(q, keys[i])[None]
                qs.append(q)
            mx.async_eval(y)  # let the device start while Python builds the next step
            tokens.append(y)
        return mx.concatenate(tokens), (mx.stack(qs) if qs else None)

    def commit(self, kept, k):
        if k == 0:
            self.pending = self.pending + kept
            return
        # the draft ran on pending + x1..x(k-1); the accepted draft tokens are kept[:-1]
        fed_drafts = k - 1
        valid = min(len(kept) - 1, fed_drafts)
        trim_prompt_cache(self.cache, fed_drafts - valid)
        self.cached += self.pending + kept[:valid]
        self.pending = kept[valid:]


class NGramDrafter:
    """Prompt lookup: find the last few tokens earlier in the context (prompt or output) and
    propose the tokens that followed them. No model, almost no cost.

    The index maps every n-gram (ngram_min <= n <= ngram_max) to the position right after its
    latest occurrence; it is updated with each emitted token, so a round costs a handful of
    dictionary operations whatever the context length. Its q is a point mass on the guess.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise SpecError(f"need 1 <= ngram-min <= ngram-max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}

    def _index_from(self, start: int) -> None:
        """Index the n-grams that end just before each position >= start."""
        for i in range(max(start, 1), len(self.tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                self.index[tuple(self.tokens[i - n : i])] = i

    def prefill(self, tokens: list[int]) -> None:
        reuse = common_prefix_len(self.tokens, tokens)
        if reuse < len(self.tokens):  # a different history: entries may point past its end
            self.index, reuse = {}, 0
        self.tokens = list(tokens)
        self._index_from(reuse)

    def lookup(self, k: int) -> list[int]:
        for n in range(min(self.ngram_max, len(self.tokens)), self.ngram_min - 1, -1):
            start = self.index.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start : start + k]
        return []

    def propose(self, k, params, key):
        return mx.array(self.lookup(k), mx.uint32), None  # None: a point mass on the guess

    def commit(self, kept, k):
        start = len(self.tokens)
        self.tokens += kept
        self._index_from(start)


class FixedK:
    """The same draft length every round."""

    def __init__(self, k: int):
        self.k = self.k_max = k

    def next(self) -> int:
        return self.k

    def update(self, verified: int, drafted: int) -> None:
        pass


class AdaptiveK:
    """Draft length from what the last rounds showed, within [1, k_max].

    All k accepted: the draft is on a predictable stretch, draft 2 more next time. A
    rejection: one fewer, so a poor stretch stops paying for long drafts quickly. (The schedule
    of Hugging Face's assisted generation; it uses only the past, so it cannot bias the output.)
    """

    def __init__(self, k_max: int = 8, start: int = 4):
        self.k_max = k_max
        self.k = min(start, k_max)

    def next(self) -> int:
        return self.k

    def update(self, verified: int, drafted: int) -> None:
        if drafted == 0:  # prompt lookup found nothing: no evidence either way
            return
        self.k = min(self.k_max, self.k + 2) if verified == drafted else max(1, self.k - 1)
