"""Verification of one speculative round: pure functions on arrays, no host sync.

Names follow Leviathan et al. (2023) / Chen et al. (2023): the target distribution is `p`,
the draft distribution is `q`, the draft proposes `x1..xk`. Both return `(n, next_token)`:
`n` draft tokens accepted (0..k) and the one token the target adds — the correction after a
rejection, or the bonus after `k` acceptances. Both are 0-d arrays; the caller syncs once.
"""

from __future__ import annotations

import mlx.core as mx


def leading_true(mask: mx.array) -> mx.array:
    """Length of the run of True at the start of a (k,) bool array."""
    return mx.cumprod(mask.astype(mx.int32)).sum()


def verify_greedy(draft_tokens: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Temperature 0: keep draft tokens while they equal the target's argmax.

    draft_tokens: (k,) ids; target_logits: (k+1, vocab).
    """
    k = draft_tokens.shape[0]
    target_choice = mx.argmax(target_logits, axis=-1)  # (k+1,)
    n = leading_true(draft_tokens == target_choice[:k])
    return n, target_choice[n]


def verify_stochastic(
    draft_tokens: mx.array, p: mx.array, q: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Speculative sampling: the emitted tokens are distributed exactly as under `p`.

    draft_tokens: (k,) ids sampled from q; p: (k+1, vocab) target probs; q: (k, vocab) draft
    probs (a point mass for a deterministic drafter). k may be 0: then this samples from p[0].
    """
    k = draft_tokens.shape[0]
    accept_key, residual_key = mx.random.split(key)
    rows = mx.arange(k)
    p_x = p[rows, draft_tokens]  # (k,) p(xi)
    q_x = q[rows, draft_tokens]  # (k,) q(xi)
    u = mx.random.uniform(shape=(k,), key=accept_key)
    # accept xi with probability min(1, p(xi)/q(xi)); written without the division
    n = leading_true(u * q_x < p_x)
    # first rejection at n: sample norm(max(0, p - q)); after k acceptances q is 0 -> p itself
    q_padded = mx.concatenate([q, mx.zeros((1, q.shape[-1]), q.dtype)])  # (k+1, vocab)
    p_n, q_n = mx.take(p, n, axis=0), mx.take(q_padded, n, axis=0)  # (vocab,)
    residual = mx.maximum(p_n - q_n, 0)
    # p == q to the last bit leaves no residual; a rejection then had probability 0 anyway
    residual = mx.where(residual.sum() > 0, residual, p_n)
    return n, mx.random.categorical(mx.log(residual), key=residual_key)
