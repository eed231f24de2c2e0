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
(`ONE_OFFSET`: gpt_bigcode, Llama 4's chunked attention) run row by row, each row on its own
single-stream caches (`batch_caches.RowsCache`, `RowWise`): exact, not faster. A head beside a
recurrent target takes the features of each row's kept tokens from where its last token sits
in the pass (after its replay): `BatchHead.take`'s starts.
Each round (`step`):

1. every row proposes up to k tokens: the draft model batched the same way (one forward over the
   B rows per draft step), an EAGLE-3 head or an MTP layer (one head pass over the rows per
   step, from the target layers the last verify pass captured: batch_head.py), a DFlash head
   (one forward drafts every row's block), or prompt lookup in the row's own context; a
   suffix row (suffix decoding) may look up past k (below);
2. ONE target pass over (B, K+1) tokens, K the longest proposal: `[last, x1..xk, pad..]` a row;
3. each row is verified on its own rows of logits by the function the single stream uses
   (`rounds.verify`) under its own sampling settings and random key, which
   it splits exactly as `engine.Decoder` does, so a seeded row samples what it would alone;
4. each row forgets what it rejected (`rollback_rows`).

Rows join between rounds (`add`: prefilled alone, then merged in) and leave when they finish or
are cancelled (`cancel`, `remove`). Every row's output is the target's, whatever runs beside it.

Kept caches (the server's prompt cache): a row may start from a kept single-stream
`engine.Decoder` whose sequence shares a prefix with its prompt (`add(..., kept=decoder)`): the
decoder's target and draft caches are trimmed to that prefix and only the rest is prefilled.
A row added with `keep=True` hands its caches back when it leaves (`RowState`:
`RowUpdate.state`, or `remove`'s result), extracted from the batch (mlx-lm's
`BatchKVCache.extract`, which drops the row's left padding), and `into_decoder` turns them into
a decoder a single stream or a later row continues from. Every length is checked against the
invariants below; a cache that does not hold what they say raises SpecError.

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

A recurrent target (docs/design.md): no padding in a pass, which would enter a row's state.
Each row feeds its unfed tokens (a replay, then its last), its guesses and fillers (the draft
model's own further picks, then its last token repeated, verified like any guess) up to one
width; a row keeps at most what the draft model was fed (the rest is replayed); a row that
rejected anything has its recurrent state restored for its row only (`caches.restore_rows`),
its KV layers forget the whole pass and its kept tokens are replayed next round (`Row.unfed`,
as `engine.Decoder.unfed`; past REPLAY_LIMIT it drafts nothing). A seeded sampled row verifies
its own guesses only (its fillers are never kept: it replays past them) and judges its replay
limit by what it would replay alone, so its key splits as alone's and it draws the same samples
(`Row.seeded`); other rows keep fillers the target agrees with.

A row with nothing to propose (lookup found no match, or its reply ends next token) costs no
draft steps; in the verify pass it is padded to the batch's widest proposal. Grouping rows by
k instead would take one pass per group, each reading all the weights again: in the
memory-bound regime where speculation pays, a pass costs far more than its padded rows. When
no row proposes anything the round is a plain step, one row of width 1 per request.

Suffix rows (`--drafter suffix`, `suffix+<kind>`: a row lookup that knows its match) are not
bound by k: where a row's match supports a long draft, `_lookups` widens the pass as far as
`batch_policy.lookup_width` says the rows' expected tokens pay for it (the pass's measured cost
over B x (W+1) rows, the looked-up tokens' acceptance by match length, lookup_length.py), the
other rows padded as above. Beside a head the looked-up rows skip the head's steps (their
guesses join its drafts: `beside`); beside a draft model the draft is fed them (one lag for
all rows), a step a column, which the width's cost counts. Those rows' rounds teach
`lookup_costs`, not the controller's k, as alone.

Threads: one thread owns the MLX arrays (streams are per thread, threads.py). A server worker
thread calls `add`, `step` and `cancel`'s effect from that thread; `cancel` itself only marks
the row, so another thread may call it; the row leaves at the start of the next `step`.

Over 600 lines: `BatchDecoder` holds B rows' round (verification and the end-token cut are
rounds.py's, shared with the single stream; a head's drafting is batch_head.py's) with what each
row brings: its processors and grammar (forced tokens), log-probabilities, a draft model's
per-row confidence stop, lookup beside a draft model, a recurrent target's one-width passes
(fillers, replays, per-row restores), and the batched caches' bookkeeping as rows join and
leave.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    make_prompt_cache,
)
from mlx_lm.utils import common_prefix_len

from ..core import caches
from ..core.batch_caches import (  # noqa: F401  (check_batchable, merge_layer: batch's API)
    ONE_OFFSET,
    RowWise,
    check_batchable,
    extract_layer,
    merge_layer,
    merge_rows,
    rollback_rows,
    unmasked,
)
from ..core.batch_policy import BatchController, lookup_width
from ..core.caches import WindowedKVCache, prefill_cache
from ..core.grammar import GrammarStateError, grammar_of
from ..core.hidden import capturing
from ..core.lookup_length import LookupCosts
from ..core.lookup_length import expected_tokens as lookup_tokens
from ..core.payoff import expected_tokens
from ..core.policies import (
    FIXED_LOOKUP_MATCH,
    Auto,
    DraftLength,
    Fixed,
    draft_length,
)
from ..core.processors import apply as apply_processors
from ..core.sampling import SamplingParams, probabilities, random_key, sample
from ..drafters.ngram import NGramDrafter
from ..errors import SpecError
from ..pairs.config import is_int
from .batch_assistant import batch_head
from .config import GenerationConfig
from .engine import REPLAY_LIMIT  # a recurrent row's replay past which it drafts nothing
from .prompts import check_token_ids, request_processors
from .rounds import (
    Round,
    cut_at_end,
    pad_vocab,
    point_mass,
    read_logprobs,
    target_logprobs,
    verify,
)

# a draft step's cost before one is measured, as a share of a pass (suffix rows' lookup widths)
PRIOR_DRAFT_SHARE = 0.1
FORCED_MAX = 8  # the most forced tokens a row drafts in a round (engine.FORCED_MAX)

# Tokens the draft missed (plain rounds) that ride along in a drafting round's first step; more
# get a pass of their own, kept out of the round's timing: the controller would otherwise take
# a long catch-up for the cost of a draft step (a compute-bound draft: one step per token).
CATCH_UP_RIDES = 4


@dataclass
class Row:
    """One request in the batch."""

    id: int
    sequence: list[int]  # prompt + emitted tokens (+ the end-of-sequence token, if one ended it)
    params: SamplingParams
    max_tokens: int
    key: mx.array | None  # None: greedy rows draw nothing
    use_draft: bool = True
    lookup: NGramDrafter | None = None
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


def _held(cache: list, tokens: int, what: str) -> None:
    """Every layer holds `tokens` entries (a sliding-window layer: has taken them in, its
    oldest maybe dropped), or SpecError (a cache that is not what it says)."""
    sizes = {
        c.offset if isinstance(c, WindowedKVCache | caches.MarginChunkedKVCache) else c.size()
        for c in caches._leaves(cache)
        if not isinstance(c, ArraysCache)  # (a recurrent state has no length to check)
    }
    if sizes and sizes != {tokens}:
        raise SpecError(f"the {what} cache holds {sorted(sizes)} tokens, not {tokens}")


def _plain(cache: list, what: str, recurrent: bool = False) -> None:
    kinds = (KVCache, WindowedKVCache, caches.MarginChunkedKVCache)
    kinds += (ArraysCache,) if recurrent else ()
    if any(type(c) not in kinds for c in caches._leaves(cache)):
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
    _plain(cache, "target", recurrent=True)  # (a recurrent state: `prompt` extends it)
    _held(cache, len(held), "kept target")
    reuse = min(common_prefix_len(held, prompt), len(prompt) - 1)
    if not caches.can_rollback(cache, len(held) - reuse):
        return None, 0, None, 0  # a window cannot forget that much: the row starts afresh
    caches.rollback(cache, len(held) - reuse)
    _held(cache, reuse, "kept target")
    if draft_held is None or draft is None:
        return cache, reuse, None, 0
    draft_cache, cached = draft
    _plain(draft_cache, "draft", recurrent=True)  # (a recurrent one: draft_held extends it)
    _held(draft_cache, len(cached), "kept draft")
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
    _held(state.cache, len(state.sequence) - state.unfed, "row's target")
    draft = None
    if state.draft_cache is not None:
        _held(state.draft_cache, len(state.draft_tokens), "row's draft")
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


def beside(drafts: mx.array, lengths: list[int], looked: dict) -> tuple[mx.array, list[int]]:
    """A head's (B, K) drafts with the looked-up rows' guesses in their rows ({row: (match,
    guess)}), as wide as the widest: (B, K'), each row's length (the rest is padding)."""
    picks, lengths = drafts.tolist(), list(lengths)
    for b, (_, guess) in looked.items():
        picks[b], lengths[b] = list(guess), len(guess)
    width = max(len(p) for p in picks)
    return mx.array([p + [0] * (width - len(p)) for p in picks], mx.uint32), lengths


@dataclass
class BatchTiming:
    """The last round's measured parts (what the controller learns from)."""

    rows: int = 0  # target rows in the verify pass: B x (K+1)
    draft_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # the pass, its verification and the roll-back after it


class BatchDecoder:
    """Speculative decoding over a batch of requests that join and leave between rounds.

    `draft`: a draft model (batched like the target); `head`: an EAGLE-3 head, the
    target's MTP layer, a DFlash head or Gemma 4's assistant (batch_head.py; beside suffix
    lookup only); `lookup`: (ngram_max, ngram_min) for prompt lookup per row (beside a draft
    model: lookup first, the model where it finds nothing: ngram+model), or a kind's row
    lookup made from the row's history (suffix decoding: past k where it pays, `_lookups`);
    neither: plain continuous batching.
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
        # a recurrent target (Qwen3.5, Qwen3-Next, Mamba): rows restored and replayed
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
        return self._extract(self._index(row_id))

    def _extract(self, i: int) -> RowState:
        """Row i's caches as single-row KVCaches (evaluated: nothing lazy points into the
        batch's arrays). The target's hold sequence[:-1]; the draft's sequence[:-lag], or
        nothing is kept of it when the row did not draft (its row is not its text)."""
        row = self.rows[i]
        cache = [extract_layer(c, i) for c in self.cache]
        _held(cache, len(row.sequence) - row.unfed, "batch row's target")
        draft_cache, draft_tokens = None, []
        # (a one-token prompt's draft row holds the token twice: not a prefix of its sequence;
        # a draft cache never fed, as a lone 2-token prompt that ends at once leaves it, holds
        # nothing to hand back: mlx-lm's extract fails on its empty keys)
        fed = self.draft_cache is not None and all(
            getattr(c, "keys", True) is not None for c in caches._leaves(self.draft_cache)
        )
        if self.draft is not None and row.use_draft and row.prompt_tokens >= 2 and fed:
            draft_cache = [extract_layer(c, i) for c in self.draft_cache]
            draft_tokens = row.sequence[: len(row.sequence) - self.lag]
            _held(draft_cache, len(draft_tokens), "batch row's draft")
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
        for c in caches._leaves(self.cache):
            if isinstance(c, ArraysCache):
                unmasked(c, len(self.rows))
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

    def _lookups(self, rows, requested, forced, ending) -> dict[int, tuple[int, list[int]]]:
        """Suffix rows whose lookup draft this round pays, {row: (match length, guess)}: as
        long as the pass's cost says (`batch_policy.lookup_width`, past the batch's k and
        K_MAX up to what the match supports), where its expected tokens beat the row's own
        k-draft (beside a head or a draft model; with a fixed k, only matches of
        FIXED_LOOKUP_MATCH tokens or more, as alone); a suffix row alone only where it goes
        past the k it drafts anyway. The output stays the target's: the costs are past
        rounds', and every guess is verified."""
        rival_kind = self.draft is not None or self.heads is not None
        found = {}
        for b, r in enumerate(rows):
            if not r.use_draft or b in forced or b in ending or r.lookup is None:
                continue
            match, reach = r.lookup.suffix_match()
            reach = min(reach, r.max_tokens - r.emitted - 1)
            short = rival_kind and self.fixed_k is not None and match < FIXED_LOOKUP_MATCH
            if match > 0 and reach > 0 and not short:
                found[b] = (self.lookup_costs.acceptance(match), reach)
        if not found:
            return {}
        curve, batch = self.curve, len(rows)
        acceptance = curve.acceptance()
        own, rival = [], []  # what each row drafts without a lookup past k, and its tokens
        for b, req in enumerate(requested):
            if not rival_kind:  # its own lookup within k (nothing: no match)
                n = min(found[b][1], req) if b in found and b not in forced else 0
                n = len(forced[b]) if b in forced else n
                a = found[b][0] if b in found else acceptance[0]
                own.append(n)
                rival.append(lookup_tokens(a, n) if b in found else expected_tokens([a] * n))
            else:
                own.append(req)
                rival.append(expected_tokens(acceptance[:req]))
        # (not measured yet: None, the prior slope over a pass of the batch)
        pass_seconds = curve.pass_seconds if curve.pass_seconds(batch) is not None else None
        draft_step = curve.draft_seconds(batch) if pass_seconds is not None else None
        if draft_step is None:  # (not measured yet: a share of a pass of the batch)
            plain = pass_seconds(batch) if pass_seconds is not None else 1.0
            draft_step = PRIOR_DRAFT_SHARE * plain if curve.draft_model else 0.0
        block = self.heads is not None and bool(self.heads.kind.block)
        fed = self.draft is not None
        chosen = lookup_width(own, rival, found, pass_seconds, draft_step, fed, block)
        looked = {}
        for b, n in chosen.items():
            if rival_kind or n > own[b]:
                guess = rows[b].lookup.lookup(n)
                if guess:
                    looked[b] = (rows[b].lookup.suffix_match()[0], guess)
        return looked

    def _guarded(self, row: Row, call, fallback, *args):
        """`call(*args)` for one row's processors or grammar; when its grammar cannot go on
        (GrammarStateError, SpecError) the row fails alone: it leaves at the end of the
        round with its error, the others' round is unchanged (`fallback` stands in)."""
        try:
            return call(*args)
        except (GrammarStateError, SpecError) as err:
            self.failed.setdefault(row.id, err)
            return fallback

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
        # the round adds at most k+1 tokens to a row: never draft past its max_tokens
        requested = [
            min(k, r.k_max or k, r.max_tokens - r.emitted - 1)
            if r.use_draft and (self.heads is None or self.heads.can_draft(b))
            else 0
            for b, r in enumerate(rows)
        ]
        # a recurrent target: a row whose replay is long drafts nothing, so its pass cannot be
        # rejected and the replay ends (engine.REPLAY_LIMIT)
        ending = {b for b, r in enumerate(rows) if self.recurrent and r.replay() > REPLAY_LIMIT}
        for b in ending:
            requested[b] = 0
        # where a row's grammar forces the next tokens, they are its draft this round (no
        # model, outside the policy), as a single stream drafts them
        forced = {}
        for b, r in enumerate(rows):
            if r.grammar is not None and b not in ending:
                limit = min(FORCED_MAX, r.max_tokens - r.emitted - 1)
                guess = self._guarded(r, r.grammar.forced, [], r.sequence, limit)
                if guess:
                    forced[b] = guess
                    requested[b] = len(guess)
        # lookup and a draft model (ngram+model): lookup first, the model where it finds
        # nothing; the draft is fed a looked-up guess as it would be its own
        overrides = dict(forced)
        # suffix rows: a lookup draft where the cost says it pays, past k where it does
        looked = self._lookups(rows, requested, forced, ending) if self.suffix else {}
        for b, (_, guess) in looked.items():
            requested[b] = len(guess)
            if self.draft is not None:  # fed to the draft as its own (one lag for all rows)
                overrides[b] = guess
        if self.lookup is not None and self.draft is not None and not self.suffix:
            for b, r in enumerate(rows):
                if b not in overrides and requested[b]:
                    guess = r.lookup.lookup(requested[b])
                    if guess:
                        overrides[b] = guess
                        requested[b] = len(guess)
        # keys in single-stream order: a drafting row draws the draft's key first
        draft_keys = [
            r.next_key() if req and not r.params.greedy else None
            for r, req in zip(rows, requested, strict=True)
        ]
        models = self.draft is not None or self.heads is not None
        # a head drafts the other rows only (a looked-up row's guesses join after: `_beside`)
        by_head = self.heads is not None and looked
        head_requested = [0 if by_head and b in looked else q for b, q in enumerate(requested)]
        drafting = models and max(head_requested) > 0
        if drafting and self.draft is not None and self.lag > 2 + CATCH_UP_RIDES:
            self._catch_up()
        start = time.perf_counter()
        qs = [None] * len(rows)
        steps = 0
        if drafting:
            # (B, K), per row (k_i, V) | None, and k_i after a confidence stop
            keys = [None if by_head and b in looked else key for b, key in enumerate(draft_keys)]
            drafts, qs, lengths = self._draft(head_requested, keys, overrides)
            block = self.heads is not None and self.heads.kind.block
            steps = 1 if block else drafts.shape[1]  # a block head: one forward
            # a sync between draft and verify (the pass waits on the draft anyway): the
            # controller learns the two costs apart
            mx.eval(drafts, *[q for q in qs if q is not None])
            if by_head:
                drafts, lengths = beside(drafts, lengths, looked)
        else:
            guesses = [
                forced[b]
                if b in forced
                else looked[b][1]
                if b in looked
                else r.lookup.lookup(req)
                if r.lookup is not None and req
                else []
                for b, (r, req) in enumerate(zip(rows, requested, strict=True))
            ]
            lengths = [len(g) for g in guesses]
            width = max(lengths)
            drafts = mx.array([g + [0] * (width - len(g)) for g in guesses], mx.uint32)
        drafted_at = time.perf_counter()
        width = drafts.shape[1]  # K: the widest proposal; the rest of a row is padding
        saved = passes = None
        if self.recurrent:  # no padding: each row's unfed tokens, guesses, then fillers
            saved = caches.snapshot(self.cache)
            if drafting:
                picks = drafts.tolist()
                guesses = [p[:n] for p, n in zip(picks, lengths, strict=True)]
                passes = fill(rows, guesses, [p[n:] for p, n in zip(picks, lengths, strict=True)])
            else:
                passes = fill(rows, guesses)
            inputs = mx.array(
                [r.sequence[-r.unfed :] + x for r, x in zip(rows, passes, strict=True)],
                mx.uint32,
            )
        else:
            last = mx.array([[r.sequence[-1]] for r in rows], mx.uint32)
            inputs = mx.concatenate([last, drafts.astype(mx.uint32)], axis=1) if width else last
        with capturing(self.target, self.hidden_layers) as hidden:  # (a head's layers)
            logits = self.target_pass(inputs, cache=self.cache)  # (B, K+1, vocab)
        # a processor reads the row's proposal as ids (a grammar walks it): read once
        proposals = drafts.tolist() if any(r.processors for r in rows) else None
        outs, lps = [], []
        for b, r in enumerate(rows):
            if passes is not None:  # its rows of logits after its replay; fillers verified too,
                # but a seeded row's: its own guesses only, as alone
                x = passes[b][: lengths[b]] if r.seeded else passes[b]
                q = qs[b] if r.seeded or qs[b] is None else filled_q(qs[b], x, lengths[b])
                asked = requested[b] if r.seeded else len(x)
                x_ids = mx.array(x, mx.uint32)
                out, lp = self._verify(r, asked, len(x), x_ids, logits[b, r.unfed - 1 :], q, x)
            else:
                proposal = proposals[b][: lengths[b]] if proposals is not None else None
                out, lp = self._verify(
                    r, requested[b], lengths[b], drafts[b], logits[b], qs[b], proposal
                )
            outs.append(out)
            lps.append(lp)
        out = mx.stack(outs)  # (B, 2): accepted n, the target's token
        arrays = [a for lp in lps if lp is not None for a in lp if a is not None]
        mx.eval(out, drafts, *arrays, *[r.key for r in rows if r.key is not None])
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

    def _verify(self, r: Row, requested: int, k: int, drafts, logits, q, proposal=None):
        """(2,) int32: accepted count and the target's token, for one row, and its
        log-probability arrays when it asked for them (None), all lazy. `proposal`: the
        row's k draft ids as a list (read for its processors)."""
        logits = logits[: k + 1]  # (k+1, vocab)
        params = r.params
        x = drafts[:k].astype(mx.uint32)  # (k,)
        if r.processors:  # row i: after sequence + x1..xi, as the draft's path had it
            logits = self._guarded(
                r, apply_processors, logits, r.processors, r.sequence, proposal, logits
            )
        if requested == 0:  # a plain step, as single-stream decodes its reply's last token
            if params.greedy:
                token = mx.argmax(logits[0], axis=-1)
            else:
                token = sample(probabilities(logits[0], params), r.next_key())
            n = mx.array(0)
        else:
            key = None if params.greedy else r.next_key()
            n, token = verify(x, logits, params, q[:k] if q is not None else None, key)
        lp = None
        if r.logprobs is not None:  # row i emits x_(i+1) while i < n, then the target's
            rows = mx.concatenate([x.astype(mx.int32), mx.zeros((1,), mx.int32)])
            rows = mx.where(mx.arange(k + 1) == n, token.astype(mx.int32), rows)
            lp = target_logprobs(logits, rows, r.logprobs)
        return mx.stack([n.astype(mx.int32), token.astype(mx.int32)]), lp

    def _draft(self, requested: list[int], keys: list, forced: dict) -> tuple:
        """max(requested) batched draft steps: (B, K) tokens, each stochastic row's q
        (requested_i, vocab) (None for greedy rows) and each row's length (requested_i, or
        shorter where the draft_confidence stop cut it, as ModelDrafter.propose does alone).
        The first step feeds every row's last `lag` tokens (the draft's catch-up after plain
        rounds rides along in it). A row in `forced` (row -> tokens its grammar forces, or
        lookup found) takes those instead of the draft's picks (a point mass: q None), and
        the draft is fed them as it would be alone."""
        rows, width = self.rows, max(requested)
        sure = []  # per step, each row's top draft probability (the confidence stop's)
        sub = [
            mx.random.split(key, req) if key is not None and b not in forced else None
            for b, (key, req) in enumerate(zip(keys, requested, strict=True))
        ]
        heads = self.heads
        whole = {}  # a block head's sampled rows: drawn at once, as DFlashDrafter draws them
        if heads is not None:  # the pending features first
            sequences = [r.sequence for r in rows]
            heads.feed(sequences)
            if heads.kind.block and not heads.kind.chained:  # (DSpark's: step by step)
                for b, r in enumerate(rows):
                    if sub[b] is not None and not r.processors:
                        whole[b], sub[b] = keys[b], None
        else:
            y = mx.array([draft_tail(r, self.lag) for r in rows], mx.uint32)  # (B, lag)
            self.draft_states = []
            if self.draft_recurrent:
                # a recurrent state cannot forget, and a row that keeps none of this round's
                # guesses must go back to before the tail's last token: the tail's other
                # tokens go in a pass of their own (one extra draft pass a round), then every
                # step's state is kept (draft_states[h]: sequence[:-2] of a row that keeps h)
                self.draft_pass(y[:, :-1], cache=self.draft_cache)
                y = y[:, -1:]
                self.draft_states.append(caches.snapshot(self.draft_cache))
        columns, qs = [], [[] for _ in rows]
        for j in range(width):
            processed = [
                b
                for b, r in enumerate(rows)
                if r.processors and j < requested[b] and b not in forced
            ]  # rows whose draft sees their processors, as a single stream's does

            def process(logits, processed=processed):  # (B, vocab) -> (B, vocab)
                if self.vocab is not None and logits.shape[-1] > self.vocab:
                    logits = logits[:, : self.vocab]  # padding rows the target cannot embed
                if not processed:
                    return logits
                rows_logits = [logits[b] for b in range(len(rows))]
                for b in processed:
                    so_far = mx.stack([c[b] for c in columns]) if columns else []
                    rows_logits[b] = self._guarded(
                        rows[b], apply_processors, logits[b], rows[b].processors,
                        rows[b].sequence, so_far, logits[b],
                    )  # fmt: skip
                return mx.stack(rows_logits)

            before = columns[-1] if j else None  # the guesses of step j - 1 (B,)
            if heads is not None and heads.kind.selects:  # processed before it selects
                logits = heads.draft_logits(j, before, sequences, width, process)
            elif heads is not None:  # (B, vocab)
                logits = process(heads.draft_logits(j, before, sequences, width))
            else:
                logits = process(self.draft_pass(y, cache=self.draft_cache)[:, -1])  # (B, vocab)
                if self.draft_recurrent:
                    self.draft_states.append(caches.snapshot(self.draft_cache))
            picks = mx.argmax(logits, axis=-1)  # (B,)
            if self.confidence > 0:
                top = mx.softmax(logits.astype(mx.float32), axis=-1).max(axis=-1)  # (B,)
            if j == 0 and whole:
                block = heads.block(self.vocab)  # (B, K, vocab)
                for b, key in whole.items():  # every guess of the row's block, one key
                    q = probabilities(block[b, : requested[b]], rows[b].params)
                    whole[b] = (sample(q, key), q)
            if any(
                (s is not None or b in whole) and j < req
                for b, (s, req) in enumerate(zip(sub, requested, strict=True))
            ):
                column, tops = [], []
                for b, r in enumerate(rows):
                    if b in whole and j < requested[b]:
                        column.append(whole[b][0][j].astype(picks.dtype))
                        qs[b].append(whole[b][1][j])
                        tops.append(None)
                    elif sub[b] is not None and j < requested[b]:
                        q = probabilities(logits[b], r.params)
                        qs[b].append(q)
                        column.append(sample(q, sub[b][j]).astype(picks.dtype))
                        tops.append(q.max() if self.confidence > 0 else None)
                    else:  # greedy, or past this row's k (its guess there is padding)
                        column.append(picks[b])
                        tops.append(top[b] if self.confidence > 0 else None)
                picks = mx.stack(column)
                if self.confidence > 0:
                    top = mx.stack(tops)
            if self.confidence > 0:
                sure.append(top)
            overrides = {b: guess[j] for b, guess in forced.items() if j < len(guess)}
            if overrides:
                picks = mx.where(
                    mx.array([b in overrides for b in range(len(rows))]),
                    mx.array([overrides.get(b, 0) for b in range(len(rows))], picks.dtype),
                    picks,
                )
            columns.append(picks)
            y = picks[:, None].astype(mx.uint32)
            mx.async_eval(y)  # the device starts while Python builds the next step
        if heads is None:
            self.lag = 2  # after the roll-back (`_finish_round`)
        lengths = list(requested)
        if sure:  # a row stops after the first guess below the confidence (then step j + 1)
            below = (mx.stack(sure, axis=1) < self.confidence).tolist()  # (B, K)
            for b, row_below in enumerate(below):
                if b not in forced:
                    cut = next((j + 1 for j in range(lengths[b] - 1) if row_below[j]), None)
                    lengths[b] = cut if cut is not None else lengths[b]
        return mx.stack(columns, axis=1), [mx.stack(q) if q else None for q in qs], lengths

    def _finish_round(
        self, out, drafted, requested, lengths, steps, lps, forced, overrides, hidden=None,
        saved=None,
    ) -> dict[int, RowUpdate]:  # fmt: skip
        """`saved`: a recurrent target's snapshot from before the pass (`drafted`: each row's
        whole pass after its unfed tokens, fillers included)."""
        rows, updates, keep = self.rows, {}, []
        width = len(drafted[0]) if drafted else 0
        held = []  # per row, the round's draft tokens its caches keep
        restore, forget = [], []  # recurrent: rows restored, entries each row forgets
        # where each row's last token sits in the pass (a recurrent row's replay comes first)
        starts = [r.unfed - 1 if saved is not None else 0 for r in rows]
        for b, (r, (n, token)) in enumerate(zip(rows, out, strict=True)):
            if r.id in self.failed:  # it leaves with its error; nothing of the round is its
                held.append(0)
                restore.append(False)
                forget.append(0)
                rnd = Round([], 0, 0)
                updates[r.id] = RowUpdate([], rnd, True, "error", error=self.failed[r.id])
                continue
            fed = lengths[b] if saved is None else len(drafted[b])  # fillers too
            k = lengths[b] if r.seeded else fed  # (a seeded row's fillers are never kept)
            proposal = drafted[b][:k]
            kept = proposal[:n] + [token]
            replayed = 0
            if saved is not None:  # fillers may run past its max_tokens: those are forgotten
                kept = kept[: r.max_tokens - r.emitted]
                if self.draft is not None:  # and past what the draft was fed: forgotten too
                    kept = kept[: steps + 1]
            kept, stop = cut_at_end(kept, self.eos)
            held.append(len(kept) - 1)
            if saved is not None:
                # kept every token it fed: its state stays; else it goes back to before the
                # pass, its KV layers forget the whole pass and the kept tokens are replayed
                replayed, whole = r.unfed - 1, len(kept) == fed + 1
                restore.append(not whole)
                forget.append(0 if whole else r.unfed + fed)
                r.unfed = 1 if whole else r.unfed + len(kept)
                alone = len(kept) == k + 1  # what a single stream would have replayed
                r.alone_unfed = 1 if alone else r.alone_unfed + len(kept)
            if r.lookup is not None:
                r.lookup.commit(kept)
            r.sequence += kept
            emitted = kept if stop is None else kept[:-1]
            r.emitted += len(emitted)
            logprobs = tops = None
            if lps[b] is not None:
                logprobs, tops = read_logprobs(lps[b], len(emitted))
            rnd = Round(
                tokens=emitted,
                accepted=n,
                drafted=k,
                finished=stop is not None,
                draft_steps=steps if requested[b] and b not in overrides else 0,
                requested=requested[b],
                plain=self.drafting and requested[b] == 0,
                proposal=proposal,
                target_token=token,
                logprobs=logprobs,
                top_logprobs=tops,
                forced=b in forced,
                replayed=replayed,
                filled=k - lengths[b] if saved is not None else 0,
            )
            done = stop is not None or r.emitted >= r.max_tokens
            reason = ("stop" if stop is not None else "length") if done else None
            updates[r.id] = RowUpdate(emitted, rnd, done, reason)
            if not done:
                keep.append(b)
        # each row fed its last token + K (padded) guesses and keeps the last and its held
        # drafts (n of them, fewer when an end token cut the round): its sequence but the last
        if saved is not None:
            caches.restore_rows(self.cache, saved, restore)
            rollback_rows(self.cache, forget)
        else:
            rollback_rows(self.cache, [width - h for h in held])
        if self.heads is not None:  # chained entries go, kept positions' features come
            self.heads.forget(max(steps - 1, 0))
            positions = [
                0 if r.id in self.failed else h + 1 for r, h in zip(rows, held, strict=True)
            ]
            self.heads.take(hidden, positions, [r.sequence for r in rows], starts)
        elif steps:  # the draft fed lag + K - 1 tokens; it keeps up to sequence[:-2]
            rollback_rows(self.draft_cache, [steps - h for h in held])
            for h in set(held) if self.draft_recurrent else ():  # (steps: the state now)
                if h < steps:
                    rows_of_h = [x == h for x in held]
                    caches.restore_rows(self.draft_cache, self.draft_states[h], rows_of_h)
            self.draft_states = []
        elif self.draft is not None:
            self.lag += 1  # a plain round: every row grew by one token the draft has not seen
        begin = time.perf_counter()  # (leaving rows' caches copied out: not the round's cost)
        for b, r in enumerate(rows):
            if r.keep and updates[r.id].done and r.id not in self.failed:
                updates[r.id].state = self._extract(b)
        self.extract_seconds = time.perf_counter() - begin
        self._keep(keep)
        if self.rows:
            self._settle()
        return updates
