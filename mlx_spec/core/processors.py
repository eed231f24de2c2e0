"""Per-position logits transforms, applied identically to the target's and the draft's logits.

A processor sees the sequence so far (`context`: prompt + emitted tokens), the tokens proposed
after it this round, and logits with one row per position. Rows are aligned to the end: the
last row is the distribution after `context + proposed`, row i of n the one after
`context + proposed[: len(proposed) + 1 - n + i]`. So the verify pass (n = k + 1, proposed = the
k draft tokens) has row i after `proposed[:i]`; a draft step (n = 1, proposed = the tokens drafted
so far this round) and a plain step (n = 1, proposed = [] or the one token still being computed)
have their one row after everything.

Speculation stays exact: the target's processed distribution at a position depends only on the
tokens before it, the engine verifies against that processed distribution, and the rejection
rule samples exactly `p` whatever `q` is. Applying the same transform to the draft only makes
`q` closer to `p`, so more tokens are accepted.

`proposed` is a list of ids or a 1-D `mx.array` of ids that may still be lazy (the engine does
not wait for the draft to finish before building the verify pass); `token_ids` turns either
into a list (a host sync for an array). The penalties here stay on the device: one scatter-add
per call, no host sync. A grammar mask (grammar.py) is a processor too.
"""

from __future__ import annotations

import math
from typing import Protocol

import mlx.core as mx

from ..errors import SpecError

DEFAULT_CONTEXT = 20  # tokens a penalty looks back over, as mlx-lm's defaults


class LogitsProcessor(Protocol):
    def __call__(self, context: list[int], proposed: list[int], logits: mx.array) -> mx.array:
        """logits (n, V): row i is the distribution after context + proposed[:i]
        (i = 0..n-1; n <= len(proposed) + 1) -> processed logits (n, V), same shape."""


def token_ids(proposed) -> list[int]:
    """`proposed` as a list of ints (an `mx.array` is evaluated)."""
    return proposed.tolist() if isinstance(proposed, mx.array) else list(proposed)


def apply(processors, context: list[int], proposed, logits: mx.array) -> mx.array:
    """Run `processors` in order on (n, V) or (V,) logits."""
    if not processors:
        return logits
    squeeze = logits.ndim == 1
    out = logits[None] if squeeze else logits
    for p in processors:
        out = p(context, proposed, out)
    return out[0] if squeeze else out


def _as_array(proposed) -> mx.array:
    if isinstance(proposed, mx.array):
        return proposed.reshape(-1).astype(mx.int32)
    return mx.array(list(proposed), mx.int32)


def window_counts(context: list[int], proposed, n: int, vocab: int, size: int) -> mx.array:
    """(n, vocab) counts of each token among the last `size` tokens before each row."""
    tail = context[-size:] if size > 0 else []
    proposed = _as_array(proposed)
    m = proposed.shape[0]
    seq = mx.concatenate([mx.array(tail, mx.int32), proposed]) if tail else proposed
    length = seq.shape[0]
    if length == 0 or size <= 0:
        return mx.zeros((n, vocab), mx.float32)
    # row i ends (exclusively) at position len(tail) + m + 1 - n + i of seq
    ends = mx.arange(n)[:, None] + (len(tail) + m + 1 - n)
    pos = mx.arange(length)[None, :]
    inside = (pos < ends) & (pos >= ends - size)  # (n, length)
    rows = mx.broadcast_to(mx.arange(n)[:, None], (n, length))
    cols = mx.broadcast_to(mx.clip(seq, 0, vocab - 1)[None, :], (n, length))
    return mx.zeros((n, vocab), mx.float32).at[rows, cols].add(inside.astype(mx.float32))


class Penalties:
    """OpenAI's presence and frequency penalties and the (sign-aware, multiplicative)
    repetition penalty, over the last `*_context` tokens (prompt included), applied in
    mlx-lm's order: repetition, presence, frequency. The same results as mlx-lm's
    `make_logits_processors` on a plain step."""

    def __init__(
        self,
        repetition: float = 0.0,
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition_context: int = DEFAULT_CONTEXT,
        presence_context: int = DEFAULT_CONTEXT,
        frequency_context: int = DEFAULT_CONTEXT,
    ):
        self.terms = [
            (kind, value, size)
            for kind, value, size in (
                ("repetition", repetition, repetition_context),
                ("presence", presence, presence_context),
                ("frequency", frequency, frequency_context),
            )
            if value and not (kind == "repetition" and value == 1.0) and size > 0
        ]

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __call__(self, context, proposed, logits):
        n, vocab = logits.shape
        counts: dict[int, mx.array] = {}
        for kind, value, size in self.terms:
            if size not in counts:
                counts[size] = window_counts(context, proposed, n, vocab, size)
            c = counts[size]
            if kind == "repetition":
                penalised = mx.where(logits < 0, logits * value, logits / value)
                logits = mx.where(c > 0, penalised, logits)
            elif kind == "presence":
                logits = logits - value * (c > 0)
            else:
                logits = logits - value * c
        return logits


class LogitBias:
    """Additive bias per token id (OpenAI's `logit_bias`; -100 bans a token, +100 forces it)."""

    def __init__(self, bias: dict[int, float]):
        self.bias = {int(k): float(v) for k, v in bias.items()}
        if any(k < 0 or k >= 2**31 for k in self.bias):  # (int32 ids: past that, bad_cast)
            bad = next(k for k in self.bias if k < 0 or k >= 2**31)
            raise SpecError(f"logit_bias keys must be token ids in [0, 2**31), got {bad}")
        self.max_id = max(self.bias, default=-1)
        self.ids = mx.array(list(self.bias), mx.int32)
        self.values = mx.array(list(self.bias.values()), mx.float32)

    def __bool__(self) -> bool:
        return bool(self.bias)

    def check_vocab(self, vocab: int) -> None:
        """Refuse ids past the target's vocabulary before anything runs: MLX does not
        bounds-check a scatter, and one such id corrupted the server's heap."""
        if self.max_id >= vocab:
            raise SpecError(
                f"logit_bias token id {self.max_id} is out of range: ids are [0, {vocab})"
            )

    def __call__(self, context, proposed, logits):
        vocab = logits.shape[-1]
        ids, values = self.ids, self.values
        if self.max_id >= vocab:  # a draft with a smaller vocabulary: it cannot propose those
            inside = {k: v for k, v in self.bias.items() if k < vocab}
            if not inside:
                return logits
            ids = mx.array(list(inside), mx.int32)
            values = mx.array(list(inside.values()), mx.float32)
        return logits.at[:, ids].add(values.astype(logits.dtype))


def check_vocab(processors, vocab: int | None) -> None:
    """Refuse (SpecError) a processor that indexes ids past the vocabulary (LogitBias):
    checked before anything runs, alone or as a batch row."""
    for p in processors:
        check = getattr(p, "check_vocab", None)
        if check is not None and vocab is not None:
            check(vocab)


def finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def make_processors(
    logit_bias: dict[int, float] | None = None,
    repetition_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_context: int = DEFAULT_CONTEXT,
    presence_context: int = DEFAULT_CONTEXT,
    frequency_context: int = DEFAULT_CONTEXT,
) -> list[LogitsProcessor]:
    """The processors for these settings, in mlx-lm's order (bias first); [] when all are off.
    Every number is checked (SpecError): a NaN bias or penalty made every reply one token
    repeated, silently (found by an adversarial run)."""
    for name, value in (
        ("repetition_penalty", repetition_penalty),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
    ):
        finite(name, value)
    if repetition_penalty < 0:
        raise SpecError(f"repetition_penalty must be >= 0 (0: off), got {repetition_penalty}")
    for name, size in (
        ("repetition_context", repetition_context),
        ("presence_context", presence_context),
        ("frequency_context", frequency_context),
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise SpecError(f"{name} must be an integer >= 0, got {size!r}")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise SpecError(f"logit_bias must map token ids to numbers, got {logit_bias!r}")
    for key, value in (logit_bias or {}).items():
        integer = isinstance(key, int) and not isinstance(key, bool)
        if not integer and not (isinstance(key, str) and key.lstrip("-").isdigit()):
            raise SpecError(f"logit_bias keys must be token ids, got {key!r}")
        finite(f"logit_bias[{key}]", value)
    out: list[LogitsProcessor] = []
    if logit_bias:
        out.append(LogitBias(logit_bias))
    penalties = Penalties(
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        repetition_context,
        presence_context,
        frequency_context,
    )
    if penalties:
        out.append(penalties)
    return out
