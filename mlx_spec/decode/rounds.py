"""One verify round as the decoder reports it (`Round`), and what the single-stream and
batched rounds share: the verification of a row's draft, the cut at an end token, the
target's log-probabilities, a point mass for a forced token, a vocabulary padded to the
target's width. Written once, so a fix in one decoder cannot be missing in the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..core.acceptance import verify_greedy, verify_stochastic
from ..core.sampling import SamplingParams, probabilities
from ..drafters import TargetOutput


@dataclass
class Round:
    tokens: list[int]  # emitted this round, EOS excluded
    accepted: int  # draft tokens the target accepted (n), before an end-of-sequence cut
    drafted: int  # k used this round
    finished: bool = False  # an end-of-sequence token ended the round
    draft_steps: int = 0  # draft-model forward passes (0 for prompt lookup)
    replayed: int = 0  # tokens re-fed to a recurrent target whose state was restored
    requested: int = 0  # k the policy asked for (a drafter may propose fewer)
    plain: bool = False  # decoded plainly while speculating (the policy chose k = 0)
    split: tuple | None = None  # (draft s, draft steps, verify s, verify rows) when timed apart
    proposal: list[int] = field(default_factory=list)  # the draft's guesses, kept or not
    target_token: int | None = None  # the target's own token: correction, bonus or plain step
    forced: bool = False  # the grammar's forced tokens were the draft (no model, no lookup)
    # of `proposal`, filler guesses at its end (a recurrent target's batch row: decode/batch.py)
    filled: int = 0
    target_output: TargetOutput | None = None  # for a drafter that reads hidden states
    # when asked for: per token of `tokens`, its log-probability under the target's (processed)
    # distribution and the top (id, log-probability) pairs there
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def accepted_emitted(self) -> int:
        """How many of `tokens` (a prefix) are accepted draft tokens."""
        return min(self.accepted, len(self.tokens))


def target_logprobs(logits: mx.array, tokens: mx.array, top: int):
    """Lazy: (n,) log-probabilities of `tokens` (one per row) under (n, V) logits, and the
    rows' top `top` ids and log-probabilities (None when top is 0)."""
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    if not top:
        return chosen, None, None
    top = min(top, lp.shape[-1])
    ids = mx.argpartition(-lp, kth=top - 1, axis=-1)[:, :top]
    return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)


def read_logprobs(arrays, count: int):
    """The lists of `target_logprobs`' arrays (evaluated), first `count` rows, best first."""
    chosen, ids, values = arrays
    lps = chosen.tolist()[:count]
    if ids is None:
        return lps, [[] for _ in lps]
    tops = [
        sorted(zip(i, v, strict=True), key=lambda t: -t[1])
        for i, v in zip(ids.tolist()[:count], values.tolist()[:count], strict=True)
    ]
    return lps, tops


def point_mass(tokens: mx.array, vocab: int) -> mx.array:
    """(k,) ids -> (k, vocab) one-hot distributions."""
    return (mx.arange(vocab)[None, :] == tokens[:, None]).astype(mx.float32)


def pad_vocab(a: mx.array, size: int) -> mx.array:
    """Zero-pad the last axis: draft and target heads may differ in padding rows."""
    extra = size - a.shape[-1]
    if extra <= 0:
        return a
    return mx.concatenate([a, mx.zeros((*a.shape[:-1], extra), a.dtype)], axis=-1)


def verify(
    draft_tokens: mx.array,
    logits: mx.array,
    params: SamplingParams,
    q: mx.array | None,
    key: mx.array | None,
) -> tuple[mx.array, mx.array]:
    """(n accepted, the target's token), lazy, for one row's draft x1..xk (k,) under its
    processed logits (k+1, vocab): greedy, or speculative sampling with the draft's q (k, V')
    (None: a deterministic drafter's point mass on each guess) and `key` (None when greedy:
    a greedy round draws no key)."""
    if params.greedy:
        return verify_greedy(draft_tokens, logits)
    p = probabilities(logits, params)  # (k+1, vocab)
    if q is None:
        q = point_mass(draft_tokens, p.shape[-1])
    vocab = max(p.shape[-1], q.shape[-1])
    return verify_stochastic(draft_tokens, pad_vocab(p, vocab), pad_vocab(q, vocab), key)


def cut_at_end(kept: list[int], eos) -> tuple[list[int], int | None]:
    """A round's kept tokens up to the first end-of-sequence token (which stays in the
    sequence, not in the output), and its index (None: no end token; the round goes on)."""
    stop = next((i for i, t in enumerate(kept) if t in eos), None)
    return (kept if stop is None else kept[: stop + 1]), stop
