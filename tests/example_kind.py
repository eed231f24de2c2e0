"""A drafter kind written outside the package, in one module: proof that a new kind needs
nothing else than this and one registry line (`drafters.register(RepeatKind)`).

It proposes the last token again, k times: free, deterministic (q is a point mass), right
whenever the text repeats a token. Lossless like every kind: the target verifies it.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.drafters import Drafter, DrafterKind


class RepeatLast(Drafter):
    max_draft = 4

    def __init__(self):
        self.last = None

    def prefill(self, tokens, timed=False, output=None):
        self.last = tokens[-1]
        return 0.0

    def propose(self, k, params, key, *, processors=()):
        return mx.array([self.last] * k, mx.uint32), None

    def commit(self, kept, output=None):
        self.last = kept[-1]


class RepeatKind(DrafterKind):
    name = "repeat"
    max_draft = RepeatLast.max_draft
    help = "the last token again (an example kind)"

    @classmethod
    def build(cls, pair) -> RepeatLast:
        return RepeatLast()
