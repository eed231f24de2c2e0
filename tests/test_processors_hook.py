"""The logits-processor hook (processors.py): what the engine passes, row by row.

A recording processor checks the documented contract at every call — rows align to the end of
`proposed` — and a processor that bans one token shows it reaches the target's verify rows,
plain steps and the draft's steps alike, losslessly."""

from __future__ import annotations

import mlx.core as mx

from mlx_spec import generate, load_pair
from mlx_spec.core.processors import apply


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, context, proposed, logits):
        proposed = proposed.tolist() if isinstance(proposed, mx.array) else list(proposed)
        assert logits.ndim == 2 and 1 <= logits.shape[0] <= len(proposed) + 1
        self.calls.append((list(context), proposed, logits.shape[0]))
        return logits


class Ban:
    """Forbid one token everywhere (a logit bias of -inf)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, context, proposed, logits):
        return mx.where(mx.arange(logits.shape[-1]) == self.token, -mx.inf, logits)


def test_apply_runs_in_order_on_one_or_two_dimensions():
    double = lambda c, p, x: x * 2  # noqa: E731
    plus = lambda c, p, x: x + 1  # noqa: E731
    x = mx.array([[1.0, 2.0]])
    assert apply([double, plus], [], [], x).tolist() == [[3.0, 5.0]]
    assert apply([plus, double], [], [], x[0]).tolist() == [4.0, 6.0]
    assert apply([], [], [], x) is x


def test_the_engine_calls_processors_as_documented(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    rec = Recorder()
    res = generate(pair, "The quick brown fox", max_tokens=24, num_draft_tokens=3,
                   processors=[rec])  # fmt: skip
    prompt = pair.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    full = prompt + res.tokens
    verify = [c for c in rec.calls if c[2] > 1]
    steps = [c for c in rec.calls if c[2] == 1]
    assert verify and steps  # verify passes over k + 1 rows, and draft steps
    for context, _, _ in rec.calls:
        assert full[: len(context)] == context  # the sequence so far, prompt included
        assert len(context) >= len(prompt)
    for _, proposed, n in verify:
        assert n == len(proposed) + 1  # row i after context + proposed[:i]


def test_a_banned_token_never_appears_and_output_equals_plain_banned(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    free = generate(pair, "The quick brown fox", max_tokens=30, use_draft=False).tokens
    banned = free[3]
    plain = generate(pair, "The quick brown fox", max_tokens=30, use_draft=False,
                     processors=[Ban(banned)])  # fmt: skip
    assert banned not in plain.tokens and plain.tokens != free
    for k in (1, 3, 5):
        spec = generate(pair, "The quick brown fox", max_tokens=30, num_draft_tokens=k,
                        processors=[Ban(banned)])  # fmt: skip
        assert spec.tokens == plain.tokens
