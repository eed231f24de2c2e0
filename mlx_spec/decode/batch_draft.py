"""A `BatchDecoder`'s round: what each row proposes, its verification and what it keeps.

`BatchRound` is the half of `BatchDecoder` (batch.py) that runs between the joins and leaves:
every row's proposal (`_proposals`, `_guess`: a grammar's forced tokens, prompt lookup, the
draft model's batched steps in `_draft`, a head's in batch_head.py), each row's verification on
its own rows of the one target pass (`_verify_rows`, by the single stream's `rounds.verify`)
and what each row keeps and forgets after it (`_finish_round`).

A row with nothing to propose (lookup found no match, or its reply ends next token) costs no
draft steps; in the verify pass it is padded to the batch's widest proposal. Grouping rows by
k instead would take one pass per group, each reading all the weights again: in the
memory-bound regime where speculation pays, a pass costs far more than its padded rows. When
no row proposes anything the round is a plain step, one row of width 1 per request.

Suffix rows (`--drafter suffix`, `suffix+<kind>`: a row lookup that knows its match) are not
bound by k: where a row's match supports a long draft, `_lookups` widens the pass as far as
`batch_policy.lookup_width` says the rows' expected tokens pay for it (the pass's measured cost
over B x (W+1) rows, the looked-up tokens' acceptance by match length: lookup_length.py), the
other rows padded as above. Beside a head the looked-up rows skip the head's steps (their
guesses join its drafts: `beside`); beside a draft model the draft is fed them (one lag for
all rows), a step a column, which the width's cost counts. Those rows' rounds teach the
decoder's `lookup_costs`, not the controller's k, as alone.

A recurrent target (docs/design.md): no padding in a pass, which would enter a row's state.
Each row feeds its unfed tokens (a replay, then its last), its guesses and fillers (the draft
model's own further picks, then its last token repeated, verified like any guess) up to one
width (`batch_rows.fill`); a row keeps at most what the draft model was fed (the rest is
replayed); a row that rejected anything has its recurrent state restored for its row only
(`batch_caches.restore_rows`), its KV layers forget the whole pass and its kept tokens are replayed
next round (`Row.unfed`, as `engine.Decoder.unfed`; past REPLAY_LIMIT it drafts nothing). A
seeded sampled row verifies its own guesses only (its fillers are never kept: it replays past
them) and judges its replay limit by what it would replay alone, so its key splits as alone's
and it draws the same samples (`Row.seeded`); other rows keep fillers the target agrees with.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..core import batch_caches
from ..core.batch_caches import rollback_rows
from ..core.batch_policy import lookup_width
from ..core.grammar import GrammarStateError
from ..core.lookup_length import expected_tokens as lookup_tokens
from ..core.payoff import expected_tokens
from ..core.policies import FIXED_LOOKUP_MATCH
from ..core.processors import apply as apply_processors
from ..core.sampling import probabilities, sample
from ..errors import SpecError
from .batch_rows import Row, RowUpdate, draft_tail, fill, filled_q
from .engine import REPLAY_LIMIT  # a recurrent row's replay past which it drafts nothing
from .rounds import Round, cut_at_end, read_logprobs, target_logprobs, verify

FORCED_MAX = 8  # the most forced tokens a row drafts in a round (engine.FORCED_MAX)
# a recurrent target's widest pass with lookups (replay and guesses of a row): half what a
# window keeps for a roll-back (caches.WINDOW_MARGIN, 128), as the one-stream draft's 64
RECURRENT_PASS_MAX = 64
# a draft step's cost before one is measured, as a share of a pass (suffix rows' lookup widths)
PRIOR_DRAFT_SHARE = 0.1


def beside(drafts: mx.array, lengths: list[int], looked: dict) -> tuple[mx.array, list[int]]:
    """A head's (B, K) drafts with the looked-up rows' guesses in their rows ({row: (match,
    guess)}), as wide as the widest: (B, K'), each row's length (the rest is padding)."""
    picks, lengths = drafts.tolist(), list(lengths)
    for b, (_, guess) in looked.items():
        picks[b], lengths[b] = list(guess), len(guess)
    width = max(len(p) for p in picks)
    return mx.array([p + [0] * (width - len(p)) for p in picks], mx.uint32), lengths


class BatchRound:
    """What `BatchDecoder` (batch.py) does in a round, over the state it holds (its rows,
    caches, drafters and lag: see its invariants)."""

    def _guarded(self, row: Row, call, fallback, *args):
        """`call(*args)` for one row's processors or grammar; when its grammar cannot go on
        (GrammarStateError, SpecError) the row fails alone: it leaves at the end of the
        round with its error, the others' round is unchanged (`fallback` stands in)."""
        try:
            return call(*args)
        except (GrammarStateError, SpecError) as err:
            self.failed.setdefault(row.id, err)
            return fallback

    def _proposals(self, k: int) -> tuple:
        """How many tokens each row asks for at `k` (requested), the rows whose grammar
        forces tokens (forced: row -> tokens), those and the rows lookup found a guess for
        beside a draft model (overrides: row -> tokens), each drafting row's draft key, and
        the suffix rows that look up this round (looked: row -> (match, tokens): `_lookups`)."""
        rows = self.rows
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
        looked = self._lookups(requested, forced, ending) if self.suffix else {}
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
        return requested, forced, overrides, draft_keys, looked

    def _lookups(self, requested, forced, ending) -> dict[int, tuple[int, list[int]]]:
        """Suffix rows whose lookup draft this round pays, {row: (match length, guess)}: as
        long as the pass's cost says (`batch_policy.lookup_width`, past the batch's k and
        K_MAX up to what the match supports), where its expected tokens beat the row's own
        k-draft (beside a head or a draft model; with a fixed k, only matches of
        FIXED_LOOKUP_MATCH tokens or more, as alone); a suffix row alone only where it goes
        past the k it drafts anyway. The output stays the target's: the costs are past
        rounds', and every guess is verified."""
        rows = self.rows
        rival_kind = self.draft is not None or self.heads is not None
        # a recurrent target feeds every row its replay and fillers up to one common width,
        # which a roll-back undoes: lookups keep that pass within RECURRENT_PASS_MAX (a seeded
        # row, which keeps no fillers, replays a whole round's width after each)
        room = RECURRENT_PASS_MAX - max(r.unfed for r in rows) if self.recurrent else None
        found = {}
        for b, r in enumerate(rows):
            if not r.use_draft or b in forced or b in ending or r.lookup is None:
                continue
            match, reach = r.lookup.suffix_match()
            reach = min(reach, r.max_tokens - r.emitted - 1)
            if room is not None:
                reach = min(reach, room)
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

    def _guess(self, drafting: bool, requested, draft_keys, forced, overrides, looked) -> tuple:
        """Every row's guesses: (B, K) ids (K the widest, the rest padding), per row its
        q (k_i, V) or None and its length k_i, the draft steps taken, and the guesses as lists
        when no model drafted (None when one did). Beside a head, the `looked` rows' guesses
        join the head's drafts (it drafts the others only)."""
        rows = self.rows
        if not drafting:  # forced tokens and lookup only
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
            return drafts, [None] * len(rows), lengths, 0, guesses
        # (B, K), per row (k_i, V) | None, and k_i after a confidence stop
        by_head = self.heads is not None and bool(looked)
        if by_head:
            requested = [0 if b in looked else q for b, q in enumerate(requested)]
            draft_keys = [None if b in looked else key for b, key in enumerate(draft_keys)]
        drafts, qs, lengths = self._draft(requested, draft_keys, overrides)
        block = self.heads is not None and self.heads.kind.block
        steps = 1 if block else drafts.shape[1]  # a block head: one forward
        # a sync between draft and verify (the pass waits on the draft anyway): the
        # controller learns the two costs apart
        mx.eval(drafts, *[q for q in qs if q is not None])
        if by_head:
            drafts, lengths = beside(drafts, lengths, looked)
        return drafts, qs, lengths, steps, None

    def _fill(self, drafts: mx.array, lengths: list[int], guesses) -> list[list[int]]:
        """A recurrent target's pass per row, no padding (`fill`): after a model drafted, its
        own picks past a row's proposal fill first."""
        if guesses is not None:
            return fill(self.rows, guesses)
        picks = drafts.tolist()
        guesses = [p[:n] for p, n in zip(picks, lengths, strict=True)]
        return fill(self.rows, guesses, [p[n:] for p, n in zip(picks, lengths, strict=True)])

    def _verify_rows(self, passes, drafts, requested, lengths, qs, logits) -> tuple:
        """Each row verified on its own rows of the pass's logits: (B, 2) accepted counts and
        the target's tokens, and each row's log-probability arrays (or None), evaluated."""
        rows = self.rows
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
        return out, lps

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
                self.draft_states.append(batch_caches.snapshot(self.draft_cache))
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
                    self.draft_states.append(batch_caches.snapshot(self.draft_cache))
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
            batch_caches.restore_rows(self.cache, saved, restore)
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
                    batch_caches.restore_rows(self.draft_cache, self.draft_states[h], rows_of_h)
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
