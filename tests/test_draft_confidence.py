"""A model draft that stops when it is unsure, and lookup-then-model drafting: both lossless.

Stopping early depends only on the draft's own distributions, never on the target, so the
output must stay exactly the target's; these tests check that, and that the caches stay
consistent when a round ends before its k.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_distribution import PROMPT, VOCAB, chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import Decoder, SamplingParams, generate, load_pair, make_decoder
from mlx_spec.cli import main
from mlx_spec.core.policies import FixedK
from mlx_spec.core.sampling import probabilities
from mlx_spec.drafters.lookup_model import LookupThenModel
from mlx_spec.drafters.model import ModelDrafter
from mlx_spec.drafters.ngram import NGramDrafter

REPEATING = "one two three four five one two three four five one two three"


@pytest.mark.parametrize("k", [6, "auto"])
@pytest.mark.parametrize("threshold", [0.3, 0.6])
@pytest.mark.parametrize("draft", ["draft", "noisy"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_confidence_stop_equals_target_alone(tiny_models, draft, threshold, k, prompt):
    pair = load_pair(target=str(tiny_models.target), draft=str(getattr(tiny_models, draft)))
    confident = pair.configured(draft_confidence=threshold)  # the same models, loaded once
    res = generate(confident, prompt, max_tokens=40, num_draft_tokens=k)
    assert res.tokens == reference(pair, prompt, 40)
    full = generate(pair, prompt, max_tokens=40, num_draft_tokens=k)
    assert full.tokens == res.tokens
    if k == "auto":  # the controller's k follows this machine's timings: no counts to compare
        return
    assert res.stats.drafted < full.stats.drafted  # the stop cut some rounds short
    # a draft step per drafted token, and one wasted step per round cut short at most
    assert full.stats.draft_steps == full.stats.drafted
    assert res.stats.drafted < res.stats.draft_steps <= res.stats.drafted + res.stats.target_passes


@pytest.mark.parametrize("threshold", [0.15, 0.25])
def test_cache_offsets_when_rounds_stop_early(tiny_models, threshold):
    pair = load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.noisy), draft_confidence=threshold
    )
    decoder = make_decoder(pair)
    res = generate(pair, PROMPTS[1], max_tokens=30, num_draft_tokens=6, decoder=decoder)
    lengths = res.stats.draft_lengths
    assert any(lengths[1:6]) and lengths[6]  # short rounds and full ones
    n = res.stats.prompt_tokens + len(res.tokens)
    assert decoder.cache[0].offset == n - 1
    drafter = decoder.drafter
    assert drafter.cache[0].offset == n - len(drafter.unfed) == len(drafter.cached)
    # a follow-up turn continues from these caches and still matches a fresh run
    ids = pair.tokenizer.encode(PROMPTS[1]) + res.tokens + [7, 8]
    again = generate(pair, ids, max_tokens=20, num_draft_tokens=6, decoder=decoder)
    assert again.tokens == reference(pair, ids, 20)


def exact_second_third(pair, params) -> np.ndarray:
    """P(t2, t3) under the target alone, summing over t1: (vocab, vocab)."""

    def probs(seqs):
        return np.array(probabilities(pair.target(mx.array(seqs))[:, -1], params))

    p1 = probs([PROMPT])[0]  # (vocab,)
    p2 = probs([PROMPT + [a] for a in range(VOCAB)])  # (vocab, vocab)
    p3 = probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3 = p3.reshape(VOCAB, VOCAB, VOCAB)
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def test_confidence_stop_keeps_the_distribution(tiny_models):
    """Whether the draft stops after x2 depends on the sampled x1 (the small draft's top
    probability is 0.496 at x1 and 0.20-0.74 at x2), so t3 comes from a drafted token in some
    runs and from the target's bonus in others; (t2, t3) must still follow the target."""
    pair = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    params = SamplingParams(temperature=1.0)
    drafter = ModelDrafter(pair.draft, confidence=0.45)
    decoder = Decoder(pair.target, drafter, eos_token_ids=())
    policy = FixedK(4)
    counts, lengths = np.zeros((VOCAB, VOCAB)), set()
    for seed in range(1500):
        decoder.key = mx.random.key(seed)
        decoder.prefill(PROMPT)
        tokens = []
        for r in decoder.rounds(6, params, policy):
            lengths.add(r.drafted)
            tokens += r.tokens
            if len(tokens) >= 3:
                break
        counts[tokens[1], tokens[2]] += 1
    stat, threshold = chi_square(counts, exact_second_third(pair, params))
    print(f"confidence stop: chi-square {stat:.1f} (threshold {threshold:.1f}), k {lengths}")
    assert {2, 4} <= lengths  # stopped after x2 in some runs, drafted all 4 in others
    assert stat < threshold


def test_lookup_then_model_is_lossless_greedy(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    pair = pair.configured(drafter="ngram+model")
    decoder = make_decoder(pair)
    assert isinstance(decoder.drafter, LookupThenModel)
    uses = {"lookup": 0, "model": 0}
    lookup, model = decoder.drafter.lookup.lookup, decoder.drafter.model.propose

    def counted_lookup(k):
        found = lookup(k)
        uses["lookup"] += bool(found)
        return found

    def counted_model(*args, **kwargs):
        uses["model"] += 1
        return model(*args, **kwargs)

    decoder.drafter.lookup.lookup = counted_lookup
    decoder.drafter.model.propose = counted_model
    for prompt in [REPEATING, *PROMPTS]:
        res = generate(pair, prompt, max_tokens=40, num_draft_tokens=4, decoder=decoder)
        assert res.tokens == reference(pair, prompt, 40)
        n = res.stats.prompt_tokens + len(res.tokens)
        assert decoder.drafter.model.cache[0].offset == n - len(decoder.drafter.model.unfed)
    assert uses["lookup"] > 5 and uses["model"] > 5


def test_lookup_then_model_distribution(tiny_models):
    pair = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    params = SamplingParams(temperature=1.0)
    drafter = LookupThenModel(NGramDrafter(2, 1), ModelDrafter(pair.draft))
    counts = first_two(pair, params, 1500, k=2, drafter=drafter, max_tokens=4)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    print(f"ngram+model: chi-square {stat:.1f} (threshold {threshold:.1f})")
    assert stat < threshold


def test_cli_ngram_model_and_confidence(tiny_models, capsys):
    target, draft = str(tiny_models.target), str(tiny_models.noisy)
    base = ["generate", "--target", target, "--raw", "--max-tokens", "12", "--json"]
    assert main([*base, "--draft", draft, "--drafter", "ngram+model", REPEATING]) == 0
    assert main([*base, "--draft", draft, "--num-draft-tokens", "auto", "hello"]) == 0
    assert main([*base, "--draft", draft, "--draft-confidence", "0.3", REPEATING]) == 0
    capsys.readouterr()
    assert main([*base, "--drafter", "ngram+model", "hello"]) == 2
    # a pair without a draft model cannot silently fall back to plain decoding
    assert main(["generate", "--pair", "smollm2-lookup", "--drafter", "model", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.count("needs a draft model") == 2
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--draft", draft, "--draft-confidence", "1", "hello"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[0, 1)" in err
