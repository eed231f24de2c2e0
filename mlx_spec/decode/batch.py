"""Continuous batching that still speculates: B requests advance together, one target pass a round.

`BatchDecoder` keeps one batched KV cache (mlx-lm's left-padded `BatchKVCache`) for the target
and, with a draft model, one for the draft; with an EAGLE-3 head, the target's MTP layer or a
DFlash head, the head's (batch_head.py).
What batches: plain KV layers (`BatchKVCache`) and
sliding-window layers (mlx-lm's `RotatingKVCache` without attention sinks: Gemma 2/3/4,
GPT-OSS, Mistral-style `sliding_window`), whose rows `batch_caches.BatchWindowedKVCache` holds as
`WindowedKVCache` holds one stream's (a window mask, absolute offsets, old tokens dropped; a
roll-back that would cut into a row's window raises), and recurrent layers (ArraysCache:
Qwen3.5 hybrids, Mamba) in the target (below) and in a draft model (its state after each draft
step kept, as ModelDrafter keeps it alone: each row goes back to its own). Refused with a
one-line reason (`check_batchable`), as mlx-lm cannot batch them either: attention sinks and any
cache class not named here. Models whose own code takes one position for the whole batch
(`ONE_OFFSET`: gpt_bigcode, Llama 4's chunked attention, deepseek_v41's compressed attention)
run row by row, each row on its own single-stream caches (`batch_caches.RowsCache`,
`RowWise`): exact, not faster; deepseek_v41's `LayerCache` goes back by a snapshot and a
replay, as a recurrent state does. A head beside a
recurrent target takes the features of each row's kept tokens from where its last token sits
in the pass (after its replay): `BatchHead.take`'s starts.
Each round (`step`):

1. every row proposes up to k tokens: the draft model batched the same way (one forward over the
   B rows per draft step), an EAGLE-3 head or an MTP layer (one head pass over the rows per
   step, from the target layers the last verify pass captured: batch_head.py), a DFlash head
   (one forward drafts every row's block), or prompt lookup in the row's own context; a
   suffix row (suffix decoding) may look up past k (batch_draft.py);
2. ONE target pass over (B, K+1) tokens, K the longest proposal: `[last, x1..xk, pad..]` a row;
3. each row is verified on its own rows of logits by the function the single stream uses
   (`rounds.verify`) under its own sampling settings and random key, which
   it splits exactly as `engine.Decoder` does, so a seeded row samples what it would alone;
4. each row forgets what it rejected (`rollback_rows`).

Rows join between rounds (`add`: prefilled alone, then merged in) and leave when they finish or
are cancelled (`cancel`, `remove`). Every row's output is the target's, whatever runs beside it.

Where the rest lives: a row, what it brings in and takes away (kept caches, `RowState`,
`into_decoder`) is batch_rows.py's; a round's proposals, verification and what each row keeps
(`BatchRound`, a recurrent target's one-width passes and replays, rows with nothing to propose)
batch_draft.py's; how each mlx-lm cache class batches, merges, is extracted and rolls back per
row core/batch_caches.py's. This module holds the rows' coming and going and the round's
skeleton.

Rolling back per row: after the pass row i holds K+1 new entries and keeps n_i + 1 (its last
token and its accepted drafts). Every row is trimmed by the smallest rejection (free), and each
row with more is rolled right by the rest (`prepare(right_padding=...)` + `finalize()`): its
rejected entries move past the end and its left padding grows, so the mask hides what is left
there. Why this: trimming every row to the most rejected and re-feeding the others' accepted
tokens throttles all rows to the worst row's acceptance; holes in the cache need a custom mask
and never shrink. Cost: in rounds where rows rejected different numbers, one gather per layer
over its K/V (as much memory traffic as the attention of one pass, small beside the weights at
these context lengths); left padding grows by the difference (at most the fastest row's
length, the waste of any batch of prompts of different lengths) and `filter` reclaims it as
rows leave.

A recurrent target (docs/design.md): no padding in a pass, which would enter a row's state;
a row that rejected anything is restored for its row only and replays its kept tokens
(batch_draft.py).

Threads: one thread owns the MLX arrays (streams are per thread, threads.py). A server worker
thread calls `add`, `step` and `cancel`'s effect from that thread; `cancel` itself only marks
the row, so another thread may call it; the row leaves at the start of the next `step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..core import batch_caches, caches
from ..core.batch_caches import (
    ONE_OFFSET,
    RowWise,
    check_batchable,
    extract_layer,
    merge_rows,
)
from ..core.batch_policy import BatchController
from ..core.caches import prefill_cache
from ..core.grammar import grammar_of
from ..core.hidden import capturing
from ..core.lookup_length import LookupCosts
from ..core.policies import Auto, DraftLength, Fixed, draft_length
from ..core.sampling import random_key
from ..drafters.ngram import NGramDrafter
from ..errors import SpecError
from ..pairs.config import is_int
from .batch_assistant import batch_head
from .batch_draft import BatchRound
from .batch_rows import Row, RowState, RowUpdate, check_held, draft_tail, kept_caches, row_k_max
from .config import GenerationConfig
from .prompts import check_token_ids, request_processors
from .rounds import Round

# Tokens the draft missed (plain rounds) that ride along in a drafting round's first step; more
# get a pass of their own, kept out of the round's timing: the controller would otherwise take
# a long catch-up for the cost of a draft step (a compute-bound draft: one step per token).
CATCH_UP_RIDES = 4


@dataclass
class BatchTiming:
    """The last round's measured parts (what the controller learns from)."""

    rows: int = 0  # target rows in the verify pass: B x (K+1)
    draft_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # the pass, its verification and the roll-back after it


class BatchDecoder(BatchRound):
    """Speculative decoding over a batch of requests that join and leave between rounds.

    `draft`: a draft model (batched like the target); `head`: an EAGLE-3 head, the
    target's MTP layer, a DFlash head or Gemma 4's assistant (batch_head.py; beside suffix
    lookup only); `lookup`: (ngram_max, ngram_min) for prompt lookup per row (beside a draft
    model: lookup first, the model where it finds nothing: ngram+model), or a kind's row
    lookup made from the row's history (suffix decoding: past k where it pays,
    batch_draft.py's `_lookups`); neither: plain continuous batching.
    `num_draft_tokens`: an int, `Fixed(k)` or `Auto()` (a `BatchController`: k from measured
    pass costs per row count).
    `draft_confidence`: a row's proposal stops after a guess the draft is less sure of, as
    ModelDrafter's does (the batch's draft steps run for the longest proposal).

    Invariants between rounds: the target cache holds each row's `sequence[:-1]`; the draft
    cache holds each row's `sequence[:-lag]` with one `lag` (>= 2) for all rows, so every
    draft pass is over a rectangle (see `_draft`); a row joins at that lag (its prompt
    shorter than it: the others catch up first). A row that does not draft holds nothing of
    its own in the draft cache (only what each draft pass feeds every row).
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        lookup=None,
        eos_token_ids=(),
        num_draft_tokens: DraftLength | int | str = 4,
        vocab: int | None = None,
        draft_confidence: float = 0.0,
        head=None,
    ):
        check_batchable(target, "target", recurrent=True, apart=True)
        if draft is not None:
            check_batchable(draft, "draft", recurrent=True, apart=True)
        # a model whose own code takes one position for the whole batch (ONE_OFFSET) runs
        # row by row, each row on its own caches (batch_caches.RowsCache): exact, not faster
        self.apart = getattr(target, "model_type", None) in ONE_OFFSET
        self.draft_apart = getattr(draft, "model_type", None) in ONE_OFFSET
        if head is not None and self.apart:
            raise SpecError(
                f"the target model ({target.model_type}) runs a batch row by row, which a "
                "head's batch does not; decode it with a draft model or prompt lookup"
            )
        self.target_pass = RowWise(target) if self.apart else target
        self.draft_pass = RowWise(draft) if self.draft_apart else draft
        # a kind's own row lookup (suffix decoding: a callable making each row's) may go
        # beside a head or a draft model, its drafts past k where they pay (`_lookups`)
        self.suffix = callable(lookup)
        if head is not None and (draft is not None or (lookup is not None and not self.suffix)):
            raise SpecError(
                "a batch drafts with a head alone (or beside suffix lookup), not beside "
                "another drafter"
            )
        # a recurrent target (Qwen3.5, Qwen3-Next, Mamba; deepseek_v41's compressed layers,
        # row by row): rows restored and replayed
        self.recurrent = caches.is_recurrent(make_prompt_cache(target))
        # a recurrent draft model (Qwen3.5-0.8B for a Qwen3.5 target): each row's state is
        # restored from the snapshots its draft steps left (`_draft`, `_finish_round`)
        self.draft_recurrent = draft is not None and caches.is_recurrent(make_prompt_cache(draft))
        self.draft_states: list = []  # this round's snapshots of the draft's recurrent state
        self.target, self.draft, self.lookup = target, draft, lookup
        # an EAGLE-3 head or an MTP layer (batch_head.py): it reads the target's layers in
        # each pass
        self.heads = batch_head(head, target, lambda: self.cache) if head is not None else None
        self.hidden_layers = self.heads.hidden_layers if self.heads is not None else ()
        # a row's draft stops after a guess the draft is less sure of (ModelDrafter's rule)
        self.confidence = draft_confidence
        self.eos = set(eos_token_ids)
        self.vocab = vocab
        length = draft_length(num_draft_tokens)
        self.drafting = draft is not None or lookup is not None or head is not None
        k_max = length.k_max if isinstance(length, Auto) else length.k
        most = self.heads.kind.max_draft if self.heads is not None else None
        k_max = min(k_max, most) if most else k_max  # a block head's guesses, as alone
        self.fixed_k = k_max if isinstance(length, Fixed) else None
        self.controller = (
            BatchController(
                k_max,
                draft is not None or head is not None,
                block=self.heads is not None and bool(self.heads.kind.block),
            )
            if self.fixed_k is None
            else None
        )
        # suffix rows: their looked-up tokens' acceptance per match length (lookup_length.py)
        # and the pass costs their lookup drafts are chosen by (the controller's; with a fixed
        # k, a controller kept for its measured costs only)
        self.lookup_costs = LookupCosts()
        self.curve = self.controller
        if self.curve is None and self.suffix:
            self.curve = BatchController(k_max, draft is not None or head is not None)
        self.pair = None  # make_batch_decoder's: what a row's grammar compiles against
        self.rows: list[Row] = []
        self.cache: list | None = None
        self.draft_cache: list | None = None
        self.lag = 2
        self.cancelled: set[int] = set()
        self.failed: dict[int, Exception] = {}  # this step's rows whose grammar failed
        self.timing = BatchTiming()
        self.extract_seconds = 0.0  # the last round's copying out of leaving rows' caches
        # rows joined or left since the last round: its pass is not timed (see step)
        self.reshaped = False
        self._ids = 0

    def __len__(self) -> int:
        return len(self.rows)

    # ----------------------------------------------------------------------- rows come and go

    def add(
        self,
        prompt: list[int],
        config: GenerationConfig | None = None,
        max_tokens=None,
        history=None,
        *,
        kept=None,
        keep: bool = False,
        processors: list | None = None,
        marks: tuple[int, ...] = (),
        on_mark=None,
    ) -> int:
        """Prefill `prompt` (token ids) alone and merge it into the batch; its row id.
        From `config` a row takes its sampling settings, seed, max_tokens (`max_tokens`
        overrides it, e.g. capped by the context), use_draft and num_draft_tokens, a cap on
        the batch's k for this row (`row_k_max`), its processors, logprobs and schema /
        grammar / regex (`prompts.request_processors`: as a single stream applies them).
        `history`: a HistoryIndex the row's lookup also searches (its own client's: the
        server passes the row's partition, so no row drafts from another's text).
        `kept`: an `engine.Decoder` of the same pair (the server's prompt cache, the row's
        own client's) whose caches the row starts from, so only the prompt's tokens past the
        shared prefix are prefilled (`row(id).reused` says how many were not); it gives its
        caches up (`kept_caches`). `keep`: hand the caches back when the row leaves.
        `processors`: the row's own, made already, for a reply that goes on as a row (the
        server's lone stream moving into the batch: a grammar's matcher goes on where the
        reply is, constraining only the reply). `marks` (ascending): positions where,
        as the row's prompt is prefilled, `on_mark(RowState)` gets a copy of its target cache
        holding `prompt[:mark]` (a recurrent state cannot go back to a shared part later: the
        server keeps such a copy at the end of the system prompt, as a single stream does);
        not for a head's batch (the copy would hold none of the head's features)."""
        config = GenerationConfig.of(config)
        if isinstance(prompt, str) or not isinstance(prompt, list | tuple):
            raise SpecError(f"a row's prompt is a list of token ids, not {type(prompt).__name__}")
        if not prompt:
            raise SpecError("the prompt is empty")
        # MLX does not bounds-check a gather: an id past the vocabulary crashed the process
        prompt = check_token_ids(prompt, self.vocab)
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
            raise SpecError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if kept is not None and kept.pair is not None and self.pair is not None:
            if kept.pair is not self.pair:  # (its caches are another model's: wrong tokens)
                raise SpecError("the kept decoder was made for another pair")
        if processors is None:
            processors = request_processors(self.pair, config, len(prompt), self.vocab)
        params = config.sampling
        key = None if params.greedy else random_key(config.seed)
        row = Row(
            self._ids,
            list(prompt),
            params,
            max_tokens if max_tokens is not None else config.max_tokens,
            key,
            use_draft=config.use_draft and self.drafting and not self._draft_cannot_pay(),
            seeded=self.recurrent and key is not None and config.seed is not None,
            prompt_tokens=len(prompt),
            keep=keep,
            k_max=row_k_max(config.num_draft_tokens),
            processors=list(processors),
            logprobs=config.logprobs,
        )
        row.grammar = config.forcing(grammar_of(processors))  # as a single stream drafts
        self._ids += 1
        # a one-token prompt: the draft sees its token twice (only its guesses change); a
        # row that never drafts is not prefilled (its draft row holds only what each draft
        # pass feeds every row, and its guesses are never used)
        context = prompt if len(prompt) >= 2 else prompt * 2
        drafts = self.draft is not None and row.use_draft
        if drafts and len(context) < self.lag:
            self._catch_up()  # the batch's draft to lag 2: the new row can start there
        # the new row's draft holds its context but the batch's last `lag` tokens, as every
        # row's does: after plain rounds a row joins without a catch-up of the others
        end = len(context) - self.lag if drafts else 0
        cache = draft_cache = None
        draft_reuse = 0
        held, gap = None, None  # a head: the kept decoder's drafter, where it stops holding
        if kept is not None and self.heads is not None:
            gap = kept.hidden_gap
            held = self.heads.kept_drafter(kept)  # its state (give_up gives the decoder new)
        if kept is not None:
            cache, row.reused, draft_cache, draft_reuse = kept_caches(
                kept, prompt, context[:end] if drafts else None
            )
        if gap is not None and row.reused > gap and caches.can_rollback(cache, row.reused - gap):
            # the head never got the target's layers past the gap (a row handed back, a reply
            # without drafts): compute them again from there, as a single stream does
            caches.rollback(cache, row.reused - gap)
            row.reused = gap
        if not row.reused:
            held = None
        cache = cache if cache is not None else caches.make_cache(self.target)
        # until the controller knows a lone row's step costs, the prefill times them
        timed = self.controller is not None and self.controller.wants_timing()
        done = row.reused
        for mark in marks if on_mark is not None and self.heads is None else ():
            if done < mark < len(prompt) - 1:
                prefill_cache(self.target, cache, prompt[done:mark])
                done = mark
                try:
                    copied = caches.copy(cache)
                except caches.CacheCopyError:  # a kind that cannot be copied: no checkpoint
                    continue
                on_mark(RowState(list(prompt[: mark + 1]), copied, None))
        new = prompt[done:-1]
        hidden = dict.fromkeys(self.hidden_layers) if self.heads is not None else None
        plain = prefill_cache(self.target, cache, new, timed=timed, hidden=hidden)
        if self.heads is not None:  # the head: every row's, whether it drafts or not
            joining, step = self.heads.prefill(prompt, hidden, len(new), held, timed)
            if timed:
                self.controller.calibrate(plain, step)
                row.use_draft = row.use_draft and not self._draft_cannot_pay()
        elif timed:
            # a draft step is timed on a scratch cache of the context's last tokens, before
            # the draft's prefill: a draft that cannot pay is then never prefilled (the demo's
            # compute-bound 4-bit draft: ~0.1 s a prompt token, most of a first token's wait)
            step = None
            if drafts:
                scratch = caches.make_cache(self.draft, "draft")
                step = prefill_cache(self.draft, scratch, context[-3:], timed=True)
            self.controller.calibrate(plain, step)
            if drafts and self._draft_cannot_pay():
                row.use_draft = drafts = False
                end, draft_cache, draft_reuse = 0, None, 0  # a kept draft cache is dropped
        if self.draft is not None:
            if draft_cache is None:
                draft_cache = caches.make_cache(self.draft, "draft")
            begin, fed = time.perf_counter(), context[draft_reuse:end]
            prefill_cache(self.draft, draft_cache, fed)
            if self.controller is not None and len(fed) >= CATCH_UP_RIDES:
                # what the draft costs a token when it takes many in: a catch-up's price
                self.controller.observe_catch_up(len(fed), time.perf_counter() - begin)
        if self.lookup is not None:
            if callable(self.lookup):  # a kind's own row lookup (suffix decoding)
                row.lookup = self.lookup(history)
            else:
                row.lookup = NGramDrafter(*self.lookup, history=history)
            row.lookup.prefill(prompt)
        merged = merge_rows([cache], self.apart)
        merged_draft = (
            merge_rows([draft_cache], self.draft_apart) if draft_cache is not None else None
        )
        if self.cache is None:
            self.cache, self.draft_cache = merged, merged_draft
        else:
            for c, m in zip(self.cache, merged, strict=True):
                c.extend(m)
            if merged_draft is not None:
                for c, m in zip(self.draft_cache, merged_draft, strict=True):
                    c.extend(m)
        if self.heads is not None:
            self.heads.join(joining)
        self.rows.append(row)
        self.reshaped = True
        self._settle()
        return row.id

    def _draft_cannot_pay(self) -> bool:
        """Whether a draft model could not pay even alone and always accepted, by the costs
        measured (`auto`): a row that joins then decodes plainly and is not prefilled
        through the draft (a compute-bound draft's prefill costs as much as its decoding)."""
        c = self.controller
        if c is None or not c.draft_model or 1 not in c.passes or 1 not in c.draft_steps:
            return False
        return c.hopeless(1, c.draft_seconds(1))

    def cancel(self, row_id: int) -> None:
        """Mark a row to leave at the start of the next `step` (safe from any thread)."""
        self.cancelled.add(row_id)

    def row(self, row_id: int) -> Row:
        return self.rows[self._index(row_id)]

    def _find(self, row_id: int) -> int | None:
        return next((i for i, r in enumerate(self.rows) if r.id == row_id), None)

    def _index(self, row_id: int) -> int:
        index = self._find(row_id)
        if index is None:
            raise SpecError(f"no row {row_id!r} in the batch (it left, or never joined)")
        return index

    def remove(self, row_id: int) -> RowState | None:
        """The row leaves now (from the thread that steps, between rounds): its caches when it
        was added with keep=True (None otherwise, or when it is not in the batch)."""
        self.cancelled.discard(row_id)
        index = self._find(row_id)
        if index is None:
            return None
        state = self._extract(index) if self.rows[index].keep else None
        self._keep([i for i in range(len(self.rows)) if i != index])
        return state

    def copy_row(self, row_id: int) -> RowState:
        """A copy of a row's caches, as `remove` would hand them over, the row staying: a
        request that shares the start of its sequence (an agent's sub-task beside its parent,
        one system prompt) starts from it rather than prefilling that part again."""
        state = self._extract(self._index(row_id))
        # a model run row by row (`apart`: RowsCache) hands over the row's own cache objects,
        # which the row goes on writing into: the copy gets caches of its own
        if self.apart:
            state.cache = caches.copy(state.cache)
        if self.draft_apart and state.draft_cache:
            state.draft_cache = caches.copy(state.draft_cache)
        if self.apart or self.draft_apart:  # (the copies' slices, lazy until now)
            caches.eval_state(state.cache + (state.draft_cache or []))
        return state

    def _extract(self, i: int) -> RowState:
        """Row i's caches as single-row KVCaches (evaluated: nothing lazy points into the
        batch's arrays). The target's hold sequence[:-1]; the draft's sequence[:-lag], or
        nothing is kept of it when the row did not draft (its row is not its text)."""
        row = self.rows[i]
        cache = [extract_layer(c, i) for c in self.cache]
        check_held(cache, len(row.sequence) - row.unfed, "batch row's target")
        draft_cache, draft_tokens = None, []
        # (a one-token prompt's draft row holds the token twice: not a prefix of its sequence;
        # a draft cache never fed, as a lone 2-token prompt that ends at once leaves it, holds
        # nothing to hand back: mlx-lm's extract fails on its empty keys)
        fed = self.draft_cache is not None and batch_caches.fed(self.draft_cache)
        if self.draft is not None and row.use_draft and row.prompt_tokens >= 2 and fed:
            draft_cache = [extract_layer(c, i) for c in self.draft_cache]
            draft_tokens = row.sequence[: len(row.sequence) - self.lag]
            check_held(draft_cache, len(draft_tokens), "batch row's draft")
        head = self.heads.extract(i, row.sequence) if self.heads is not None else None
        caches.eval_state(cache + (draft_cache or []))
        if head is not None:
            head.settle()
        return RowState(list(row.sequence), cache, draft_cache, draft_tokens, head, row.unfed)

    def _catch_up(self) -> None:
        """Feed the draft what it has not seen but the last two tokens of each row."""
        if self.rows and self.lag > 2:
            begin = time.perf_counter()
            tokens = mx.array([draft_tail(r, self.lag)[:-2] for r in self.rows], mx.uint32)
            self.draft_pass(tokens, cache=self.draft_cache)
            caches.eval_state(self.draft_cache)
            if self.controller is not None:
                self.controller.observe_catch_up(tokens.size, time.perf_counter() - begin)
        self.lag = 2

    def _keep(self, keep: list[int]) -> None:
        """Only these rows (indices) stay."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if self.heads is not None:
            self.heads.keep(keep)
        if not keep:
            self.cache = self.draft_cache = None
            self.lag = 2
            return
        index = mx.array(keep)
        for c in self.cache + (self.draft_cache or []):
            c.filter(index)
        self.reshaped = True

    def _settle(self) -> None:
        """Queue the evaluation of what is kept between rounds, so no graph grows across them
        (queued, not waited for: the next pass needs it first anyway)."""
        batch_caches.settle(self.cache, len(self.rows))
        keys = [r.key for r in self.rows if r.key is not None]
        heads = self.heads.arrays() if self.heads is not None else []
        layers = caches._leaves(self.cache + (self.draft_cache or []))
        mx.async_eval([c.state for c in layers], *keys, *heads)

    # ------------------------------------------------------------------------------ a round

    def _choose_k(self) -> int:
        if not any(r.use_draft for r in self.rows):
            return 0
        if self.fixed_k is not None:
            return self.fixed_k
        available = None  # (with a draft model too, every row can draft)
        if self.lookup is not None and self.draft is None and self.heads is None:
            available = [r.use_draft and r.lookup.has_proposal() for r in self.rows]
        missed = self.lag - 2 if self.draft is not None else 0
        return self.controller.next(len(self.rows), available, missed)

    def step(self) -> dict[int, RowUpdate]:
        """One round for every row: {row id: what it emitted}; finished rows leave (a row
        whose grammar failed with finish_reason "error")."""
        updates: dict[int, RowUpdate] = {}
        self.failed = {}
        if self.cancelled:
            gone = [i for i, r in enumerate(self.rows) if r.id in self.cancelled]
            for i in gone:
                row = self.rows[i]
                state = self._extract(i) if row.keep else None
                updates[row.id] = RowUpdate([], Round([], 0, 0), True, "cancelled", state)
            self.cancelled.clear()
            self._keep([i for i in range(len(self.rows)) if i not in set(gone)])
        if not self.rows:
            return updates
        rows = self.rows
        k = self._choose_k()
        requested, forced, overrides, draft_keys, looked = self._proposals(k)
        models = self.draft is not None or self.heads is not None
        # a head drafts the other rows only (a looked-up row's guesses join after: `beside`)
        by_head = self.heads is not None and bool(looked)
        drafting = models and any(
            q and not (by_head and b in looked) for b, q in enumerate(requested)
        )
        if drafting and self.draft is not None and self.lag > 2 + CATCH_UP_RIDES:
            self._catch_up()
        start = time.perf_counter()
        drafts, qs, lengths, steps, guesses = self._guess(
            drafting, requested, draft_keys, forced, overrides, looked
        )
        drafted_at = time.perf_counter()
        width = drafts.shape[1]  # K: the widest proposal; the rest of a row is padding
        saved = passes = None
        if self.recurrent:  # no padding: each row's unfed tokens, guesses, then fillers
            saved = batch_caches.snapshot(self.cache)
            passes = self._fill(drafts, lengths, guesses)
            inputs = mx.array(
                [r.sequence[-r.unfed :] + x for r, x in zip(rows, passes, strict=True)],
                mx.uint32,
            )
        else:
            last = mx.array([[r.sequence[-1]] for r in rows], mx.uint32)
            inputs = mx.concatenate([last, drafts.astype(mx.uint32)], axis=1) if width else last
        with capturing(self.target, self.hidden_layers) as hidden:  # (a head's layers)
            logits = self.target_pass(inputs, cache=self.cache)  # (B, K+1, vocab)
        out, lps = self._verify_rows(passes, drafts, requested, lengths, qs, logits)
        overrides.update({b: guess for b, (_, guess) in looked.items()})  # (no draft steps)
        done = self._finish_round(
            out.tolist(), passes or drafts.tolist(), requested, lengths, steps, lps, forced,
            overrides, hidden, saved,
        )  # fmt: skip
        updates.update(done)
        # the pass is timed through the round's roll-back: rows that rejected different
        # numbers are rolled per row, a gather over every layer's keys and values that on the
        # CPU costs half a pass (the demo pair, 8 rows at k 1: 45 ms against a 72 ms pass,
        # 2026-12-04); left out, the controller kept drafting where a plain batch was faster
        finished_at = time.perf_counter() - self.extract_seconds
        self.timing = BatchTiming(inputs.size, steps, drafted_at - start, finished_at - drafted_at)
        # the first pass after rows joined or left also merges or filters the caches and grows
        # the merged buffers (mlx-lm's BatchKVCache allocates 256 columns at a time): it is
        # not what a pass of this size costs. Timed, it made the demo pair's plain 8-row pass
        # look dearer than a 16-row drafting one (120 against 110 ms, 2026-12-04: it is only
        # ever measured right after the joins) and the server drafted where plain was faster
        timed, self.reshaped = not self.reshaped, False
        lookup_ids = {rows[b].id: match for b, (match, _) in looked.items()}
        if self.curve is not None and k:
            outcomes = [  # (a forced round is not the policy's: kept out, as alone; fillers
                # are no row's proposal; nor is a lookup draft, as alone: lookup_costs')
                (u.round.requested, d, min(u.round.accepted, d))
                for i, u in done.items()
                if not u.round.forced and i not in lookup_ids
                for d in [u.round.drafted - u.round.filled]
            ]
            self.curve.update(len(rows), self.timing, outcomes, timed)
        elif self.curve is not None and timed:
            self.curve.update_plain(len(rows), self.timing)
        for i, match in lookup_ids.items():
            r = done[i].round
            if r.drafted:
                self.lookup_costs.update(match, r.drafted, r.accepted, self.timing.verify_seconds)
        return updates
