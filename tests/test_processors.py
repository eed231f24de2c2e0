"""Penalties, logit bias and log-probabilities: the same transform for target and draft, so
speculation samples exactly the processed target distribution.

- the vectorised penalties (one scatter-add for all rows of a round) equal mlx-lm's own
  processors applied row by row;
- plain decoding with them equals `mlx_lm.generate` with `make_logits_processors`;
- speculative greedy decoding (draft model, prompt lookup) equals plain decoding with them;
- at temperature 1 the first two tokens follow the exact penalised joint distribution
  (chi-square), and the same harness rejects the unpenalised one;
- log-probabilities under speculation equal the target's own, token for token.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_distribution import PROMPT, VOCAB, chi_square

from mlx_spec import Decoder, SamplingParams, SpecError, generate, load_pair
from mlx_spec.core.processors import LogitBias, Penalties, make_processors
from mlx_spec.core.sampling import probabilities
from mlx_spec.drafters.model import ModelDrafter

SETTINGS = dict(
    repetition_penalty=1.3,
    presence_penalty=1.5,
    frequency_penalty=0.7,
    logit_bias={3: 2.0, 5: -1.5},
)


@pytest.fixture(scope="module")
def small_pair(tiny_models):
    return load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))


def mlx_lm_processors(context_size=20):
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(
        SETTINGS["logit_bias"],
        SETTINGS["repetition_penalty"],
        context_size,
        SETTINGS["presence_penalty"],
        context_size,
        SETTINGS["frequency_penalty"],
        context_size,
    )


@pytest.mark.parametrize("context_size", [3, 20])
@pytest.mark.parametrize("n", [1, 4, 5])
def test_vectorised_rows_equal_mlx_lm_row_by_row(n, context_size):
    rng = np.random.default_rng(0)
    vocab = 50
    context = rng.integers(0, vocab, 12).tolist()
    proposed = rng.integers(0, vocab, 4).tolist()
    logits = mx.array(rng.normal(size=(n, vocab)).astype(np.float32))
    ours = make_processors(
        **SETTINGS,
        repetition_context=context_size,
        presence_context=context_size,
        frequency_context=context_size,
    )
    out = logits
    for p in ours:
        out = p(context, mx.array(proposed), out)
    theirs = mlx_lm_processors(context_size)
    for i in range(n):
        seq = context + proposed[: len(proposed) + 1 - n + i]
        row = logits[i : i + 1]
        for p in theirs:
            row = p(mx.array(seq), row)
        np.testing.assert_allclose(np.array(out[i]), np.array(row[0]), rtol=1e-6, atol=1e-6)


def test_processors_off_make_nothing():
    assert make_processors() == []
    assert not Penalties(repetition=1.0)
    assert not LogitBias({})


@pytest.mark.parametrize(
    "settings, why",
    [
        ({"logit_bias": {5: float("nan")}}, "logit_bias\\[5\\] must be a finite number"),
        ({"logit_bias": {5: float("inf")}}, "finite"),
        ({"logit_bias": {"a": 1.0}}, "keys must be token ids"),
        ({"logit_bias": {1.5: 1.0}}, "keys must be token ids"),
        ({"logit_bias": [1]}, "must map token ids"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a finite"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a finite"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be >= 0"),
        ({"repetition_context": -2}, "repetition_context must be an integer"),
    ],
)
def test_bad_settings_are_one_spec_error(settings, why):
    """A NaN bias or penalty made every reply one token repeated, silently; other bad values
    were a TypeError or ValueError from deep inside (found by an adversarial run)."""
    with pytest.raises(SpecError, match=why):
        make_processors(**settings)


def test_plain_decoding_equals_mlx_lm_generate(pair):
    from mlx_lm.generate import generate_step

    prompt = pair.tokenizer.encode("The quick brown fox")
    theirs = []
    for token, _ in generate_step(
        mx.array(prompt),
        pair.target,
        max_tokens=30,
        sampler=lambda lp: mx.argmax(lp, axis=-1),
        logits_processors=mlx_lm_processors(),
    ):
        theirs.append(int(token))
    ours = generate(
        pair, prompt, max_tokens=30, use_draft=False, processors=make_processors(**SETTINGS)
    )
    assert ours.tokens == theirs[: len(ours.tokens)]
    assert len(ours.tokens) == len(theirs) or ours.finish_reason == "stop"
    # and the penalties did something: without them the reply differs
    assert generate(pair, prompt, max_tokens=30, use_draft=False).tokens != ours.tokens


@pytest.mark.parametrize("drafter", ["model", "ngram+model"])
def test_speculative_greedy_equals_plain_with_penalties(tiny_models, drafter):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.copy), drafter=drafter)
    prompt = "def add(a, b):\n    return a + b\n"
    processors = make_processors(**SETTINGS)
    plain = generate(pair, prompt, max_tokens=40, use_draft=False, processors=processors)
    spec = generate(pair, prompt, max_tokens=40, num_draft_tokens=4, processors=processors)
    assert spec.tokens == plain.tokens
    # the copy draft, penalised alike, agrees with the target: everything is accepted
    if drafter == "model":
        assert spec.stats.acceptance_rate == 1.0


def exact_penalised_joint(pair, params, processors) -> np.ndarray:
    """P(t1, t2) under the target alone with the processors, by enumeration."""
    from mlx_spec.core.processors import apply

    logits1 = pair.target(mx.array([PROMPT]))[0, -1]
    p1 = probabilities(apply(processors, PROMPT, [], logits1), params)
    rows = []
    for t in range(VOCAB):
        logits2 = pair.target(mx.array([PROMPT + [t]]))[0, -1]
        rows.append(probabilities(apply(processors, PROMPT + [t], [], logits2), params))
    return np.array(p1)[:, None] * np.array(mx.stack(rows))


def penalised_first_two(pair, params, processors, runs, k=2) -> np.ndarray:
    decoder = Decoder(pair.target, ModelDrafter(pair.draft), eos_token_ids=())
    counts = np.zeros((VOCAB, VOCAB))
    for seed in range(runs):
        decoder.key = mx.random.key(seed)
        decoder.prefill(PROMPT)
        tokens = []
        for r in decoder.rounds(3, params, k, processors=processors):
            tokens += r.tokens
            if len(tokens) >= 2:
                break
        counts[tokens[0], tokens[1]] += 1
    return counts


def test_penalised_speculation_samples_the_penalised_target(small_pair):
    params = SamplingParams(temperature=1.0)
    processors = make_processors(**SETTINGS)
    probs = exact_penalised_joint(small_pair, params, processors)
    unpenalised = exact_penalised_joint(small_pair, params, [])
    assert np.abs(probs - unpenalised).sum() > 0.3, "penalties too weak to tell apart"
    counts = penalised_first_two(small_pair, params, processors, runs=2000)
    stat, threshold = chi_square(counts, probs)
    print(f"penalised: chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold
    # the harness can fail: the same counts are far from the unpenalised distribution
    wrong, _ = chi_square(counts, unpenalised)
    assert wrong > threshold


def test_logprobs_under_speculation_are_the_targets(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    prompt = "Speculative decoding drafts tokens"
    processors = make_processors(presence_penalty=0.5)
    spec = list(
        __import__("mlx_spec").stream(
            pair, prompt, max_tokens=30, num_draft_tokens=3, logprobs=3, processors=processors
        )
    )
    plain = list(
        __import__("mlx_spec").stream(
            pair, prompt, max_tokens=30, use_draft=False, logprobs=3, processors=processors
        )
    )
    assert [e.token for e in spec] == [e.token for e in plain]
    assert any(e.accepted for e in spec)  # drafts were accepted, rounds had several tokens
    np.testing.assert_allclose(
        [e.logprob for e in spec], [e.logprob for e in plain], rtol=1e-4, atol=1e-4
    )
    for a, b in zip(spec, plain, strict=True):
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert len(a.top_logprobs) == 3
        assert a.top_logprobs[0][0] == a.token  # greedy: the chosen token is the top one
        assert a.logprob == pytest.approx(a.top_logprobs[0][1], abs=1e-5)
    # and they are the target's: a full forward pass over the reply gives the same values
    ids = pair.tokenizer.encode(prompt) + [e.token for e in plain]
    logits = pair.target(mx.array([ids]))[0].astype(mx.float32)
    n = len(pair.tokenizer.encode(prompt))
    for i, e in enumerate(plain[:5]):
        row = logits[n - 1 + i]
        from mlx_spec.core.processors import apply

        row = apply(processors, ids[: n + i], [], row)
        expected = (row - mx.logsumexp(row)).tolist()[e.token]
        assert e.logprob == pytest.approx(expected, abs=1e-4)
