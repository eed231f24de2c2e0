"""The decode loop of one stream: `Decoder` prefills, then runs rounds of draft -> one target
pass -> verify -> roll back, yielding token ids per round, one host sync per round (the step
generator of mlx_lm.generate's three layers; the stream and wrapper layers, `stream` and
`generate`, are generate.py's). The round's verification and end-token cut are rounds.py's,
shared with the batch (batch.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator

import mlx.core as mx
from mlx_lm.utils import common_prefix_len

from ..core import caches
from ..core.caches import prefill_cache
from ..core.hidden import capturing
from ..core.policies import DraftLength, FixedK, Policy
from ..core.processors import LogitsProcessor
from ..core.processors import apply as apply_processors
from ..core.sampling import SamplingParams, probabilities, random_key, sample
from ..drafters import Drafter, TargetOutput
from ..errors import Aborted, SpecError
from ..models import distributed
from .rounds import Round, cut_at_end, read_logprobs, target_logprobs, verify

# A recurrent target re-feeds the tokens of rejected rounds (see Decoder); past this many, the
# next round drafts nothing, so its pass cannot be rejected and the replay ends. Measured
# (benchmarks/hybrid_round_cost.py): limits 4, 8, 16 gave 10.6, 10.3, 12.2 ms per token.
REPLAY_LIMIT = 8
# The most forced tokens (grammar.py) one round drafts: they cost no model, and the target
# accepts nearly all of them, so the limit is the verify pass's width, not the policy's k.
FORCED_MAX = 8


def timed(r: Round, last: float, policy: Policy, update, outcome: tuple, more=()):
    """Yield round `r` after `update(*outcome, seconds, *more)` tells the policy its wall time
    since `last` (the previous round's end), then the caller's share of it (detokenizing,
    printing, sending: `policy.consumed`), which is in the next round's time and which plain
    decoding pays too (FixedK.plain_token). Returns the round's end, the next `last`."""
    now = time.perf_counter()  # before the yield: a caller may stop after any round
    update(*outcome, now - last, *more)
    yield r
    policy.consumed(time.perf_counter() - now)
    return now


class Decoder:
    """Speculative decoding over one target and an optional drafter.

    Between rounds the target cache holds every token of `sequence` except the last `unfed`
    ones, which are fed at the start of the next round. `unfed` is 1, except after a rejected
    round on a recurrent target (Qwen3.5, Mamba): its state cannot forget the rejected draft
    tokens, so it is restored to a snapshot from before the round and the kept tokens are
    replayed as a prefix of the next verify pass — extra rows in a pass that is memory-bound
    anyway, instead of a pass of their own. `sequence` keeps an end-of-sequence token when one
    ended generation, so a follow-up prompt that continues the conversation reuses the caches.
    """

    def __init__(self, target, drafter: Drafter | None, eos_token_ids=(), seed: int | None = None):
        self.target, self.drafter = target, drafter
        self.cache = self._new_cache()
        self.recurrent = caches.is_recurrent(self.cache)
        self.eos = set(eos_token_ids)
        self.sequence, self.unfed = [], 1  # (the class docstring says what unfed is)
        self.stale = False  # the caches may not match `sequence`: the next prefill starts over
        self.key = random_key(seed)
        mx.eval(self.key)  # nothing lazy may cross to the thread that generates (threads.py)
        self.pair = None  # the pair `make_decoder` made it for
        self.epoch = 0  # incremented by each stream that takes the decoder
        self.active = False  # a stream took it and has not finished cleanly
        self._policy, self._policy_key = None, None
        self.step_seconds = (None, None)  # a target and a draft step, timed in prefill
        self._drafting = False
        # the target layers whose outputs the drafter reads (none: a plain forward pass)
        self.hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
        # where the target last ran without handing the drafter its rows (a reply with
        # use_draft=False, a batch row): the next drafting prefill computes the target again
        # from there, so the drafter gets every position's features (None: nothing missing)
        self.hidden_gap: int | None = None

    def policy_for(self, length: DraftLength) -> Policy:
        """The draft-length policy; a controller is kept across calls with the same choice,
        so what it measured (costs, acceptance) carries over to the next turn."""
        if self._policy_key != length:
            limit = self.drafter.max_draft if self.drafter is not None else None
            self._policy, self._policy_key = length.policy(limit), length
        return self._policy

    def _forward(self, inputs, rows: int) -> tuple[mx.array, TargetOutput]:
        """The target over `inputs` (token ids, 1-d), extending the cache: the last `rows`
        rows of its logits (rows, vocab) and what the drafter reads of the pass (lazy)."""
        inputs = inputs if isinstance(inputs, mx.array) else mx.array(inputs, mx.uint32)
        with capturing(self.target, self.hidden_layers) as hidden:
            logits = self.target(inputs[None], cache=self.cache)[0, -rows:]
        fed = inputs.shape[0]
        return logits, TargetOutput(logits, {i: h[0] for i, h in hidden.items()}, fed, fed)

    def begin(self) -> int:
        """A new stream takes the decoder. One that did not finish (an exception, Ctrl-C, a
        generator kept open) may have left the caches mid-round: start over from the prompt."""
        if self.active:
            self.stale = True
        self.active = True
        self.epoch += 1
        return self.epoch

    def settle(self) -> None:
        """Evaluate everything the decoder keeps between replies (key, caches, drafter
        state): the next reply may run on another thread, where a lazy array cannot be
        evaluated (threads.py), and a graph kept across replies would only grow."""
        caches.eval_state(self.cache, self.key)
        if self.drafter is not None:
            self.drafter.settle()

    def _next_key(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub

    def _new_cache(self) -> list:
        return caches.make_cache(self.target, strict=self.drafter is not None)

    def fork(self) -> Decoder:
        """A new decoder at the same point: the same sequence, a copy of every cache
        (caches.copy: shared memory until either side writes) and of the drafter's state
        (Drafter.fork), of the draft-length policy and what it measured; a fresh key of its
        own (a fork changes nothing of this decoder, its key included). The two then go on
        apart, neither seeing the other's writes, so a kept decoder can be handed out (a copy
        of it) and kept. Refused mid-stream: the caches may be mid-round then. Everything it
        holds is evaluated (threads.py)."""
        if self.active:
            raise SpecError("a decoder cannot be forked while a stream is using it")
        twin = Decoder.__new__(Decoder)
        twin.target, twin.pair = self.target, self.pair
        twin.drafter = self.drafter.fork() if self.drafter is not None else None
        twin.cache = caches.copy(self.cache)
        twin.recurrent, twin.eos = self.recurrent, set(self.eos)
        twin.sequence, twin.unfed = list(self.sequence), self.unfed
        twin.stale, twin.hidden_gap = self.stale, self.hidden_gap
        # a fresh key of its own (rank 0's seed on a sharded target: every rank draws alike);
        # this one's stays: the server forks a reply's decoder as it prefills (checkpoints),
        # and splitting this key made a seeded reply draw other samples
        seed = distributed.agreed_seed(self.pair, None) if self.pair is not None else None
        twin.key = random_key(seed)
        twin.epoch, twin.active = 0, False
        twin.take_measured(self.measured())
        twin._drafting, twin.hidden_layers = self._drafting, self.hidden_layers
        twin.settle()  # the key and the copies' slices, lazy until now
        return twin

    def measured(self) -> tuple:
        """What the draft-length policy measured (costs, acceptance), for another decoder of
        the same pair to start from (`take_measured` copies it)."""
        return self._policy, self._policy_key, self.step_seconds

    def take_measured(self, measured: tuple) -> None:
        self._policy, self._policy_key, self.step_seconds = copy.deepcopy(measured)

    def _reuse(self, prompt: list[int], use_draft: bool) -> tuple[int, int | None]:
        """(prompt tokens a prefill keeps, the tokens to roll back for that), or (0, None)
        when the caches must start over. The one rule of `prefill` and `reusable`."""
        cached = self.sequence[: len(self.sequence) - self.unfed]
        reuse = min(common_prefix_len(cached, prompt), len(prompt) - 1)
        if use_draft and self.hidden_gap is not None:
            # the drafter never got the target's features past the gap: compute them again
            # from there (once the whole prompt: the chat's follow-up after a plain race
            # reused 0 of 58 tokens on the demo pair)
            reuse = min(reuse, self.hidden_gap)
        if self.stale or not caches.can_rollback(self.cache, len(cached) - reuse):
            return 0, None  # a recurrent state (or a window) cannot forget that much
        return reuse, len(cached) - reuse

    def _held_length(self) -> int:
        return len(self.sequence) - self.unfed

    def reusable(self, prompt: list[int], use_draft: bool = True) -> int:
        """How many tokens of `prompt` `prefill(prompt, use_draft)` would reuse, changing
        nothing."""
        return self._reuse(prompt, use_draft)[0]

    def prefill(
        self,
        prompt: list[int],
        use_draft: bool = True,
        timed: bool = False,
        abort=None,
        marks: tuple[int, ...] = (),
        on_mark=None,
    ) -> int:
        """Fill the caches for `prompt`; returns how many prompt tokens were reused.
        `timed`: feed the prompt's last tokens one by one, as decoding steps, and keep the
        seconds of a target step and a draft step in `step_seconds` (None where the prompt was
        too short to time), so a controller knows both costs before the first token.
        `abort()`, asked between prefill chunks, stops it with `Aborted` (the caches are then
        stale: the next prefill starts over). `marks` (ascending): positions where
        `on_mark(mark)` is called with the decoder holding exactly `prompt[:mark + 1]` (its
        caches `prompt[:mark]`), for the server to keep a copy there (prompt_cache.py); the
        prompt's last position after the whole prefill; marks already reused are skipped."""
        reused = self._reuse(prompt, use_draft)[0]
        for mark in marks:
            if reused < mark < len(prompt) - 1:
                self._prefill(prompt[: mark + 1], use_draft, abort=abort)
                self._mark(on_mark, mark)
        self._prefill(prompt, use_draft, timed, abort)
        if marks and marks[-1] == len(prompt) - 1 > reused:
            self._mark(on_mark, marks[-1])
        return reused

    def _mark(self, on_mark, mark: int) -> None:
        # the caches are whole between prefills: the stream that began may be forked here
        active, self.active = self.active, False
        try:
            on_mark(mark)
        finally:
            self.active = active

    def _prefill(self, prompt: list[int], use_draft: bool, timed: bool = False, abort=None) -> int:
        reuse, forget = self._reuse(prompt, use_draft)
        if forget is None:  # start over
            self.cache = self._new_cache()
            if self.drafter is not None:
                self.drafter.reset()
        else:
            caches.rollback(self.cache, forget)
        if use_draft:
            self.hidden_gap = None
        elif self.hidden_layers:  # the drafter gets nothing of this prompt and reply
            self.hidden_gap = reuse if self.hidden_gap is None else min(self.hidden_gap, reuse)
        self.stale = True  # until the prefill is done
        new = prompt[reuse:-1]
        hidden = dict.fromkeys(self.hidden_layers) if use_draft else None
        plain = prefill_cache(self.target, self.cache, new, timed=timed, abort=abort, hidden=hidden)
        draft = None
        if self.drafter is not None and use_draft:
            if abort is not None and abort():
                raise Aborted("stopped before the draft's prefill")
            output = TargetOutput(None, hidden, len(new), len(new)) if hidden else None
            draft = self.drafter.prefill(prompt, timed, output)
        self.stale = False
        self.step_seconds = (plain, draft)
        self.sequence, self.unfed = list(prompt), 1
        return reuse

    def give_up(self, prompt: list[int] | None = None):
        """Hand the caches over (a batch row starts from them, batch.py): (the target's
        cache, the tokens it holds, the drafter's `held_cache()`). The decoder is left empty
        (its policy and key stay). None where the caches may be mid-round (stale, active) or
        hold a recurrent state that `prompt` does not simply extend (a state cannot be trimmed
        back to a shared prefix): nothing is handed over, the decoder is emptied all the same."""
        extends = prompt is not None and self._reuse(prompt, True) == (self._held_length(), 0)
        usable = not (self.stale or self.active) and (extends or not self.recurrent)
        usable = usable and self.sequence
        given = None
        if usable:
            held = self.sequence[: len(self.sequence) - self.unfed]
            draft = self.drafter.held_cache() if self.drafter is not None else None
            given = (self.cache, held, draft)
        self.cache, self.sequence, self.unfed = self._new_cache(), [], 1
        self.stale = self.active = False
        if self.drafter is not None:
            self.drafter.reset()
        return given

    def adopt(self, sequence: list[int], cache: list, draft=None, head=None) -> Decoder:
        """Hold `sequence` from caches built elsewhere (a batch row's, as it leaves): `cache`
        holds all of it but its last token; `draft`: (the drafter's cache, the prefix of
        `sequence` it holds), or None (the drafter starts over at the next prefill); `head`:
        a drafter of this decoder's kind holding the row's head state over `sequence` (the
        batch's EAGLE-3 head), which becomes this decoder's."""
        self.cache, self.sequence, self.unfed = cache, list(sequence), 1
        self.stale = self.active = False
        inner = getattr(self.drafter, "inner", None)  # suffix+<head>: the head is its inner
        if head is not None and type(head) in (type(self.drafter), type(inner)):
            self.hidden_gap = None  # the head has every position's features
            own = type(head) is type(self.drafter)
            self.drafter = head if own else self.drafter.adopt_inner(head)
            return self
        # a head reads the target's layers, which this row did not keep: the next drafting
        # prefill starts over, as after a reply decoded without drafts
        self.hidden_gap = 0 if self.hidden_layers else None
        if self.drafter is not None:
            self.drafter.reset()
            if draft is not None:
                draft_cache, cached = draft
                self.drafter.adopt(draft_cache, cached, sequence[len(cached) :])
        return self

    def _target_token(self, logits: mx.array, params: SamplingParams) -> mx.array:
        if params.greedy:
            return mx.argmax(logits, axis=-1)
        return sample(probabilities(logits, params), self._next_key())

    def rounds(
        self,
        max_tokens: int,
        params: SamplingParams,
        k,
        use_draft: bool = True,
        processors: list[LogitsProcessor] = (),
        logprobs: int | None = None,
        forced=None,
    ) -> Iterator[Round]:
        """`k`: a draft length, or a policy (policies.py) that picks it each round from the
        past rounds' outcomes and wall times; k = 0 decodes plainly for `plain_burst()` tokens.
        `processors` (processors.py) transform the target's and the draft's logits alike;
        `logprobs` (None: off; N >= 0: with the top N) fills each round's log-probabilities.
        `forced`: a grammar.GrammarProcessor; where its grammar forces the next tokens, a
        round drafts them, with no model and outside the policy (they cost nothing to draft).
        """
        extra = dict(processors=list(processors), logprobs=logprobs)
        drafting = self.drafter is not None and use_draft
        self._drafting = drafting  # forced rounds tell the drafter what they emitted
        if not drafting and forced is None:
            yield from self._plain_steps(max_tokens, params, **extra)
            return
        policy = FixedK(k) if isinstance(k, int) else k
        # prompt lookup can tell for free whether it has something to draft now (None: a
        # drafter that cannot tell before it proposes)
        peek = self.drafter.has_proposal if drafting else lambda: None
        if forced is not None:  # a plain stretch also ends where the grammar forces tokens
            lookup = peek

            def peek():
                return bool(forced.forced(self.sequence, 1)) or bool(lookup())

        until = peek  # what ends a plain stretch
        found = self.drafter.suffix_match() if drafting else None
        if found is not None:  # suffix decoding: a lookup worth drafting ends it too
            rival = getattr(self.drafter, "inner", None) is not None  # (a head or draft model)

            def lookup_k(limit: int) -> int:  # the lookup draft's length now, 0: none
                match, reach = self.drafter.suffix_match()
                return policy.lookup_length(match, min(reach, limit), rival)  # (reach 0: 0)

            def until():
                return lookup_k(max_tokens - emitted - 1) > 0 or bool(peek())

        emitted = 0
        last = time.perf_counter()  # wall time between round starts: the consumer's share too
        while emitted < max_tokens:
            if forced is not None:
                limit = min(FORCED_MAX, max_tokens - emitted - 1)
                # a recurrent target replaying rejected rounds needs a round that cannot be
                # rejected (as below): no forced draft then
                guess = forced.forced(self.sequence, limit) if self.unfed <= REPLAY_LIMIT else []
                if guess:
                    r = self._speculative_round(len(guess), params, proposal=guess, **extra)
                    emitted += len(r.tokens)
                    last = time.perf_counter()  # not the policy's round: kept out of its times
                    yield r
                    if r.finished:
                        return
                    continue
                if not drafting:  # the target alone until the grammar forces tokens again
                    for r in self._plain_steps(max_tokens - emitted, params, until=peek, **extra):
                        emitted += len(r.tokens)
                        yield r
                        if r.finished:
                            return
                    continue
            # a lookup draft (suffix decoding) past k_max: its own round, out of the k estimates
            n = lookup_k(max_tokens - emitted - 1) if found is not None else 0
            if n and self.unfed <= REPLAY_LIMIT:
                match = self.drafter.suffix_match()[0]
                r = self._speculative_round(n, params, lookup=True, **extra)
                emitted += len(r.tokens)
                outcome = (match, r.drafted, r.accepted)
                last = yield from timed(r, last, policy, policy.update_lookup, outcome)
                if r.finished:
                    return
                continue
            # the round adds at most k+1 tokens; never draft past max_tokens
            available = peek()
            k_round = min(policy.next(available), max_tokens - emitted - 1)
            if self.unfed > REPLAY_LIMIT:
                k_round = 0
            if k_round == 0:
                n = min(policy.plain_burst(), max_tokens - emitted)
                # a plain stretch ends where lookup finds a match (after the step already
                # queued): the policy decides again
                for r in self._plain_steps(n, params, plain=True, until=until, **extra):
                    emitted += len(r.tokens)
                    self.drafter.commit(self.sequence[-1:], r.target_output)
                    last = yield from timed(r, last, policy, policy.update_plain, (1,))
                    if r.finished:
                        return
                continue
            split = policy.wants_split()
            if split:
                # after a plain stretch the draft model has many tokens to take in: one batched
                # pass, kept out of the round's time (it is no cost of a draft step)
                caught = time.perf_counter()
                self.drafter.catch_up()
                last += time.perf_counter() - caught
            r = self._speculative_round(k_round, params, split, **extra)
            emitted += len(r.tokens)
            outcome, more = (k_round, r.drafted, r.accepted), (r.split, r.replayed)
            last = yield from timed(r, last, policy, policy.update, outcome, more)
            if r.finished:
                return

    def _speculative_round(
        self,
        k: int,
        params: SamplingParams,
        split: bool = False,
        processors=(),
        logprobs: int | None = None,
        proposal: list[int] | None = None,
        lookup: bool = False,
    ) -> Round:
        """One round; `proposal`: forced tokens to draft; `lookup`: the drafter's lookup draft."""
        requested, start = k, time.perf_counter()
        # greedy rounds draw nothing: splitting the key anyway would grow its lazy graph by a
        # node per round for the whole conversation
        key = None if params.greedy else self._next_key()
        drafter = self.drafter if proposal is None else None
        if lookup:  # a point mass on each looked-up token
            draft_tokens, q = drafter.propose_lookup(k)
        elif drafter is not None:  # (k,), (k, V) | None
            kwargs = {"processors": processors} if processors else {}
            draft_tokens, q = drafter.propose(k, params, key, **kwargs)
        else:  # a point mass on each forced token, verified like any guess
            draft_tokens, q = mx.array(proposal, mx.uint32), None
        k = draft_tokens.shape[0]  # a drafter may propose fewer (lookup: 0 on no match)
        if split:  # time the draft apart (an extra host sync, in a few calibration rounds)
            mx.eval([a for a in (draft_tokens, q) if a is not None])
            drafted_at = time.perf_counter()
        saved = caches.snapshot(self.cache) if self.recurrent else None
        unfed = self.sequence[-self.unfed :]  # replayed tokens, then the last one
        inputs = mx.concatenate([mx.array(unfed, mx.uint32), draft_tokens])
        logits, output = self._forward(inputs, k + 1)  # (k+1, vocab)
        # row i is the distribution after sequence + x1..xi: the same transform the draft saw
        path = proposal if proposal is not None else draft_tokens
        logits = apply_processors(processors, self.sequence, path, logits)
        verify_key = None if params.greedy else self._next_key()
        n, next_token = verify(draft_tokens, logits, params, q, verify_key)
        out = mx.concatenate([mx.stack([n, next_token]).astype(mx.int32), draft_tokens])
        lp = None
        if logprobs is not None:  # row i emits x_(i+1) while i < n, then next_token
            rows = mx.concatenate([draft_tokens.astype(mx.int32), mx.zeros((1,), mx.int32)])
            rows = mx.where(mx.arange(k + 1) == n, next_token.astype(mx.int32), rows)
            lp = target_logprobs(logits, rows, logprobs)
        # the one host sync of the round; the key with it, so no split is left lazy whatever
        # ends the stream next
        mx.eval(out, self.key, *[a for a in lp or () if a is not None], *output.hidden.values())
        n, next_token, *drafted = out.tolist()
        kept = drafted[:n] + [next_token]
        kept, stop = cut_at_end(kept, self.eos)
        # the target ran on the unfed tokens + x1..xk; it must hold them + every kept token
        # but the new last one
        rejected = k + 1 - len(kept)
        replayed = self.unfed - 1
        if rejected and self.recurrent:
            caches.restore(self.cache, saved)
            caches.rollback(self.cache, self.unfed + k, skip_recurrent=True)
            self.unfed += len(kept)
            output.kept = 0  # the next pass replays these tokens
        else:
            caches.rollback(self.cache, rejected)
            output.kept = self.unfed + len(kept) - 1
            self.unfed = 1
        if self.drafter is not None and (proposal is None or self._drafting):
            self.drafter.commit(kept, output)
        self.sequence += kept
        out_tokens = kept if stop is None else kept[:-1]
        lps = tops = None
        if lp is not None:
            lps, tops = read_logprobs(lp, len(out_tokens))
        timing = None
        if split:
            verify_seconds = time.perf_counter() - drafted_at
            timing = (drafted_at - start, drafter.steps, verify_seconds, replayed + 1 + k)
        return Round(
            tokens=out_tokens,
            accepted=n,
            drafted=k,
            finished=stop is not None,
            draft_steps=drafter.steps if drafter is not None else 0,
            replayed=replayed,
            requested=requested,
            split=timing,
            proposal=drafted,
            target_token=next_token,
            logprobs=lps,
            top_logprobs=tops,
            forced=proposal is not None,
        )

    def _plain_steps(
        self,
        max_tokens: int,
        params: SamplingParams,
        plain: bool = False,
        until=None,
        processors=(),
        logprobs: int | None = None,
    ) -> Iterator[Round]:
        """Plain decoding, one token per round, pipelined as mlx_lm.generate_step is: the
        next step is queued before the current token is read back (never past max_tokens).
        `until()`, asked after each token, ends the stretch after the step already queued."""
        if not all(getattr(p, "pipelines", True) for p in processors):
            yield from self._processed_steps(max_tokens, params, plain, until, processors, logprobs)
            return
        before = None  # a recurrent state from before the queued step
        key_before = self.key  # the key before the queued step drew its sample

        def step(tokens: mx.array, proposed=()):
            """The next token (lazy), its log-probability arrays when asked for (else ()),
            and the pass's TargetOutput. `proposed`: the token fed now when `sequence` does
            not hold it yet."""
            nonlocal before, key_before
            if self.recurrent:
                before = caches.snapshot(self.cache)
            key_before = self.key
            logits, output = self._forward(tokens, 1)
            logits = logits[0]
            if processors:
                logits = apply_processors(processors, self.sequence, proposed, logits)
            token = self._target_token(logits, params)
            arrays = ()
            if logprobs is not None:
                arrays = target_logprobs(logits[None], token.reshape(1), logprobs)
                arrays = tuple(a for a in arrays if a is not None)
            mx.async_eval(token, self.key, *arrays, *output.hidden.values())
            return token, arrays, output

        def round_of(tokens, token, arrays, output):
            r = Round(tokens, 0, 0, plain=plain, target_token=token, target_output=output)
            if logprobs is not None and tokens:
                r.logprobs, r.top_logprobs = read_logprobs(
                    (arrays[0], *(arrays[1:] if len(arrays) == 3 else (None, None))), 1
                )
            return r

        epoch = self.epoch
        queued = step(mx.array(self.sequence[-self.unfed :], mx.uint32))
        self.unfed = 1
        lookahead = False  # whether the cache already holds the last token of `sequence`
        last_step = False
        try:
            for emitted in range(1, max_tokens + 1):
                current = queued
                lookahead = emitted < max_tokens and not last_step
                if lookahead:
                    queued = step(current[0].reshape(1), current[0].reshape(1))
                token = current[0].item()
                self.sequence.append(token)
                if token in self.eos:  # the pass that produced it was fed a token: hand its row
                    yield Round(
                        [], 0, 0, finished=True, plain=plain, target_token=token,
                        target_output=current[2],
                    )  # fmt: skip
                    return
                yield round_of([token], token, *current[1:])
                if not lookahead:
                    return
                last_step = until is not None and until()
        finally:
            # undo the step queued for a token that will not be emitted (unless another stream
            # has taken the decoder since: the caches are its own now)
            if lookahead and self.epoch == epoch:
                # and its sample's key: a reply that goes on elsewhere (a batch row, the
                # server's move) then draws what it would have drawn here
                self.key = key_before
                if self.recurrent:
                    caches.restore(self.cache, before)
                try:
                    caches.rollback(self.cache, 1, skip_recurrent=True)
                except caches.CacheRollbackError:  # e.g. chunked attention at a chunk edge
                    self.stale = True

    def _processed_steps(
        self, max_tokens: int, params: SamplingParams, plain: bool, until, processors, logprobs
    ) -> Iterator[Round]:
        """Plain decoding under a processor that must see each token first (`pipelines =
        False`: a grammar, which cannot step past the end of its grammar): nothing is queued
        ahead; `until()` ends the stretch at once."""
        for _ in range(max_tokens):
            logits, output = self._forward(self.sequence[-self.unfed :], 1)
            logits = apply_processors(processors, self.sequence, [], logits)[0]
            chosen = self._target_token(logits, params)
            lp = None  # (once, none were read here: a grammar's plain tokens had null logprobs)
            if logprobs is not None:
                lp = target_logprobs(logits[None], chosen.reshape(1), logprobs)
            token = chosen.item()
            self.unfed = 1
            self.sequence.append(token)
            r = Round([token], 0, 0, plain=plain, target_token=token, target_output=output)
            if token in self.eos:
                r.tokens, r.finished = [], True
                yield r
                return
            if lp is not None:
                r.logprobs, r.top_logprobs = read_logprobs(lp, 1)
            yield r
            if until is not None and until():
                return
