"""Logits processors: a per-position transform applied identically to target and draft.

Speculative decoding stays lossless under any transform of the logits as long as the target's
verify rows and the draft's rows go through the same one: the engine then verifies against the
transformed target distribution, which is what plain decoding with that transform samples from.
A grammar mask (grammar.py) is one; penalties and logit biases are others.

The engine calls each processor, in order:

- on the target's verify logits over the drafted path: `context` = the sequence so far
  (prompt + emitted), `proposed` = the round's draft tokens, logits (k + 1, V);
- on each plain step: `proposed` = [], logits (1, V);
- in a model drafter, on each draft step: `proposed` = the tokens drafted so far this round,
  logits (1, V), before `sampling.probabilities` / argmax.

Rows align to the end of `proposed`: in a verify pass (n = len(proposed) + 1) row i is the
distribution after `context + proposed[:i]`; in a draft step (n = 1) the one row is the
distribution after `context + proposed`. In general row i follows
`context + proposed[:len(proposed) + 1 - n + i]`. A processor may leave
rows after a proposed token it rejects (a lookup guess outside a grammar) in any finite state:
verification never reaches them, since that token gets probability 0 at its own row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx


class LogitsProcessor(Protocol):
    def __call__(self, context: list[int], proposed: list[int], logits: mx.array) -> mx.array:
        """logits (n, V): row i is the distribution after context + proposed[:i]
        (i = 0..n-1; n <= len(proposed) + 1) -> processed logits (n, V), same shape."""


def apply(
    processors: Sequence[LogitsProcessor], context: list[int], proposed, logits: mx.array
) -> mx.array:
    """Run `processors` in order over (n, V) or (V,) logits. `proposed`: a list of ids or a
    1-D `mx.array` of them (a processor that needs them on the host reads it)."""
    if not processors:
        return logits
    squeeze = logits.ndim == 1
    out = logits[None] if squeeze else logits
    for process in processors:
        out = process(context, proposed, out)
    return out[0] if squeeze else out
