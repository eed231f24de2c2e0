"""Constrained speculative decoding on every model family: sliding windows (the window crossed
in every verify pass) and recurrent states (restored and replayed after a rejection) roll back
with the grammar; greedy output equals plain constrained decoding on mlx-lm's own caches."""

from __future__ import annotations

import pytest
import tiny
from test_families import FAMILIES, family_dirs, pairs, prompt_ids  # noqa: F401  (fixtures)
from test_structured import reference

from mlx_spec import generate

# long enough to cross the 8-token window several times; letters and spaces, then a full stop
LONG = r"(the|a) [a-z ]{60,120}\."


@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("family", [*FAMILIES, "mamba"])
def test_constrained_greedy_equals_plain_constrained(pairs, family, k):  # noqa: F811
    pair = pairs(family)
    prompt = prompt_ids(pair)
    expected, finish = reference(pair, prompt, "regex", LONG, 5 * tiny.WINDOW)
    assert len(expected) > 2 * tiny.WINDOW
    res = generate(pair, prompt, max_tokens=5 * tiny.WINDOW, num_draft_tokens=k, regex=LONG)
    assert res.tokens == expected and res.finish_reason == finish
    assert res.stats.drafted > res.stats.forced_drafted  # the draft model drafted too
    assert res.stats.accepted < res.stats.drafted  # and was rejected: the roll-backs ran
