"""A bounded n-gram index over earlier requests and replies, for prompt lookup across requests.

An agent resends the files and tool outputs it has seen and rewrites code it was shown turns
ago, possibly in a fresh context. `NGramDrafter` looks up only its own context; given a
`HistoryIndex` it also drafts from what this process saw before.

The index keeps at most `max_tokens` tokens: past that, the older half is dropped and the rest
re-indexed (amortised O(1) per token).
"""

from __future__ import annotations

from mlx_lm.utils import common_prefix_len

from ..drafters.ngram import NGramIndex
from ..errors import SpecError

# n-grams shorter than 2 tokens match almost anywhere in a long history: mostly wasted drafts
HISTORY_NGRAM_MIN = 2
HISTORY_NGRAM_MAX = 4
HISTORY_TOKENS = 100_000  # ~5 dict entries per token: some 50 MB of Python objects


class HistoryIndex(NGramIndex):
    def __init__(
        self,
        max_tokens: int = HISTORY_TOKENS,
        ngram_min: int = HISTORY_NGRAM_MIN,
        ngram_max: int = HISTORY_NGRAM_MAX,
    ):
        super().__init__(ngram_min, ngram_max)
        if max_tokens < 1:
            raise SpecError(f"the history must hold at least one token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.last: list[int] = []  # the last document added (a follow-up repeats most of it)

    def add(self, document: list[int]) -> None:
        """Index a request's tokens and its reply. A document that extends the previous one
        (the same conversation, one turn later) adds only its new tokens."""
        shared = common_prefix_len(self.last, document)
        self.last = list(document)
        new = document[shared:]
        if not new:
            return
        if len(self.tokens) + len(new) > self.max_tokens:
            # drop the older half (or more, for a huge document) and index again
            kept = (self.tokens + new)[-(self.max_tokens // 2 or 1) :]
            self.reset()
            new = kept
        self.extend(new)
