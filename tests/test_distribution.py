"""Temperature > 0: the engine's output distribution is exactly the target's.

The first two generated tokens of many seeded runs are compared with the target's exact
joint distribution, enumerated over a 16-token vocabulary. The same harness rejects two
wrong acceptance rules, so the test can fail.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec.decode.rounds as rounds
from mlx_spec import Decoder, SamplingParams, load_pair
from mlx_spec.core.sampling import probabilities
from mlx_spec.drafters.model import ModelDrafter

PROMPT = [5, 9, 3, 12, 7]
VOCAB = 16


@pytest.fixture(scope="module")
def small_pair(tiny_models):
    return load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))


def exact_joint(pair, params: SamplingParams, prompt=PROMPT) -> np.ndarray:
    """P(t1, t2) under the target alone, by enumeration: (vocab, vocab)."""
    p1 = probabilities(pair.target(mx.array([prompt]))[0, -1], params)  # (vocab,)
    seqs = mx.array([prompt + [t] for t in range(VOCAB)])  # (vocab, len+1)
    p2 = probabilities(pair.target(seqs)[:, -1], params)  # (vocab, vocab)
    return np.array(p1)[:, None] * np.array(p2)


def first_two(
    pair,
    params: SamplingParams,
    runs: int,
    k=2,
    drafter=None,
    prompt=PROMPT,
    drafted=None,
    max_tokens=3,
) -> np.ndarray:
    """Counts of (t1, t2) over seeded runs of the engine; one decoder, caches rolled back.

    `k` may be a draft-length policy; `drafted`, a list, collects each round's draft length."""
    drafter = drafter or ModelDrafter(pair.draft)
    decoder = Decoder(pair.target, drafter, eos_token_ids=())
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(runs):
        decoder.key = mx.random.key(seed)
        decoder.prefill(prompt)
        tokens = []
        for r in decoder.rounds(max_tokens, params, k):
            if drafted is not None:
                drafted.append(r.drafted)
            tokens += r.tokens
            if len(tokens) >= 2:
                break
        counts[tokens[0], tokens[1]] += 1
    return counts


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson statistic over cells expecting >= 5 (the rest lumped) and its 99.9% quantile."""
    n = counts.sum()
    expected = probs.ravel() * n
    observed = counts.ravel()
    big = expected >= 5
    e = np.append(expected[big], expected[~big].sum())
    o = np.append(observed[big], observed[~big].sum())
    stat = float(((o - e) ** 2 / np.maximum(e, 1e-12)).sum())
    df = len(e) - 1
    z = 3.09  # Wilson-Hilferty approximation of the chi-square 0.999 quantile
    threshold = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, threshold


def accept_everything(draft_tokens, p, q, key):
    """Wrong: keep every draft token (the output follows the draft)."""
    k = draft_tokens.shape[0]
    return mx.array(k), mx.random.categorical(mx.log(p[k]), key=key)


def resample_target_on_rejection(draft_tokens, p, q, key):
    """Wrong: on rejection sample from p rather than the residual max(0, p - q)."""
    n, _ = engine_verify(draft_tokens, p, q, key)
    return n, mx.random.categorical(mx.log(mx.take(p, n, axis=0)), key=mx.random.split(key)[1])


def sample_and_match(draft_tokens, p, q, key):
    """mlx-lm's rule: sample the target, keep draft tokens equal to its samples. Lossless."""
    k = draft_tokens.shape[0]
    target_samples = mx.random.categorical(mx.log(p), key=key)  # (k+1,)
    n = mx.cumprod((draft_tokens == target_samples[:k]).astype(mx.int32)).sum()
    return n, target_samples[n]


engine_verify = rounds.verify_stochastic


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_first_two_tokens_follow_the_target(small_pair, top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = exact_joint(small_pair, params)
    counts = first_two(small_pair, params, runs=3000)
    stat, threshold = chi_square(counts, probs)
    print(f"top_p={top_p}: chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold


def test_first_two_tokens_follow_the_target_with_a_draft_adapter(tiny_models, tmp_path):
    """A LoRA-adapted draft (what `mlx-spec distill` writes) proposes differently; the
    output still follows the target exactly."""
    import tiny

    adapter = tiny.write_adapter(tmp_path / "adapter", tiny_models.small_draft, size=0.3)
    pair = load_pair(
        target=str(tiny_models.small_target),
        draft=str(tiny_models.small_draft),
        draft_adapter=adapter,
    )
    bare = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    prompt = mx.array([PROMPT])
    assert not mx.allclose(pair.draft(prompt), bare.draft(prompt)).item()
    params = SamplingParams(temperature=1.0)
    stat, threshold = chi_square(first_two(pair, params, runs=2000), exact_joint(pair, params))
    assert stat < threshold


@pytest.mark.parametrize("wrong_rule", [accept_everything, resample_target_on_rejection])
def test_wrong_rules_fail_the_same_check(small_pair, monkeypatch, wrong_rule):
    params = SamplingParams(temperature=1.0)
    probs = exact_joint(small_pair, params)
    monkeypatch.setattr(rounds, "verify_stochastic", wrong_rule)
    counts = first_two(small_pair, params, runs=1500)
    stat, threshold = chi_square(counts, probs)
    print(f"{wrong_rule.__name__}: chi-square {stat:.1f} (threshold {threshold:.1f})")
    assert stat > threshold


def test_sample_and_match_is_lossless_too(small_pair, monkeypatch):
    params = SamplingParams(temperature=1.0)
    probs = exact_joint(small_pair, params)
    monkeypatch.setattr(rounds, "verify_stochastic", sample_and_match)
    stat, threshold = chi_square(first_two(small_pair, params, runs=1500), probs)
    assert stat < threshold


def first_position_acceptance(pair, params, runs: int) -> float:
    decoder = Decoder(pair.target, ModelDrafter(pair.draft), eos_token_ids=())
    accepted = 0
    for seed in range(runs):
        decoder.key = mx.random.key(seed)
        decoder.prefill(PROMPT)
        accepted += next(decoder.rounds(2, params, 1)).accepted
    return accepted / runs


def test_acceptance_rate_is_sum_of_min_p_q(small_pair, monkeypatch):
    params = SamplingParams(temperature=1.0)
    p = np.array(probabilities(small_pair.target(mx.array([PROMPT]))[0, -1], params))
    q = np.array(probabilities(small_pair.draft(mx.array([PROMPT]))[0, -1], params))
    expected, sample_match = np.minimum(p, q).sum(), (p * q).sum()
    assert expected - sample_match > 0.1, "models too alike to tell the rules apart"
    runs = 2000
    tolerance = 4 * math.sqrt(expected * (1 - expected) / runs)
    measured = first_position_acceptance(small_pair, params, runs)
    print(f"acceptance {measured:.3f}, sum min(p,q) {expected:.3f}, sum p*q {sample_match:.3f}")
    assert abs(measured - expected) < tolerance
    monkeypatch.setattr(rounds, "verify_stochastic", sample_and_match)
    theirs = first_position_acceptance(small_pair, params, runs)
    assert abs(theirs - sample_match) < 4 * math.sqrt(sample_match * (1 - sample_match) / runs)
    assert measured > theirs + 0.1
