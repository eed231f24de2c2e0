"""An EAGLE-3 head drafting for a batch's rows (batch.py), each row as it drafts alone.

A single stream's `EagleDrafter` keeps, between rounds, the head's KV cache of entries
0..c-1 (entry j pairs the target's fused features at position j with token j+1), the fused
features of positions c..H-1 not yet made entries (`pending`) and the head's output at its
last entry (`last`), from which the next token is predicted. `BatchHead` keeps the same per
row, the head's cache batched as the target's is (mlx-lm's left-padded `BatchKVCache`):

- a row joins prefilled alone by an `EagleDrafter` (the single stream's prefill, fed the
  features the target's prefill captured; from a kept decoder's drafter, what still holds of
  it), its head cache merged in; it then holds entries for all but its last token;
- a drafting round first makes entries of every row's pending features in one head pass over
  the rows (right-padded to the longest, each row then rolled back by its padding: causal
  attention keeps a row's real entries from seeing it), then drafts k tokens in k head steps
  for all rows: step 1 from each row's `last`, step j > 1 chained from the head's own output,
  fed the token just drafted (those k - 1 entries are the same count in every row, and are
  forgotten after the verify pass, `forget`);
- the verify pass captures the three target layers the head reads over (B, K+1) and each
  row's kept positions (its last token and accepted drafts) become its pending features
  (`take`); a plain round (k = 0) adds one per row, made entries at the next drafting round
  or once PENDING_MAX have piled up.

Rows that do not draft are fed all the same (their features come with the pass for free), so
every row's head holds its own context. A row that leaves hands its head back (`extract`: an
EagleDrafter holding what a single stream's would), which the decoder it continues in adopts.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ..core import caches
from ..drafters.base import TargetOutput
from ..drafters.eagle import EagleDrafter
from ..errors import SpecError

PENDING_MAX = 16  # features a row piles up in plain rounds before a head pass takes them in


class BatchHead:
    """The head's batched cache and each row's pending features and last output."""

    def __init__(self, head):
        self.head = head
        self.hidden_layers = tuple(head.layers_read)
        self.cache: list | None = None  # one BatchKVCache per head layer
        self.pending: list = []  # per row: (m, H) fused features without entries, or None
        self.last: list = []  # per row: (H,) the head's output at its last entry, or None

    def prefill(self, prompt: list[int], hidden: dict, fed: int, kept=None, timed=False):
        """A joining row's head, prefilled alone as a single stream's: `hidden` the target's
        captured layers over the prompt's last `fed` positions but its last token; `kept`: a
        kept decoder's EagleDrafter (what of it still holds is kept, the positions whose
        features are gone are zeros: the head drafts worse there, never wrongly). Returns
        the drafter and, `timed`, one head step's seconds (None when it cannot draft yet)."""
        drafter = kept if kept is not None else EagleDrafter(self.head)
        output = TargetOutput(None, hidden, fed, fed) if fed else None
        seconds = drafter.prefill(prompt, timed, output)
        if drafter.cache[0].offset != len(prompt) - 1 or drafter.pending is not None:
            raise SpecError(
                f"the head holds {drafter.cache[0].offset} entries, not {len(prompt) - 1}"
            )
        return drafter, (seconds if timed and drafter.last is not None else None)

    def join(self, drafter: EagleDrafter) -> None:
        merged = [BatchKVCache.merge([c]) for c in drafter.cache]
        if self.cache is None:
            self.cache = merged
        else:
            for c, m in zip(self.cache, merged, strict=True):
                c.extend(m)
        self.pending.append(None)
        self.last.append(drafter.last)

    def keep(self, keep: list[int]) -> None:
        """Only these rows (indices) stay."""
        self.pending = [self.pending[i] for i in keep]
        self.last = [self.last[i] for i in keep]
        if not keep:
            self.cache = None
            return
        index = mx.array(keep)
        for c in self.cache:
            c.filter(index)

    def can_draft(self, b: int) -> bool:
        """Whether row b has an entry to draft from (a one-token prompt: not before its first
        pass gave the features of its token)."""
        return self.last[b] is not None or self.pending[b] is not None

    def feed(self, sequences: list[list[int]]) -> None:
        """Make entries of every row's pending features: one head pass over the rows."""
        counts = [p.shape[0] if p is not None else 0 for p in self.pending]
        width = max(counts, default=0)
        if width == 0:
            return
        some = next(p for p in self.pending if p is not None)
        rows, tokens = [], []
        for p, m, seq in zip(self.pending, counts, sequences, strict=True):
            held = len(seq) - 1 - m  # entries the row holds: features m more, tokens after
            tokens.append(seq[held + 1 : held + 1 + m] + [0] * (width - m))
            pad = mx.zeros((width - m, some.shape[-1]), some.dtype)
            rows.append(pad if p is None else mx.concatenate([p, pad]) if m < width else p)
        out = self.head.rows(mx.stack(rows), mx.array(tokens, mx.uint32), self.cache)
        for b, m in enumerate(counts):
            if m:
                self.last[b] = out[b, m - 1]
        caches.rollback_rows(self.cache, [width - m for m in counts])
        self.pending = [None] * len(counts)

    def first(self) -> mx.array:
        """Each row's last output (B, H), zeros for a row that cannot draft yet (its guesses
        are never used; a round may draft for others, or take a grammar's forced tokens)."""
        zeros = mx.zeros((self.head.hidden_size,), self.head.fc.weight.dtype)
        return mx.stack([g if g is not None else zeros for g in self.last])

    def chain(self, g: mx.array, picks: mx.array) -> mx.array:
        """A chained step for all rows: the head's output stands in for the features of the
        token it just drafted (`picks`, (B,)); one entry more in every row."""
        return self.head.rows(g[:, None], picks[:, None].astype(mx.uint32), self.cache)[:, 0]

    def logits(self, g: mx.array) -> mx.array:
        return self.head.rows_logits(g)

    def forget(self, chained: int) -> None:
        """Drop a round's chained entries (as many in every row)."""
        if chained:
            for c in self.cache:
                c.trim(chained)

    def take(self, hidden: dict, kept: list[int], sequences: list[list[int]]) -> None:
        """The verify pass's captured layers (layer -> (B, K+1, hidden)): row b's first
        `kept[b]` positions are now in its sequence; their features become pending."""
        fused = self.head.fuse(hidden)  # (B, K+1, H)
        for b, n in enumerate(kept):
            if n:
                f = fused[b, :n]
                p = self.pending[b]
                self.pending[b] = f if p is None else mx.concatenate([p, f])
        if max((p.shape[0] for p in self.pending if p is not None), default=0) > PENDING_MAX:
            self.feed(sequences)

    def extract(self, b: int, sequence: list[int]) -> EagleDrafter:
        """Row b's head as a single stream's EagleDrafter over `sequence` (the row's): its
        entries (the cache's row, left padding dropped), its pending features and last
        output, so the decoder it continues in needs no target pass to feed the head again
        (without it, the next turn of a conversation served in a batch prefilled its whole
        prompt: the head's features were gone)."""
        drafter = EagleDrafter(self.head)
        drafter.cache = [c.extract(b) for c in self.cache]
        drafter.entries = drafter.cache[0].offset
        pending = self.pending[b]
        drafter.pending, drafter.last = pending, self.last[b]
        drafter.rows = drafter.entries + (pending.shape[0] if pending is not None else 0)
        drafter.tokens = list(sequence)
        if drafter.rows != len(sequence) - 1:
            raise SpecError(
                f"the head's row holds features of {drafter.rows} positions, not "
                f"{len(sequence) - 1}"
            )
        return drafter

    def arrays(self) -> list:
        """What is kept between rounds (for the batch's settle)."""
        out = [c.state for c in self.cache or []]
        return out + [a for a in self.pending + self.last if a is not None]
