"""Suffix decoding: the longest match of the sequence's recent tokens in the request so far
(prompt and reply) and in the key's earlier requests and replies, and the continuation most of
its occurrences agree on — a draft as long as the match supports, not capped at K_MAX.

`SuffixIndex` is a hash of n-grams of a few lengths (`lengths`) -> the positions right after
their latest `POSITIONS` occurrences (an int while there is one): memory linear in the tokens
held (at most `max_tokens`: past that the older half is dropped and the rest indexed again),
bounded under any input — a token repeated 100k times is one n-gram per length. A look-up
tries the longest length first, measures each occurrence's true match backwards (at most
`MATCH_MAX` tokens; a hash collision measures shorter and is dropped), then walks the
occurrences forward by majority vote, dropping those that disagree (the frequency-scored
continuation of SuffixDecoding, Oliaro et al. 2025, over a bounded set of occurrences).

`SuffixDrafter` drafts from it; beside another drafter (`suffix+model`, `suffix+eagle3`) that
one drafts where the match is short or absent. How long a lookup draft is, and whether it beats
the other drafter, the draft-length policy decides from its verify-cost curve
(core/lookup_length.py). The target verifies every guess: drafting stays lossless whatever the
index proposes.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ..errors import SpecError
from .base import Drafter

REQUEST_LENGTHS = (1, 2, 3, 4, 8, 16)  # n-gram lengths indexed over the request
# a 1-token match in a long history is mostly noise (history.py's HISTORY_NGRAM_MIN)
HISTORY_LENGTHS = (2, 3, 4, 8, 16)
POSITIONS = 8  # occurrences kept per n-gram: the latest ones
MATCH_MAX = 64  # a match is measured back at most this far
DRAFT_MAX = 64  # the longest lookup draft
SUPPORT = 4  # a match of n tokens supports a draft of SUPPORT * n
CONTEXT_TOKENS = 131_072  # a request's index holds at most this many of its latest tokens
HISTORY_TOKENS = 100_000  # as history.py's


class SuffixIndex:
    def __init__(self, max_tokens: int, lengths: tuple[int, ...] = REQUEST_LENGTHS):
        if max_tokens < 1:
            raise SpecError(f"a suffix index must hold at least one token, got {max_tokens}")
        if not lengths or min(lengths) < 1:
            raise SpecError(f"n-gram lengths must be >= 1, got {lengths}")
        self.max_tokens, self.lengths = max_tokens, tuple(sorted(set(lengths)))
        self.reset()

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.index: dict[int, int | list[int]] = {}
        self.dropped = 0  # tokens dropped from the front (the bound)

    def copy(self) -> SuffixIndex:
        twin = copy.copy(self)
        twin.tokens = list(self.tokens)
        twin.index = {h: v if type(v) is int else list(v) for h, v in self.index.items()}
        return twin

    def entries(self) -> int:
        """Positions held (memory is ~ tokens + entries, each a few dozen bytes)."""
        return sum(1 if type(v) is int else len(v) for v in self.index.values())

    def extend(self, new: list[int]) -> None:
        if len(self.tokens) + len(new) > self.max_tokens:
            kept = (self.tokens + list(new))[-(self.max_tokens // 2 or 1) :]
            dropped = self.dropped + len(self.tokens) + len(new) - len(kept)
            self.reset()
            self.dropped, new = dropped, kept
        start = len(self.tokens)
        self.tokens += new
        tokens, index, lengths = self.tokens, self.index, self.lengths
        for i in range(max(start, 1), len(tokens)):
            for n in lengths:
                if n > i:
                    break
                h = hash(tuple(tokens[i - n : i]))
                v = index.get(h)
                if v is None:
                    index[h] = i
                elif type(v) is int:
                    index[h] = [v, i]
                else:
                    v.append(i)
                    if len(v) > POSITIONS:
                        del v[0]

    def match(self, recent: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """(the longest match's length, [(its length, continuation start)] for each occurrence
        that matches at least the longest indexed length found); (0, []) without a match."""
        tokens = self.tokens
        for n in reversed(self.lengths):
            if n > len(recent):
                continue
            v = self.index.get(hash(tuple(recent[-n:])))
            if v is None:
                continue
            found = []
            for p in [v] if type(v) is int else v:
                if tokens[p - n : p] != recent[-n:]:
                    continue  # a hash collision
                m, most = n, min(MATCH_MAX, p, len(recent))
                while m < most and tokens[p - m - 1] == recent[-m - 1]:
                    m += 1
                found.append((m, p))
            if found:
                return max(m for m, _ in found), found
        return 0, []

    def continuation(self, found: list[tuple[int, int]], limit: int, wrap=False) -> list[int]:
        """Up to `limit` tokens: at each step the token most of the live occurrences continue
        with (ties: the longer match, then the later one); the others drop out. `wrap`: the
        query is this index's own end, so an occurrence that runs into it goes on with the
        draft itself (a repetition continues: the latest occurrences of a periodic stretch
        all lie near the end)."""
        tokens, out = self.tokens, []
        size = len(tokens)
        live = sorted(found, reverse=True)  # longest match first, then latest
        while live and len(out) < limit:
            t = len(out)
            votes: dict[int, int] = {}
            picks = []
            for m, p in live:
                i = p + t
                tok = tokens[i] if i < size else out[i - size] if wrap else None
                picks.append((m, p, tok))
                if tok is not None:
                    votes[tok] = votes.get(tok, 0) + 1
            if not votes:
                break
            best = max(votes.values())
            pick = next(tok for _, _, tok in picks if tok is not None and votes[tok] == best)
            out.append(pick)
            live = [(m, p) for m, p, tok in picks if tok == pick]
        return out


class SuffixHistory(SuffixIndex):
    """A key's earlier requests and replies (the server's --history-tokens), searched by its
    later requests: the role and the `add` of history.HistoryIndex."""

    def __init__(self, max_tokens: int = HISTORY_TOKENS, lengths=HISTORY_LENGTHS):
        super().__init__(max_tokens, lengths)
        self.last: list[int] = []

    def add(self, document: list[int]) -> None:
        """Index a request's tokens and reply; a document that extends the previous one (the
        same conversation, a turn later) adds only its new tokens."""
        shared = 0
        for a, b in zip(self.last, document, strict=False):
            if a != b:
                break
            shared += 1
        self.last = list(document)
        if document[shared:]:
            self.extend(document[shared:])


class SuffixDrafter(Drafter):
    """Lookup drafts from a `SuffixIndex` over the request and a `SuffixHistory` over the key;
    `inner` (another kind's drafter, or None) drafts the rounds the policy gives it.

    The engine asks `suffix_match()` each round: (the match's length, the longest draft it
    supports). When the policy takes a lookup draft (`lookup_length`), `propose_lookup` hands
    it; else `propose` is the inner drafter's (alone: the lookup's, up to k). Every round's
    tokens reach the inner drafter through `commit` (a head reads the target's features of
    the lookup tokens as of its own; a draft model catches up on them when it next drafts)."""

    def __init__(self, inner: Drafter | None = None, history=None, context_tokens=CONTEXT_TOKENS):
        self.inner = inner
        self.history = history
        self.context = SuffixIndex(context_tokens, REQUEST_LENGTHS)
        self._draft: tuple[int, int, list[int]] | None = None  # (at, match, tokens) cached
        self.hidden_layers = inner.hidden_layers if inner is not None else ()
        self.max_draft = inner.max_draft if inner is not None else None

    # ------------------------------------------------------------------------- the lookup

    @property
    def tokens(self) -> list[int]:
        return self.context.tokens

    def suffix_draft(self) -> tuple[int, list[int]]:
        """(the longest match's length, the draft it supports), cached until the next commit:
        the request first, then the key's history when it matches longer."""
        at = len(self.context) + self.context.dropped
        if self._draft is not None and self._draft[0] == at:
            return self._draft[1], self._draft[2]
        recent = self.context.tokens[-MATCH_MAX:]
        best, draft = 0, []
        for index in (self.context, self.history):
            if index is None:
                continue
            n, found = index.match(recent)
            if n > best:
                limit = min(DRAFT_MAX, SUPPORT * n)
                guess = index.continuation(found, limit, wrap=index is self.context)
                if guess:
                    best, draft = n, guess
        self._draft = (at, best, draft)
        return best, draft

    def suffix_match(self) -> tuple[int, int]:
        """(match length, the longest draft it supports); (0, 0) without one."""
        n, draft = self.suffix_draft()
        return n, len(draft)

    def lookup(self, k: int) -> list[int]:
        """Up to k lookup tokens (the batch's row lookup, ngram.NGramDrafter's name)."""
        return self.suffix_draft()[1][:k]

    def propose_lookup(self, k: int):
        self.steps = 0
        return mx.array(self.lookup(k), mx.uint32), None  # a point mass on each guess

    # ---------------------------------------------------------------- the Drafter protocol

    def use_history(self, history) -> None:
        self.history = history if isinstance(history, SuffixIndex) else None
        self._draft = None

    def reset(self) -> None:
        self.context.reset()
        self._draft = None
        if self.inner is not None:
            self.inner.reset()

    def fork(self) -> SuffixDrafter:
        twin = copy.copy(self)  # the history shared (read by both, added to by the server)
        twin.context = self.context.copy()
        twin.inner = self.inner.fork() if self.inner is not None else None
        return twin

    def prefill(self, tokens, timed=False, output=None):
        tokens = list(tokens)
        held = self.context.tokens
        if self.context.dropped or tokens[: len(held)] != held:
            self.context.reset()  # a different sequence (or one past the bound): start over
            held = []
        self.context.extend(tokens[len(held) :])
        self._draft = None
        if self.inner is None:
            return 0.0
        return self.inner.prefill(tokens, timed, output)

    def has_proposal(self) -> bool | None:
        if self.inner is not None:
            return self.inner.has_proposal()
        return bool(self.suffix_draft()[1])

    def propose(self, k, params, key, *, processors=()):
        if self.inner is None:
            return self.propose_lookup(k)
        kwargs = {"processors": processors} if processors else {}
        proposal = self.inner.propose(k, params, key, **kwargs)
        self.steps = self.inner.steps
        return proposal

    def commit(self, kept, output=None):
        self.context.extend(list(kept))
        if self.inner is not None:
            self.inner.commit(kept, output)

    def catch_up(self) -> None:
        if self.inner is not None:
            self.inner.catch_up()

    def settle(self) -> None:
        if self.inner is not None:
            self.inner.settle()

    def cache_bytes(self) -> int:
        return self.inner.cache_bytes() if self.inner is not None else 0

    def held_cache(self):
        return self.inner.held_cache() if self.inner is not None else None

    def adopt(self, cache, cached, unfed) -> None:
        if self.inner is None:
            super().adopt(cache, cached, unfed)
        self.context.reset()  # rebuilt from the next prompt
        self._draft = None
        self.inner.adopt(cache, cached, unfed)

    def adopt_inner(self, inner: Drafter) -> SuffixDrafter:
        """A head's drafter from a batch row (its state over the row's sequence) as the inner
        one; the request's index is rebuilt from the next prompt. Returns itself."""
        self.inner = inner
        self.context.reset()
        self._draft = None
        return self

    def disk_state(self):
        return self.inner.disk_state() if self.inner is not None else None

    def restore_disk_state(self, layers, figures, target) -> None:
        if self.inner is None:
            super().restore_disk_state(layers, figures, target)
        self.inner.restore_disk_state(layers, figures, target)
