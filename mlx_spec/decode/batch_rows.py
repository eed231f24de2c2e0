"""A batch's rows: what each request holds between rounds (`Row`), what a round tells it
(`RowUpdate`) and the caches it brings in and takes away.

Kept caches (the server's prompt cache): a row may start from a kept single-stream
`engine.Decoder` whose sequence shares a prefix with its prompt (`BatchDecoder.add(...,
kept=decoder)`): the decoder's target and draft caches are trimmed to that prefix
(`kept_caches`) and only the rest is prefilled. A row added with `keep=True` hands its caches
back when it leaves (`RowState`: `RowUpdate.state`, or `remove`'s result), extracted from the
batch (mlx-lm's `BatchKVCache.extract`, which drops the row's left padding), and
`into_decoder` turns them into a decoder a single stream or a later row continues from. Every
length is checked against the batch's invariants (`BatchDecoder`); a cache that does not hold
what they say raises SpecError. Which classes a kept cache may be made of, and what length
each reports, is core/batch_caches.py's (`keepable`, `held`).

A recurrent target's pass has no padding, which would enter a row's state: `fill` gives every
row one width of real tokens (`filled_q` the matching draft probabilities; batch_draft.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from ..core import batch_caches, caches
from ..core.policies import Fixed, draft_length
from ..core.sampling import SamplingParams
from ..drafters.ngram import NGramDrafter
from ..drafters.suffix import SuffixDrafter
from ..errors import SpecError
from .rounds import Round, pad_vocab, point_mass


@dataclass
class Row:
    """One request in the batch."""

    id: int
    sequence: list[int]  # prompt + emitted tokens (+ the end-of-sequence token, if one ended it)
    params: SamplingParams
    max_tokens: int
    key: mx.array | None  # None: greedy rows draw nothing
    use_draft: bool = True
    lookup: NGramDrafter | SuffixDrafter | None = None
    emitted: int = 0
    prompt_tokens: int = 0
    reused: int = 0  # prompt tokens a kept decoder's caches held
    keep: bool = False  # hand the caches back when the row leaves
    k_max: int | None = None  # the row's own num_draft_tokens: its k is at most this
    # its logits processors (a grammar's mask first), applied to its rows of each pass as a
    # single stream applies them; log-probabilities asked for (None: off; N: with top N)
    processors: list = field(default_factory=list)
    logprobs: int | None = None
    grammar: object | None = None  # its GrammarProcessor when it drafts forced tokens
    # a recurrent target: the tokens at the end of `sequence` its caches have not taken in
    # (1, or 1 + a replay after a rejected round: engine.Decoder.unfed)
    unfed: int = 1
    # a seeded sampled row on a recurrent target draws what it draws alone: its fillers are
    # never kept (so its key splits as alone), and its replay limit counts what alone replays
    seeded: bool = False
    alone_unfed: int = 1

    def replay(self) -> int:
        """The replay the row's REPLAY_LIMIT is judged by (a single stream's, when seeded)."""
        return self.alone_unfed if self.seeded else self.unfed

    def next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def row_k_max(length) -> int | None:
    """A row's own num_draft_tokens as a cap on the batch's k: Fixed(k) -> k, Auto(k_max) ->
    k_max, None (the pair's) -> no cap. A fixed-k batch with a smaller row drafts that row's k
    every round, as `generate` alone with that k does."""
    if length is None:
        return None
    length = draft_length(length)
    return length.k if isinstance(length, Fixed) else length.k_max


def draft_tail(row: Row, lag: int) -> list[int]:
    """The last `lag` tokens of the row's context as its draft row holds them: a one-token
    prompt's token twice (see `add`). A row that does not draft may be shorter than the lag
    (the draft fed its row nothing): it is padded alike, its draft row is never read."""
    tail = row.sequence[-lag:]
    return [row.sequence[0]] * (lag - len(tail)) + tail


@dataclass
class RowState:
    """A row's caches as it leaves, as a single stream keeps them (see `into_decoder`)."""

    sequence: list[int]
    cache: list  # one KVCache per target layer, holding sequence[:-1]
    draft_cache: list | None  # one per draft layer, holding draft_tokens (None: no draft's)
    draft_tokens: list[int] = field(default_factory=list)
    head: object | None = None  # the head's drafter over sequence (None: no head)
    # a recurrent target's row: the target cache holds sequence[:-unfed] (the decoder
    # replays the rest, engine.Decoder.unfed)
    unfed: int = 1


@dataclass
class RowUpdate:
    """What one `step` did for one row."""

    tokens: list[int]  # emitted this round (an end-of-sequence token is not one)
    round: Round
    done: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" when done
    state: RowState | None = None  # a leaving row added with keep=True: its caches
    error: Exception | None = None  # "error": why its grammar (or a processor) failed


def check_held(cache: list, tokens: int, what: str) -> None:
    """Every layer holds `tokens` entries (a sliding-window layer: has taken them in, its
    oldest maybe dropped; a recurrent state has no length to check), or SpecError (a cache
    that is not what it says)."""
    sizes = {n for c in caches._leaves(cache) if (n := batch_caches.held(c)) is not None}
    if sizes and sizes != {tokens}:
        raise SpecError(f"the {what} cache holds {sorted(sizes)} tokens, not {tokens}")


def check_plain(cache: list, what: str, recurrent: bool = False) -> None:
    if not batch_caches.keepable(cache, recurrent):
        raise SpecError(f"the kept {what} cache is not made of plain or windowed KV caches")


def kept_caches(kept, prompt: list[int], draft_held: list[int] | None):
    """Take a kept `engine.Decoder`'s caches for `prompt`: (target cache, reused tokens,
    draft cache, draft reused), each trimmed to its shared prefix with what the row's cache
    must hold (target: prompt[:-1]; draft: `draft_held`, the row's context but the batch's last
    `lag` tokens; None: the row does not draft, the draft's cache is not taken). The decoder
    is left empty (`Decoder.give_up`); one that may be mid-round gives nothing."""
    given = kept.give_up(prompt)
    if given is None:
        return None, 0, None, 0
    cache, held, draft = given
    check_plain(cache, "target", recurrent=True)  # (a recurrent state: `prompt` extends it)
    check_held(cache, len(held), "kept target")
    reuse = min(common_prefix_len(held, prompt), len(prompt) - 1)
    if not caches.can_rollback(cache, len(held) - reuse):
        return None, 0, None, 0  # a window cannot forget that much: the row starts afresh
    caches.rollback(cache, len(held) - reuse)
    check_held(cache, reuse, "kept target")
    if draft_held is None or draft is None:
        return cache, reuse, None, 0
    draft_cache, cached = draft
    check_plain(draft_cache, "draft", recurrent=True)  # (a recurrent one: draft_held extends it)
    check_held(draft_cache, len(cached), "kept draft")
    draft_reuse = common_prefix_len(cached, draft_held)
    if not caches.can_rollback(draft_cache, len(cached) - draft_reuse):
        return cache, reuse, None, 0  # the draft's window cannot: its row starts afresh
    caches.rollback(draft_cache, len(cached) - draft_reuse)
    return cache, reuse, draft_cache, draft_reuse


def into_decoder(decoder, state: RowState):
    """A leaving row's caches into `decoder` (an `engine.Decoder` of the same pair), checked:
    it then holds the row's sequence as if a single stream had generated it (target cache:
    all but the last token; a draft model's: `state.draft_tokens`, the rest unfed; an
    EAGLE-3, MTP or DFlash head's: its entries and pending features; prompt lookup rebuilds
    its index from the next prompt). A recurrent target's row may hold less: all but its last
    `state.unfed` tokens, which the decoder replays. Returns the decoder."""
    check_held(state.cache, len(state.sequence) - state.unfed, "row's target")
    draft = None
    if state.draft_cache is not None:
        check_held(state.draft_cache, len(state.draft_tokens), "row's draft")
        draft = (state.draft_cache, state.draft_tokens)
    decoder = decoder.adopt(state.sequence, state.cache, draft, state.head)
    decoder.unfed = state.unfed
    return decoder


def fill(rows: list[Row], guesses: list[list[int]], spare=None) -> list[list[int]]:
    """A recurrent target's pass: every row `width` real tokens (no padding, which would enter
    its state): its unfed tokens, its guesses, then fillers up to the widest row (a point-mass
    guess like any other, accepted only where the target agrees, so the output is the
    target's whatever they are): `spare[b]` first (the draft's own picks past the row's
    proposal), then its last token repeated. Each row's guesses and fillers."""
    width = max(r.unfed + len(g) for r, g in zip(rows, guesses, strict=True))
    passes = []
    for b, (r, g) in enumerate(zip(rows, guesses, strict=True)):
        x = g + (spare[b] if spare is not None else [])[: width - r.unfed - len(g)]
        passes.append(x + [(x or r.sequence)[-1]] * (width - r.unfed - len(x)))
    return passes


def filled_q(q: mx.array, x: list[int], k: int) -> mx.array:
    """A draft row's q over its k proposed tokens, then a point mass on each filler of `x`."""
    fillers = mx.array(x[k:], mx.uint32)
    width = max(q.shape[-1], max(x[k:], default=0) + 1)
    return mx.concatenate([pad_vocab(q[:k], width), point_mass(fillers, width)])
