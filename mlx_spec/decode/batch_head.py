"""A head drafting for a batch's rows (batch.py), each row as it drafts alone: an EAGLE-3 head,
the target's own MTP layer or a DFlash head, one bookkeeping for all (what differs:
`EagleRows`, `MTPRows`, `DFlashRows`).

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

The MTP layer (drafters/mtp.py) is the same machine: its pairs (h[t], s[t+1]) are the
entries, h the target's post-final-norm state where EAGLE fuses three layers, its output
chained with the token it drafted as EAGLE's is; a joining row is prefilled by an
`MTPDrafter`, which then runs its pending pairs (the single stream re-runs its last pair at
each proposal instead of keeping `last`). DeepSeek's layout zeroes the embedding of the pair
at position 0 (`MTPRows.run`'s `first`: a one-token prompt's first entry).

A DFlash head (drafters/dflash.py) keeps the same per-row features of every token but the
last, but its entries are its layers' context keys and values, rotated at the row's own
positions (no token, no output, no `last`), and it drafts a block, not a chain: at step 0 one
forward over every row's `[last token, mask...]` at its own position (`DFlashRows`), step j
reading column j; no entries are chained, so nothing is forgotten after the verify pass. A
DSpark head (drafters/dspark.py, `DSparkRows`) is a DFlash head whose anchor row guesses too
and whose Markov head adds, at step j, a bias over each row's guess at step j - 1 (its last
token at step 0): its logits are still one forward's, its guesses drawn step by step.

Rows that do not draft are fed all the same (their features come with the pass for free), so
every row's head holds its own context. A row that leaves hands its head back (`extract`: an
EagleDrafter, MTPDrafter or DFlashDrafter holding what a single stream's would; a DFlash row's
spans, the positions its context holds, are its `notes`), which the decoder it continues in
adopts.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from ..core.batch_caches import rollback_rows
from ..drafters.base import TargetOutput
from ..drafters.dflash import DFlashDrafter, DFlashHead, target_io
from ..drafters.dflash2 import DFlash2Drafter, DFlash2Head
from ..drafters.dspark import DSparkDrafter, DSparkHead
from ..drafters.eagle import Eagle3Head, EagleDrafter
from ..drafters.mtp import MTPDrafter, target_parts
from ..drafters.suffix import SuffixDrafter
from ..errors import SpecError

PENDING_MAX = 16  # features a row piles up in plain rounds before a head pass takes them in


def own_drafter(kept):
    """A kept decoder's drafter: a suffix drafter's inner one (suffix+<head>: the head's)."""
    d = getattr(kept, "drafter", None)
    return d.inner if isinstance(d, SuffixDrafter) and d.inner is not None else d


class ChainRows:
    """A head that drafts one token a step, chained on its own output (EAGLE-3, MTP); its
    entries pair a position's features with the next token."""

    block = False  # one step a token (DFlashRows: one forward a block)
    selects = False  # (DFlash2Rows)
    max_draft = None

    def fed(self, note, start: int, count: int):
        """A row's own note (DFlashRows: its context's spans) after `count` entries from
        position `start` were made; the chained heads keep none."""
        return note

    def enter(self, h, tokens, cache, starts: list[int], counts: list[int]):
        """Entries of the rows' pending features (B, W, H), row b's first at position
        starts[b], counts[b] of them real: the head's outputs (B, W, H)."""
        first = [m > 0 and s == 0 for s, m in zip(starts, counts, strict=True)]
        return self.run(h, tokens, cache, first)


class EagleRows(ChainRows):
    """What BatchHead asks of an EAGLE-3 head: its features are the three target layers it
    reads, fused; its entries pair them with the next token (Eagle3Head.rows)."""

    def __init__(self, head: Eagle3Head, target=None):
        self.head = head
        self.hidden_layers = tuple(head.layers_read)
        self.size, self.dtype = head.hidden_size, head.fc.weight.dtype

    def drafter(self, kept):
        """A kept decoder's drafter of this head (a copy of its state), or None."""
        d = own_drafter(kept)
        ok = isinstance(d, EagleDrafter) and d.head is self.head
        return copy.copy(d) if ok else None

    def prefill(self, prompt, output, kept, timed):
        """The single stream's prefill: (its cache, its last output, the entries it holds,
        one step's seconds or None)."""
        drafter = kept if kept is not None else EagleDrafter(self.head)
        seconds = drafter.prefill(prompt, timed, output)
        if drafter.pending is not None:
            raise SpecError("the head kept features without entries after its prefill")
        return drafter.cache, drafter.last, drafter.entries, seconds, None

    def features(self, hidden: dict) -> mx.array:
        return self.head.fuse(hidden)

    def extract(self, cache, pending, last, sequence, note=None) -> EagleDrafter:
        """A row's EagleDrafter: its entries (the cache's row, left padding dropped), its
        pending features and last output."""
        drafter = EagleDrafter(self.head)
        drafter.cache, drafter.entries = cache, cache[0].offset
        drafter.pending, drafter.last = pending, last
        drafter.rows = drafter.entries + (pending.shape[0] if pending is not None else 0)
        drafter.tokens = list(sequence)
        drafter.target_at = len(sequence) - 1  # (its decoder's next prefill sets it anew)
        if drafter.rows != len(sequence) - 1:
            raise SpecError(
                f"the head's row holds features of {drafter.rows} positions, not "
                f"{len(sequence) - 1}"
            )
        return drafter

    def run(self, h, tokens, cache, first=None) -> mx.array:
        return self.head.rows(h, tokens, cache)

    def logits(self, g: mx.array) -> mx.array:
        return self.head.rows_logits(g)


class MTPRows(ChainRows):
    """What BatchHead asks of the target's MTP layer (mtp_head.py): its features are the
    target's post-final-norm states, its entries the pairs (h[t], s[t+1]) (the token through
    the target's embedding), its logits the target's head over `final(g)`. DeepSeek's layout
    zeroes the embedding of the pair at position 0 (`zero_first`)."""

    def __init__(self, head, target):
        self.head, self.target = head, target
        self.embed, self.lm_head = target_parts(target)
        self.hidden_layers = MTPDrafter.hidden_layers
        self.size = head.hidden_size
        self.dtype = mx.float32  # (a row's zeros, while no row has an output to take after)

    def drafter(self, kept):
        d = own_drafter(kept)
        ok = isinstance(d, MTPDrafter) and d.head is self.head
        return copy.copy(d) if ok else None

    def prefill(self, prompt, output, kept, timed):
        drafter = kept if kept is not None else MTPDrafter(self.head, self.target)
        seconds = drafter.prefill(prompt, timed, output)
        last = None
        if drafter.rows is not None and drafter.rows.shape[0]:  # every pair, the last too
            known = drafter._known()
            out = drafter._run(prompt[drafter.end + 1 : known + 1], drafter.rows, drafter.end)
            drafter.end, drafter.rows, last = known, None, out[-1]
        return drafter.cache, last, drafter.end, seconds, None

    def features(self, hidden: dict) -> mx.array:
        return hidden[self.hidden_layers[0]]

    def extract(self, cache, pending, last, sequence, note=None) -> MTPDrafter:
        """A row's MTPDrafter: its pairs up to `end` (the positions but the pending ones;
        its cache may hold fewer, where a kept drafter's restarted), the pending states as
        its unfed rows; its next prefill feeds the rest, as alone."""
        drafter = MTPDrafter(self.head, self.target)
        drafter.cache, drafter.tokens = cache, list(sequence)
        drafter.rows = pending
        drafter.end = len(sequence) - 1 - (pending.shape[0] if pending is not None else 0)
        drafter.target_at = len(sequence) - 1  # what the target's cache holds
        if cache[0].offset > drafter.end:
            raise SpecError(f"the head's row holds {cache[0].offset} pairs, not {drafter.end}")
        return drafter

    def run(self, h, tokens, cache, first=None) -> mx.array:
        embeddings = self.embed(tokens)  # (B, N, H)
        if first is not None and self.head.zero_first and any(first):  # a row's pair at 0
            at0 = mx.array(first)[:, None] & (mx.arange(tokens.shape[1]) == 0)[None]
            embeddings = embeddings * (~at0)[..., None]
        return self.head(embeddings, h.astype(embeddings.dtype), cache)

    def logits(self, g: mx.array) -> mx.array:
        return self.lm_head(self.head.final(g))


class DFlashRows:
    """What BatchHead asks of a DFlash head (drafters/dflash.py): its features are the target
    layers it reads, side by side; an entry is the context keys and values its layers project
    from them (rotated at the row's own positions, no token, no output: `last` stays None); it
    drafts a whole block in one forward for all rows (`block_logits`), each row's block
    `[last token, mask...]` at its own position attending, unmasked, to its own context and
    block (its left padding masked out)."""

    block = True
    chained = False  # a guess's logits depend on the guess before it (DSparkRows)
    selects = False  # chooses among processed logits (DFlash2Rows): processors go first
    drafter_type = DFlashDrafter

    def __init__(self, head: DFlashHead, target):
        self.head, self.target = head, target
        self.embed, self.lm_head = target_io(target)
        self.hidden_layers = tuple(head.args.target_layer_ids)
        self.block_size = head.args.block_size
        self.first_row = head.first_row  # the block row that guesses the next token
        self.max_draft = self.block_size - self.first_row
        self.mask = head.args.mask_token_id
        self.dtype = mx.float32

    def drafter(self, kept):
        d = own_drafter(kept)
        ok = isinstance(d, self.drafter_type) and d.head is self.head
        if not ok:
            return None
        twin = copy.copy(d)
        twin.spans = [list(span) for span in d.spans]  # (the prefill cuts and extends them)
        return twin

    def prefill(self, prompt, output, kept, timed):
        """The single stream's prefill, its context projected (entries: None, the context
        may have gaps where the target ran without it, as alone; its spans are the row's
        note)."""
        drafter = kept if kept is not None else self.drafter_type(self.head, self.target)
        seconds = drafter.prefill(prompt, timed, output)
        drafter._flush()
        return drafter.cache, None, None, seconds, [list(span) for span in drafter.spans]

    def fed(self, spans, start: int, count: int):
        if spans and sum(spans[-1]) == start:
            spans[-1][1] += count
        else:
            spans.append([start, count])
        return spans

    def features(self, hidden: dict) -> mx.array:
        return mx.concatenate([hidden[i] for i in self.hidden_layers], axis=-1)

    def extract(self, cache, pending, last, sequence, spans=None) -> DFlashDrafter:
        """A row's DFlashDrafter: its context (the cache's row) at its spans, its pending
        features still to project."""
        drafter = self.drafter_type(self.head, self.target)
        # its own spans: a row copied while it stays (batch.copy_row) keeps writing its note
        drafter.cache, drafter.tokens = cache, list(sequence)
        drafter.spans = [list(span) for span in spans]
        if pending is not None:
            drafter.pending = [(len(sequence) - 1 - pending.shape[0], pending)]
        held = sum(n for _, n in spans)
        if held != cache[0].offset:
            raise SpecError(f"the head's row holds {cache[0].offset} positions, not {held}")
        return drafter

    def enter(self, h, tokens, cache, starts: list[int], counts: list[int]):
        head = self.head
        ctx = head.hidden_norm(head.fc(h))
        offset = mx.array(starts)
        for layer, c in zip(head.layers, cache, strict=True):
            c.update_and_fetch(*layer.self_attn.keys_values(ctx, head._rope, offset))

    def block_logits(self, last: list[int], cache: list, positions: list[int], k: int):
        """Every row's guesses for its next k tokens (B, k, vocab), one forward."""
        head = self.head
        block = mx.array([[t] + [self.mask] * (self.block_size - 1) for t in last], mx.uint32)
        x, offset = self.embed(block), mx.array(positions)
        for layer, c in zip(head.layers, cache, strict=True):
            x = self._layer(layer, x, offset, c)
        return self.logits(head.norm(x)[:, self.first_row : self.first_row + k])

    def logits(self, states: mx.array) -> mx.array:
        return self.lm_head(states)

    def _layer(self, layer, x, offset, cache):
        x = x + self._attend(layer.self_attn, layer.input_layernorm(x), offset, cache)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def step(self, j: int, logits: mx.array, previous: mx.array, process=None) -> mx.array:
        """Every row's logits at block position j (B, vocab) given the guesses before it
        (B,): DFlash's do not depend on them. (`process`: for a kind that `selects`.)"""
        return logits

    def _attend(self, attn, x, offset, cache):
        """DFlashAttention over a batch: the block (B, L, dim) at each row's position."""
        B, L, _ = x.shape
        rope = self.head._rope
        q = attn.q_norm(attn.q_proj(x).reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=offset)
        keys, values = attn.keys_values(x, rope, offset)
        mask = None
        if cache.keys is not None and cache._idx:
            held = cache._idx
            keys = mx.concatenate([cache.keys[..., :held, :], keys], axis=2)
            values = mx.concatenate([cache.values[..., :held, :], values], axis=2)
            real = mx.arange(held)[None] >= cache.left_padding[:, None]  # (B, held)
            mask = mx.concatenate([real, mx.ones((B, L), mx.bool_)], axis=1)[:, None, None]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
        return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DSparkRows(DFlashRows):
    """A DSpark head (drafters/dspark.py): DFlash's rows, every block row guessing, and the
    Markov head's bias over each row's guess before (its last token at step 0): a row's
    sampled guesses are drawn step by step, as DSparkDrafter draws them alone."""

    chained = True
    drafter_type = DSparkDrafter

    def __init__(self, head, target):
        super().__init__(head, target)
        if head.embed_tokens is not None:  # the head's own, when it ships them
            self.embed = head.embed_tokens
        if head.lm_head is not None:
            self.lm_head = head.lm_head

    def step(self, j: int, logits: mx.array, previous: mx.array, process=None) -> mx.array:
        return self.head.widen(logits + self.head.markov_head(previous))


class DFlash2Rows(DFlashRows):
    """A DFlash2 head (drafters/dflash2.py): DFlash's rows, each layer's convolutions over each
    row's block, then at step j the selector among each row's processed top candidates after
    its guess before (`DFlash2Drafter.select`, batched): logits -inf off the candidates."""

    chained = selects = True
    drafter_type = DFlash2Drafter

    def logits(self, states: mx.array) -> mx.array:
        self._projected = self.head.candidate_selector.hidden_projection(states)  # (B, k, r)
        return self.head.scale(self.lm_head(states))

    def _layer(self, layer, x, offset, cache):
        y, later = layer.attention_conv.prepare(layer.input_layernorm(x))
        x = x + layer.attention_conv.finish(self._attend(layer.self_attn, y, offset, cache), later)
        y, later = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
        return x + layer.mlp_conv.finish(layer.mlp(y), later)

    def step(self, j: int, logits: mx.array, previous: mx.array, process=None) -> mx.array:
        logits = process(logits) if process is not None else logits
        return self.head.select(logits, previous, self._projected[:, j])


def head_rows(head, target):
    """The batch's view of a head: an EAGLE-3 head's, a DFlash or DSpark head's or an MTP
    layer's."""
    if isinstance(head, Eagle3Head):
        return EagleRows(head)
    if isinstance(head, DSparkHead):
        return DSparkRows(head, target)
    if isinstance(head, DFlash2Head):
        return DFlash2Rows(head, target)
    return DFlashRows(head, target) if isinstance(head, DFlashHead) else MTPRows(head, target)


class BatchHead:
    """The head's batched cache and each row's pending features and last output."""

    def __init__(self, head, target=None):
        self.head = head
        self.kind = head_rows(head, target)
        self.hidden_layers = self.kind.hidden_layers
        self.cache: list | None = None  # one BatchKVCache per head layer
        self.pending: list = []  # per row: (m, H) features without entries, or None
        self.last: list = []  # per row: (H,) the head's output at its last entry, or None
        self.notes: list = []  # per row: what its kind keeps of it (DFlash: its spans)

    def kept_drafter(self, kept):
        """A kept decoder's drafter of this head, its state taken along (or None)."""
        return self.kind.drafter(kept)

    def prefill(self, prompt: list[int], hidden: dict, fed: int, kept=None, timed=False):
        """A joining row's head, prefilled alone as a single stream's: `hidden` the target's
        captured layers over the prompt's last `fed` positions but its last token; `kept`: a
        kept decoder's drafter (`kept_drafter`: what of it still holds is kept; where the
        features are gone the single stream's drafter does as it does alone). Returns what
        `join` takes and, `timed`, one head step's seconds (None when it cannot draft yet)."""
        output = TargetOutput(None, hidden, fed, fed) if fed else None
        cache, last, entries, seconds, note = self.kind.prefill(prompt, output, kept, timed)
        if entries is not None and entries != len(prompt) - 1:
            raise SpecError(f"the head holds {entries} entries, not {len(prompt) - 1}")
        drafts = self.kind.block or last is not None
        return (cache, last, note), (seconds if timed and drafts else None)

    def join(self, state) -> None:
        cache, last, note = state
        merged = [BatchKVCache.merge([c]) for c in cache]
        if self.cache is None:
            self.cache = merged
        else:
            for c, m in zip(self.cache, merged, strict=True):
                c.extend(m)
        self.pending.append(None)
        self.last.append(last)
        self.notes.append(note)

    def keep(self, keep: list[int]) -> None:
        """Only these rows (indices) stay."""
        self.pending = [self.pending[i] for i in keep]
        self.last = [self.last[i] for i in keep]
        self.notes = [self.notes[i] for i in keep]
        if not keep:
            self.cache = None
            return
        index = mx.array(keep)
        for c in self.cache:
            c.filter(index)

    def can_draft(self, b: int) -> bool:
        """Whether row b has an entry to draft from (a one-token prompt: not before its first
        pass gave the features of its token)."""
        return self.kind.block or self.last[b] is not None or self.pending[b] is not None

    def feed(self, sequences: list[list[int]]) -> None:
        """Make entries of every row's pending features: one head pass over the rows."""
        counts = [p.shape[0] if p is not None else 0 for p in self.pending]
        width = max(counts, default=0)
        if width == 0:
            return
        some = next(p for p in self.pending if p is not None)
        rows, tokens, starts = [], [], []
        for p, m, seq in zip(self.pending, counts, sequences, strict=True):
            held = len(seq) - 1 - m  # entries the row holds: features m more, tokens after
            tokens.append(seq[held + 1 : held + 1 + m] + [0] * (width - m))
            pad = mx.zeros((width - m, some.shape[-1]), some.dtype)
            rows.append(pad if p is None else mx.concatenate([p, pad]) if m < width else p)
            starts.append(held)  # the position of its first pending features
        ids = mx.array(tokens, mx.uint32)
        out = self.kind.enter(mx.stack(rows), ids, self.cache, starts, counts)
        for b, m in enumerate(counts):
            if m:
                self.notes[b] = self.kind.fed(self.notes[b], starts[b], m)
                if out is not None:
                    self.last[b] = out[b, m - 1]
        rollback_rows(self.cache, [width - m for m in counts])
        self.pending = [None] * len(counts)

    def draft_logits(self, j, picks, sequences: list[list[int]], width: int, process=None):
        """Draft step j's logits for every row (B, vocab): a chained head's step from each
        row's last output (j = 0) or from its own output fed `picks`, the tokens it drafted at
        step j - 1; a block head's whole block at j = 0, then its column j (given `picks`, for
        a DSpark head's Markov bias or a DFlash2 head's selector, which chooses among the
        logits `process` gives: the rows' processors, applied first as alone)."""
        if self.kind.block:
            if j == 0:
                last = [seq[-1] for seq in sequences]
                positions = [len(seq) - 1 for seq in sequences]
                self._drafts = self.kind.block_logits(last, self.cache, positions, width)
                picks = mx.array(last, mx.uint32)  # what step 0 follows
            return self.kind.step(j, self._drafts[:, j], picks, process)
        self._g = self.first() if j == 0 else self.chain(self._g, picks)
        return self.logits(self._g)

    def block(self, vocab: int | None) -> mx.array:
        """A block head's whole block of logits this round (B, K, vocab)."""
        return self._drafts[..., :vocab] if vocab is not None else self._drafts

    def first(self) -> mx.array:
        """Each row's last output (B, H), zeros for a row that cannot draft yet (its guesses
        are never used; a round may draft for others, or take a grammar's forced tokens)."""
        some = next((g for g in self.last if g is not None), None)
        dtype = some.dtype if some is not None else self.kind.dtype
        zeros = mx.zeros((self.kind.size,), dtype)
        return mx.stack([g if g is not None else zeros for g in self.last])

    def chain(self, g: mx.array, picks: mx.array) -> mx.array:
        """A chained step for all rows: the head's output stands in for the features of the
        token it just drafted (`picks`, (B,)); one entry more in every row."""
        return self.kind.run(g[:, None], picks[:, None].astype(mx.uint32), self.cache)[:, 0]

    def logits(self, g: mx.array) -> mx.array:
        return self.kind.logits(g)

    def forget(self, chained: int) -> None:
        """Drop a round's chained entries (as many in every row)."""
        if chained:
            for c in self.cache:
                c.trim(chained)

    def take(self, hidden: dict, kept: list[int], sequences: list[list[int]], starts=None) -> None:
        """The verify pass's captured layers (layer -> (B, width, hidden)): row b's `kept[b]`
        positions from `starts[b]` (a recurrent target's row replays its unfed tokens first:
        their features were taken in the pass that verified them) are now in its sequence;
        their features become pending."""
        fused = self.kind.features(hidden)  # (B, width, H)
        for b, n in enumerate(kept):
            if n:
                start = starts[b] if starts is not None else 0
                f = fused[b, start : start + n]
                p = self.pending[b]
                self.pending[b] = f if p is None else mx.concatenate([p, f])
        if max((p.shape[0] for p in self.pending if p is not None), default=0) > PENDING_MAX:
            self.feed(sequences)

    def extract(self, b: int, sequence: list[int]):
        """Row b's head as a single stream's drafter over `sequence` (the row's), so the
        decoder it continues in needs no target pass to feed the head again (without it, the
        next turn of a conversation served in a batch prefilled its whole prompt: the head's
        features were gone)."""
        cache = [c.extract(b) for c in self.cache]
        return self.kind.extract(cache, self.pending[b], self.last[b], sequence, self.notes[b])

    def arrays(self) -> list:
        """What is kept between rounds (for the batch's settle)."""
        out = [c.state for c in self.cache or []]
        return out + [a for a in self.pending + self.last if a is not None]
