"""Prompt lookup: lossless like any drafter, and an index whose per-round cost is constant."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_distribution import PROMPT, chi_square, exact_joint, first_two
from test_greedy_equality import reference

from mlx_spec import SamplingParams, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.drafters.ngram import NGramDrafter

# a prompt that repeats itself, so lookup finds continuations
REPEATING = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


@pytest.fixture(scope="module")
def ngram_pair(tiny_models):
    pair = load_pair(target=str(tiny_models.target))
    pair = pair.configured(drafter="ngram")
    return pair


def test_lookup_proposes_what_followed_the_latest_occurrence():
    d = NGramDrafter(ngram_max=2, ngram_min=1)
    d.prefill([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert d.lookup(3) == [5, 6, 1]  # "1 2" last continued with 5 6 1
    d.commit([7])
    assert d.lookup(2) == []  # "2 7" and "7" never seen before
    d.commit([1, 2])
    assert d.lookup(4) == [7, 1, 2]  # now "1 2" most recently continued with 7


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("prompt", [REPEATING, "The quick brown fox"])
def test_greedy_ngram_equals_target_alone(ngram_pair, prompt, k):
    expected = reference(ngram_pair, prompt, 40)
    res = generate(ngram_pair, prompt, max_tokens=40, num_draft_tokens=k)
    assert res.tokens == expected
    assert res.stats.drafted > 0 and res.stats.accepted > 0


def test_ngram_distribution_is_the_target(tiny_models):
    pair = load_pair(target=str(tiny_models.small_target))
    params = SamplingParams(temperature=1.0)
    prompt = PROMPT * 3  # repeated: the lookup always has a guess
    probs = exact_joint(pair, params, prompt)
    drafted = []
    counts = first_two(pair, params, 1500, 2, NGramDrafter(3, 1), prompt, drafted)
    stat, threshold = chi_square(counts, probs)
    print(f"prompt lookup: chi-square {stat:.1f} (threshold {threshold:.1f})")
    assert sum(drafted) > 3000
    assert stat < threshold


class CountingDict(dict):
    lookups = 0

    def get(self, key, default=None):
        CountingDict.lookups += 1
        return super().get(key, default)

    def __setitem__(self, key, value):
        CountingDict.lookups += 1
        super().__setitem__(key, value)


@pytest.mark.parametrize("context", [100, 10_000])
def test_index_cost_per_round_does_not_grow_with_context(context):
    rng = np.random.default_rng(0)
    d = NGramDrafter(ngram_max=3, ngram_min=1)
    d.prefill(rng.integers(0, 50, context).tolist())
    d.context.index = CountingDict(d.context.index)
    CountingDict.lookups = 0
    for token in rng.integers(0, 50, 20).tolist():
        d.propose(4, None, None)
        d.commit([token, token])
    # per round: at most 3 lookups (n = 3, 2, 1) and 3 inserts per emitted token
    assert CountingDict.lookups <= 20 * (3 + 2 * 3)


def test_cli_drafter_ngram(tiny_models, capsys):
    args = ["generate", "--target", str(tiny_models.target), "--drafter", "ngram", "--raw"]
    assert main([*args, "--max-tokens", "24", "--json", REPEATING]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["adaptive"] and stats["num_draft_tokens"] == 8  # lookup's default: auto k
    assert main([*args, "--ngram-min", "3", "--ngram-max", "2", "x"]) == 2
    assert "ngram-min" in capsys.readouterr().err
