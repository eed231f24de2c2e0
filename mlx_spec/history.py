"""A bounded n-gram index over earlier requests and replies, for prompt lookup across requests.

An agent resends the files and tool outputs it has seen and rewrites code it was shown turns
ago, possibly in a fresh context. `NGramDrafter` looks up only its own context; given a
`HistoryIndex` it also drafts from what this process saw before.

The index keeps at most `max_tokens` tokens: past that, the older half is dropped and the rest
re-indexed (amortised O(1) per token). Keys are the hashes of n-gram tuples: a collision only
makes a wrong guess, which the target rejects (drafting stays lossless whatever it proposes).
"""

from __future__ import annotations

from mlx_lm.utils import common_prefix_len

from .errors import SpecError

# n-grams shorter than 2 tokens match almost anywhere in a long history: mostly wasted drafts
HISTORY_NGRAM_MIN = 2
HISTORY_NGRAM_MAX = 4
HISTORY_TOKENS = 100_000  # ~5 dict entries per token: some 50 MB of Python objects


class HistoryIndex:
    def __init__(
        self,
        max_tokens: int = HISTORY_TOKENS,
        ngram_min: int = HISTORY_NGRAM_MIN,
        ngram_max: int = HISTORY_NGRAM_MAX,
    ):
        if not 1 <= ngram_min <= ngram_max:
            raise SpecError(f"need 1 <= ngram-min <= ngram-max, got {ngram_min} and {ngram_max}")
        if max_tokens < 1:
            raise SpecError(f"the history must hold at least one token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.index: dict[int, int] = {}  # hash of an n-gram -> position after its latest end
        self.last: list[int] = []  # the last document added (a follow-up repeats most of it)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, document: list[int]) -> None:
        """Index a request's tokens and its reply. A document that extends the previous one
        (the same conversation, one turn later) adds only its new tokens."""
        shared = common_prefix_len(self.last, document)
        self.last = list(document)
        new = document[shared:]
        if not new:
            return
        start = len(self.tokens)
        self.tokens += new
        if len(self.tokens) > self.max_tokens:
            # drop the older half (or more, for a huge document) and index again
            self.tokens = self.tokens[-(self.max_tokens // 2 or 1) :]
            self.index, start = {}, 0
        self._index_from(start)

    def _index_from(self, start: int) -> None:
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

    def follow(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `context` the index holds."""
        for n in range(min(self.ngram_max, len(context)), self.ngram_min - 1, -1):
            guess = self.after(context[-n:], k)
            if guess:
                return guess
        return []
