"""A decoder cannot be left wrong, and bad ids or settings never reach MLX (issue: nothing
crashes, nothing silently wrong). Each case failed before: a segfault, NaN probabilities, or a
KV cache one token off for every later call."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
import tiny

from mlx_spec import SpecError, generate, load_pair, make_decoder, stream
from mlx_spec.drafters.model import ModelDrafter

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def plain(tiny_models):
    return load_pair(target=str(tiny_models.target))


def fresh(pair, prompt, **kwargs):
    return generate(pair, prompt, **kwargs).tokens


def conversation(pair, decoder, first, max_tokens=12, **kwargs):
    """A second turn through `decoder` and the same turn from a fresh decoder."""
    follow = first + [7, 8, 9]
    kept = generate(pair, follow, max_tokens=max_tokens, decoder=decoder, **kwargs).tokens
    return kept, fresh(pair, follow, max_tokens=max_tokens, **kwargs)


@pytest.mark.parametrize("ids", [[10**6], [2**31], [320], [-1], [2**70], [1.5], [True], ["7"]])
def test_token_ids_outside_the_vocabulary_are_refused(plain, ids):
    with pytest.raises(SpecError, match="token id"):
        generate(plain, [5, *ids], max_tokens=2)


def test_the_last_valid_id_is_accepted(plain):
    assert len(generate(plain, [5, 319], max_tokens=2).tokens) == 2


def test_a_draft_with_extra_head_rows_never_proposes_them(tiny_models, tmp_path):
    """Some checkpoints pad the output head: the draft's extra rows are ids the target's
    embedding does not have (MLX would read past it)."""
    cfg = {**tiny.llama_config(330, layers=2), "vocab_size": 330}
    weights = tiny.random_weights(cfg, seed=5)
    # make the padding rows the draft's favourites, so an unmasked draft would propose them
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate([head[:320], 50 * head[320:]])
    draft = tiny.write_model(tmp_path / "padded", cfg, weights, tiny_models.tokenizer)
    pair = load_pair(target=str(tiny_models.target), draft=str(draft))
    proposed = []
    original = ModelDrafter.propose

    def spy(self, k, params, key, **kwargs):
        tokens, q = original(self, k, params, key, **kwargs)
        proposed.extend(tokens.tolist())
        assert q is None or q.shape[-1] == 320
        return tokens, q

    ModelDrafter.propose = spy
    try:
        greedy = generate(pair, PROMPT, max_tokens=20, num_draft_tokens=3)
        sampled = generate(pair, PROMPT, max_tokens=20, num_draft_tokens=3, temperature=1, seed=0)
    finally:
        ModelDrafter.propose = original
    assert proposed and max(proposed) < 320
    target_only = load_pair(target=str(tiny_models.target))
    assert greedy.tokens == fresh(target_only, PROMPT, max_tokens=20)
    assert max(sampled.tokens) < 320


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_stream_kept_open_does_not_leave_the_decoder_wrong(pair, plain, speculative):
    p = pair if speculative else plain
    decoder = make_decoder(p)
    first = p.tokenizer.encode(PROMPT, add_special_tokens=False)
    gen = stream(p, first, max_tokens=20, decoder=decoder)
    taken = [next(gen).token for _ in range(3)]
    assert len(taken) == 3  # the generator stays open, its look-ahead step queued
    kept, expected = conversation(p, decoder, first)
    assert kept == expected
    kept, expected = conversation(p, decoder, first + [11])  # and stays right afterwards
    assert kept == expected
    # the old stream cannot go on now: its caches belong to the newer one
    with pytest.raises(SpecError, match="another stream"):
        next(gen)


def test_two_interleaved_streams_on_one_decoder(pair):
    decoder = make_decoder(pair)
    a = stream(pair, PROMPT, max_tokens=30, decoder=decoder)
    next(a)
    b = stream(pair, "The quick brown fox", max_tokens=30, decoder=decoder)
    b_tokens = [next(b).token]
    with pytest.raises(SpecError, match="another stream"):
        for _ in range(30):
            next(a)
    b_tokens += [ev.token for ev in b]
    assert b_tokens == fresh(pair, "The quick brown fox", max_tokens=30)


def test_a_stream_closed_early_keeps_the_cache_for_the_next_turn(plain):
    """The chat app stops replies by closing the stream: that must not cost a re-prefill."""
    decoder = make_decoder(plain)
    first = plain.tokenizer.encode(PROMPT, add_special_tokens=False)
    gen = stream(plain, first, max_tokens=20, decoder=decoder)
    taken = [next(gen).token for _ in range(4)]
    gen.close()
    follow = first + taken + [7, 8]
    res = generate(plain, follow, max_tokens=10, decoder=decoder)
    assert res.stats.prompt_tokens_reused == len(first) + len(taken) - 1
    assert res.tokens == fresh(plain, follow, max_tokens=10)


class Interrupting:
    """The target model, interrupted (Ctrl-C) on its n-th forward pass: before it runs, or
    after it has run and filled the cache but before the engine could use the result."""

    def __init__(self, model, at: int, after: bool):
        self.model, self.at, self.after, self.calls = model, at, after, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at and not self.after:
            raise KeyboardInterrupt
        out = self.model(*args, **kwargs)
        if self.calls == self.at:
            mx.eval(out)
            raise KeyboardInterrupt
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("after", [False, True], ids=["before-pass", "after-pass"])
@pytest.mark.parametrize("at", [1, 2, 3, 5, 8])  # 1: during prefill, later: mid-generation
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_ctrl_c_anywhere_does_not_corrupt_a_kept_decoder(pair, plain, speculative, at, after):
    p = pair if speculative else plain
    interrupting = Interrupting(p.target, at=10**9, after=after)
    p = dataclasses.replace(p, target=interrupting)
    decoder = make_decoder(p)
    first = p.tokenizer.encode(PROMPT, add_special_tokens=False)
    generate(p, first, max_tokens=6, decoder=decoder)  # a turn that finished
    interrupting.calls, interrupting.at = 0, at
    with pytest.raises(KeyboardInterrupt):
        generate(p, first + [11, 12], max_tokens=30, decoder=decoder)
    interrupting.at = 10**9
    kept, expected = conversation(p, decoder, first)
    assert kept == expected


def test_a_decoder_is_bound_to_its_pair(pair, plain):
    decoder = make_decoder(pair)
    with pytest.raises(SpecError, match="another pair"):
        generate(plain, PROMPT, max_tokens=3, decoder=decoder)
    with pytest.raises(SpecError, match="decoder must be a Decoder"):  # (an AttributeError)
        generate(pair, PROMPT, max_tokens=3, decoder=5)


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-7])
def test_tiny_temperatures_decode_greedily(pair, temperature):
    res = generate(pair, PROMPT, max_tokens=15, temperature=temperature, top_k=5, seed=0)
    assert res.tokens == fresh(pair, PROMPT, max_tokens=15)


def test_small_temperature_is_not_nan(plain):
    """1e-3 samples (it is above the greedy cut-off) and stays finite: not token 0 forever."""
    res = generate(plain, PROMPT, max_tokens=15, temperature=1e-3, top_p=0.9, seed=1)
    assert res.tokens == fresh(plain, PROMPT, max_tokens=15)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1.0])
def test_non_finite_temperatures_are_refused(pair, temperature):
    with pytest.raises(SpecError, match="temperature"):
        generate(pair, PROMPT, max_tokens=3, temperature=temperature, top_k=5)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "3"])
def test_bad_seeds_are_refused(pair, seed):
    with pytest.raises(SpecError, match="seed"):
        generate(pair, PROMPT, max_tokens=3, temperature=1.0, seed=seed)


def test_the_largest_seed_is_accepted(pair):
    res = generate(pair, PROMPT, max_tokens=3, temperature=1.0, seed=2**64 - 1)
    assert len(res.tokens) == 3
