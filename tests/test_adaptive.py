"""Adaptive draft length: chosen from past rounds only, so the output stays the target's."""

from __future__ import annotations

import pytest
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import SamplingParams, generate, load_pair
from mlx_spec.drafters import AdaptiveK


def test_policy_grows_on_full_acceptance_and_shrinks_on_rejection():
    policy = AdaptiveK(k_max=8, start=4)
    policy.update(verified=4, drafted=4)
    assert policy.next() == 6
    policy.update(6, 6)
    policy.update(8, 8)
    assert policy.next() == 8  # capped at k_max
    policy.update(2, 8)
    assert policy.next() == 7
    for _ in range(10):
        policy.update(0, policy.next())
    assert policy.next() == 1  # never below 1
    policy.update(0, 0)  # nothing proposed: no change
    assert policy.next() == 1


@pytest.mark.parametrize("confidence", [None, 0.0], ids=["default-stop", "no-stop"])
@pytest.mark.parametrize("draft", ["draft", "noisy", "copy"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_auto_equals_target_alone(tiny_models, draft, prompt, confidence):
    pair = load_pair(target=str(tiny_models.target), draft=str(getattr(tiny_models, draft)))
    res = generate(
        pair, prompt, max_tokens=40, num_draft_tokens="auto", draft_confidence=confidence
    )
    assert res.tokens == reference(pair, prompt, 40)
    stats = res.stats
    assert stats.adaptive and stats.num_draft_tokens == 8
    assert sum(stats.draft_lengths) == stats.target_passes
    assert stats.draft_lengths[0] <= 1  # every round drafts, but a last one with 1 token left
    assert 0 < stats.mean_draft_length <= 8
    if draft == "copy" and confidence == 0:  # always accepted, never stopped: k climbs to 8
        assert stats.draft_lengths[8] > 0


def test_auto_distribution_is_the_target(tiny_models):
    pair = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    params = SamplingParams(temperature=1.0)
    probs = exact_joint(pair, params)
    policy = AdaptiveK(k_max=4, start=2)  # shared across runs: k varies with history
    drafted = []
    counts = first_two(pair, params, 2500, policy, drafted=drafted, max_tokens=6)
    lengths = set(drafted)
    stat, threshold = chi_square(counts, probs)
    print(
        f"adaptive k: chi-square {stat:.1f} (threshold {threshold:.1f}), k used {sorted(lengths)}"
    )
    assert len(lengths) >= 3
    assert stat < threshold
