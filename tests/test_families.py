"""Lossless on every model family a pair can use: sliding windows, recurrent state, stop ids.

Tiny random models of each family (tests/tiny.py: `family_configs`) are built through mlx-lm's
own classes. Sliding-window models get an 8-token window; prompts are longer than it and
replies at least 4x it, so every verify pass crosses the window. Qwen3.5 mixes Gated-DeltaNet
layers (a recurrent state that cannot be trimmed) with attention; mamba is recurrent only.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny
from mlx_lm import stream_generate
from mlx_lm.models.cache import ChunkedKVCache, ConcatenateKVCache, KVCache, RotatingKVCache
from mlx_lm.sample_utils import make_sampler
from test_distribution import chi_square, exact_joint, first_two

from mlx_spec import SamplingParams, SpecError, generate, load_pair, make_decoder
from mlx_spec.core import caches
from mlx_spec.drafters.model import ModelDrafter

FAMILIES = list(tiny.family_configs(320))
SLIDING = {"gemma3_text", "gemma3", "llama_sliding"}
RECURRENT = {"qwen3_5", "mamba"}
# draft = the target plus noise; enough to reject often, not always, on each family
NOISE = {"gemma3_text": 0.02, "gemma3": 0.02, "qwen3_5": 0.03, "mamba": 0.1}
REPLY = 5 * tiny.WINDOW
TEXT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def family_dirs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    configs = tiny.family_configs(320)
    configs["mamba"] = {**tiny.mamba_config(320), "tie_word_embeddings": False}
    return tiny.noisy_pairs(root, configs, tiny_models.tokenizer, NOISE)


@pytest.fixture(scope="module")
def pairs(family_dirs):
    loaded = {}

    def get(name):
        if name not in loaded:
            target, draft = family_dirs[name]
            loaded[name] = load_pair(target=str(target), draft=str(draft))
        return loaded[name]

    return get


def reference(pair, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of mlx-lm on the target alone (its own caches: RotatingKVCache etc.)."""
    sampler = make_sampler(0.0)
    out = stream_generate(pair.target, pair.tokenizer, prompt, max_tokens, sampler=sampler)
    return [r.token for r in out if r.token not in pair.tokenizer.eos_token_ids]


def prompt_ids(pair) -> list[int]:
    ids = pair.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 2 * tiny.WINDOW
    return ids


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("family", [*FAMILIES, "mamba"])
def test_greedy_equals_the_target_alone(pairs, family, k):
    pair = pairs(family)
    prompt = prompt_ids(pair)
    ref = reference(pair, prompt, REPLY)
    assert len(ref) >= 4 * tiny.WINDOW
    res = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=k)
    assert res.tokens == ref
    assert 0 < res.stats.acceptance_rate < 1  # rounds were rolled back, some partly
    if family in RECURRENT:
        assert res.stats.replayed_tokens > 0  # rejected rounds restored and replayed
    else:
        assert res.stats.replayed_tokens == 0


@pytest.mark.parametrize("family", ["gemma3_text", "llama_sliding", "qwen3_5", "mamba"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_second_turn_through_a_kept_decoder_equals_a_fresh_run(pairs, family_dirs, family, drafter):
    target, draft = family_dirs[family]
    pair = (
        pairs(family)
        if drafter == "model"
        else load_pair(target=str(target), drafter="ngram", num_draft_tokens=3)
    )
    prompt = prompt_ids(pair)
    decoder = make_decoder(pair)
    # the first reply stops midway (max_tokens), then the conversation goes on
    first = generate(pair, prompt, max_tokens=13, num_draft_tokens=3, decoder=decoder)
    assert first.finish_reason == "length"
    follow = prompt + first.tokens + pair.tokenizer.encode(" and then", add_special_tokens=False)
    again = generate(pair, follow, max_tokens=REPLY, num_draft_tokens=3, decoder=decoder)
    assert again.stats.prompt_tokens_reused > len(prompt)
    assert again.tokens == reference(pair, follow, REPLY)
    # a third turn that rewrites the middle of the conversation: the caches must forget
    # far back (a window or a recurrent state cannot: they start over), never keep stale rows
    rewrite = prompt[:5] + follow[-9:]
    third = generate(pair, rewrite, max_tokens=REPLY, num_draft_tokens=3, decoder=decoder)
    assert third.tokens == reference(pair, rewrite, REPLY)
    # plain decoding through the same decoder (its look-ahead step is rolled back too)
    fourth_prompt = rewrite + third.tokens + [7, 8, 9]
    fourth = generate(pair, fourth_prompt, max_tokens=20, use_draft=False, decoder=decoder)
    assert fourth.tokens == reference(pair, fourth_prompt, 20)


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_buffer_compacts_and_stays_exact(pairs, monkeypatch, family):
    """A margin and slack far below the defaults: the buffer drops old rows every few tokens,
    and a roll-back longer than the margin is refused rather than done wrong."""
    monkeypatch.setattr(caches, "WINDOW_MARGIN", 7)  # k = 6: a round feeds 7 tokens
    monkeypatch.setattr(caches, "WINDOW_SLACK", 3)
    pair = pairs(family)
    prompt = prompt_ids(pair)
    decoder = make_decoder(pair)
    windowed = [c for c in decoder.cache if isinstance(c, caches.WindowedKVCache)]
    assert windowed and all(c.margin == 7 for c in windowed)
    res = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=6, decoder=decoder)
    assert res.tokens == reference(pair, prompt, REPLY)
    offset = len(prompt) + len(res.tokens) - 1
    for c in windowed:
        assert c.offset == offset and c.dropped > 0
        assert tiny.WINDOW - 1 <= c.stored <= tiny.WINDOW - 1 + 7 + 3
        with pytest.raises(caches.CacheRollbackError):
            caches.rollback(decoder.cache, 9)  # more than the margin
        assert c.offset == offset  # a refused roll-back changed nothing


def test_mlx_lm_rotating_cache_fails_loudly_not_silently(pairs, monkeypatch):
    """Why WindowedKVCache exists: past the window mlx-lm's RotatingKVCache trims nothing
    (its trim_prompt_cache returns 0 and raises nothing). Left in place, the engine's checked
    roll-back stops with an error instead of decoding on from a wrong cache."""
    monkeypatch.setattr(caches, "_convert", lambda c: c)
    monkeypatch.setattr(caches, "ROLLBACK_TYPES", (*caches.ROLLBACK_TYPES, RotatingKVCache))
    pair = pairs("gemma3_text")
    assert any(isinstance(c, RotatingKVCache) for c in make_decoder(pair).cache)
    with pytest.raises(caches.CacheRollbackError):
        generate(pair, prompt_ids(pair), max_tokens=REPLY, num_draft_tokens=3)


def test_a_cache_that_cannot_roll_back_is_refused_before_any_token():
    class ConcatModel:  # afm7's kv-reuse layer: its trim keeps the rows it says it forgot
        def make_cache(self):
            return [KVCache(), ConcatenateKVCache()]

    with pytest.raises(SpecError, match="ConcatenateKVCache.*cannot be rolled back"):
        caches.make_cache(ConcatModel())
    # Llama 4's chunked attention rolls back within a chunk (test_llama4.py)
    made = caches.make_cache(type("Chunked", (), {"make_cache": lambda _: [ChunkedKVCache(8)]})())
    assert type(made[0]) is caches.MarginChunkedKVCache


def test_recurrent_rollback_is_refused_not_ignored(pairs):
    decoder = make_decoder(pairs("qwen3_5"))
    assert decoder.recurrent
    assert not caches.can_rollback(decoder.cache, 1)
    with pytest.raises(caches.CacheRollbackError):
        caches.rollback(decoder.cache, 1)


def test_recurrent_draft_restores_its_state(family_dirs):
    """Qwen3.5 drafting for Qwen3.5: the draft's recurrent state is restored to the step
    that fed the last accepted token."""
    target, _ = family_dirs["llama"]
    _, draft = family_dirs["qwen3_5"]
    pair = load_pair(target=str(target), draft=str(draft))
    assert isinstance(make_decoder(pair).drafter, ModelDrafter)
    assert make_decoder(pair).drafter.recurrent
    prompt = prompt_ids(pair)
    res = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=4)
    assert res.tokens == reference(pair, prompt, REPLY)


def test_stop_id_declared_only_in_generation_config(family_dirs, tmp_path):
    """Qwen3 lists <|endoftext|> among its stop ids only in generation_config.json."""
    target, draft = family_dirs["qwen3"]
    pair = load_pair(target=str(target), draft=str(draft))
    prompt = prompt_ids(pair)
    ref = reference(pair, prompt, REPLY)
    # the first token that did not occur before, well into the reply
    stop_at = next(i for i in range(6, len(ref)) if ref[i] not in ref[:i])
    stop_id = ref[stop_at]
    moved = tmp_path / "qwen3-genconfig"
    moved.mkdir()
    for f in target.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    (moved / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop_id]}))
    for draft_arg in (str(draft), None):
        stopped = load_pair(target=str(moved), draft=draft_arg)
        assert stop_id in stopped.tokenizer.eos_token_ids
        res = generate(stopped, prompt, max_tokens=REPLY, num_draft_tokens=3)
        assert res.tokens == ref[:stop_at] and res.finish_reason == "stop"


def test_hybrid_distribution_at_temperature_one(tiny_models, tmp_path):
    """Qwen3.5 target and draft on a 16-token vocabulary: the first two tokens over seeded
    runs follow the target's exact joint (replayed rounds included)."""
    cfg = {**tiny.family_configs(16)["qwen3_5"], "num_hidden_layers": 2, "hidden_size": 64}
    weights = tiny.family_weights(cfg, seed=3, head_scale=2.0)
    target = tiny.write_model(tmp_path / "t", cfg, weights, tiny_models.tokenizer)
    draft = tiny.write_model(tmp_path / "d", cfg, tiny.noisy(weights, 0.3), tiny_models.tokenizer)
    pair = load_pair(target=str(target), draft=str(draft))
    params = SamplingParams(temperature=1.0)
    counts = first_two(pair, params, runs=1200, k=2)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold, (stat, threshold)
    assert np.count_nonzero(counts) > 20  # not a degenerate distribution
