"""Logits -> probabilities under temperature / top-k / top-p / min-p.

The same transform is applied to target and draft logits: speculative sampling is lossless
with respect to the distribution this function returns. The filters run in mlx-lm's order
(top-p, min-p, top-k on the log-probabilities, then temperature) so that a run here samples
from exactly the distribution `mlx_lm.generate` samples from with the same flags.
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import SpecError

# Below this temperature the distribution is a point mass on the argmax to float32 precision,
# and dividing by it can overflow (or, on Metal, divide by a flushed denormal): decode greedily.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        for name in ("temperature", "top_p", "top_k", "min_p"):  # (a "0" raised TypeError)
            value = getattr(self, name)
            kind = numbers.Integral if name == "top_k" else numbers.Real
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an integer" if name == "top_k" else "a number"
                raise SpecError(f"{name.replace('_', '-')} must be {what}, got {value!r}")
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise SpecError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SpecError(f"min-p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """(..., vocab) logits -> (..., vocab) float32 probabilities to sample from."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    # subtract the max first: the top token's logit is 0 / T = 0, never 0 * inf = NaN
    logprobs = logprobs - logprobs.max(axis=-1, keepdims=True)
    return mx.softmax(logprobs / params.temperature, axis=-1)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token id per row of (..., vocab) probabilities (need not be normalised)."""
    return mx.random.categorical(mx.log(probs), key=key)


def draw(logits: mx.array, params: SamplingParams, key) -> tuple[mx.array, mx.array | None]:
    """A drafter's one guess from (vocab,) logits: (1,) uint32, and the q it was drawn from
    (None when greedy: the argmax, a point mass)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1, keepdims=True).astype(mx.uint32), None
    q = probabilities(logits, params)
    return sample(q, key)[None].astype(mx.uint32), q


SEED_LIMIT = 2**64  # MLX's random keys take an unsigned 64-bit seed


def random_key(seed: int | None) -> mx.array:
    """A random key from `seed` (checked), or a fresh one (None: unseeded)."""
    return mx.random.key(check_seed(seed) if seed is not None else secrets.randbits(63))


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise SpecError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return seed
