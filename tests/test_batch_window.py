"""Sliding-window pairs in a batch: every row's output is what it would be alone.

The target and the draft are tiny sliding-window models (tests/tiny.py, an 8-token window):
Mistral-style `llama_sliding` and Gemma 3's text model. Their windowed layers are batched in
a `BatchWindowedKVCache`; with a margin and slack far below the defaults the buffer drops its
front every few tokens, so a long row runs far past its window (its oldest tokens gone) while
a short one is still inside it, and the rows roll back by different amounts on those layers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tiny
from test_families import reference

import mlx_spec
from mlx_spec import GenerationConfig, SpecError, generate, load_pair
from mlx_spec.core import caches
from mlx_spec.core.batch_caches import BatchWindowedKVCache, check_batchable, rollback_rows
from mlx_spec.core.caches import CacheRollbackError, WindowedKVCache
from mlx_spec.decode.batch_rows import into_decoder
from mlx_spec.decode.generate import make_batch_decoder

FAMILIES = ["llama_sliding", "gemma3_text"]
NOISE = {"llama_sliding": 0.05, "gemma3_text": 0.02}  # rejects often, not always
MARGIN, SLACK = 5, 3  # k = 3: a round feeds 4 tokens; the buffer drops every few tokens
LONG = (
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog. "
    "Speculative decoding drafts tokens with a small model and verifies them."
)


@pytest.fixture(scope="module")
def window_dirs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_window")
    dirs = {}
    for name in FAMILIES:
        cfg = tiny.family_configs(320)[name]
        weights = tiny.family_weights(cfg, seed=0)
        target = tiny.write_model(root / name, cfg, weights, tiny_models.tokenizer)
        noisy = tiny.noisy(weights, NOISE[name])
        draft = tiny.write_model(root / f"{name}-draft", cfg, noisy, tiny_models.tokenizer)
        dirs[name] = (target, draft)
    return dirs


@pytest.fixture
def small_window(monkeypatch):
    monkeypatch.setattr(caches, "WINDOW_MARGIN", MARGIN)
    monkeypatch.setattr(caches, "WINDOW_SLACK", SLACK)


def pair_of(window_dirs, family: str, drafter: str):
    target, draft = window_dirs[family]
    if drafter == "model":
        return load_pair(target=str(target), draft=str(draft))
    return load_pair(target=str(target)).configured(drafter="ngram")


def windowed(cache: list) -> list:
    return [c for c in cache if isinstance(c, BatchWindowedKVCache)]


def test_the_mask_is_causal_within_each_rows_window_after_its_left_padding():
    """Row b, query j (column idx + j) sees column r iff r is past its left padding, not
    after the query, and less than a window before it."""
    window, idx, pads, n = 4, 10, [0, 3, 9], 3
    c = BatchWindowedKVCache(pads, window)
    c._idx = idx
    mask = np.array(c.make_mask(n))  # (B, 1, N, idx + N)
    assert mask.shape == (len(pads), 1, n, idx + n)
    for b, pad in enumerate(pads):
        for j in range(n):
            q = idx + j
            want = [pad <= r <= q and q - r < window for r in range(idx + n)]
            assert mask[b, 0, j].tolist() == want, (b, j)
    # a model that leaves the window to the cache (window_size None) gets the cache's
    assert (np.array(c.make_mask(n, window_size=None)) == mask).all()
    assert (np.array(c.make_mask(n, window_size=2)) <= mask).all()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_rows_equal_each_alone(window_dirs, small_window, family, drafter):
    """An 82-token prompt (far past its window: its oldest tokens dropped) beside 3- and
    5-token ones (inside it at first), replies that cross the window, rows that join between
    rounds and leave at different rounds: each row's tokens are the target's alone (mlx-lm's
    own RotatingKVCache), and some rounds reject different numbers per row."""
    pair = pair_of(window_dirs, family, drafter)
    long = pair.tokenizer.encode(LONG)
    assert len(long) >= 40
    prompts = [long, long[5:8], pair.tokenizer.encode("Once upon"), long[10:30]]
    schedule = [(0, 0, 30), (1, 0, 24), (2, 3, 28), (3, 6, 12)]  # prompt, joins, max_tokens
    decoder = make_batch_decoder(pair, 3)
    ids, out, done, rnd, mixed = {}, {}, set(), 0, 0
    longest_idx, dropped = 0, 0
    while len(done) < len(schedule):
        for i, (p, start, max_tokens) in enumerate(schedule):
            if start == rnd:
                ids[decoder.add(prompts[p], GenerationConfig(max_tokens=max_tokens))] = i
                out[i] = []
        updates = decoder.step()
        rejected = set()
        for rid, u in updates.items():
            out[ids[rid]] += u.tokens
            if u.round.drafted:
                rejected.add(u.round.drafted - u.round.accepted)
            if u.done:
                done.add(ids[rid])
        mixed += len(rejected) > 1
        if decoder.cache is not None:
            for c in windowed(decoder.cache):
                longest_idx = max(longest_idx, c._idx)
                gone = zip(c.offset.tolist(), c.stored(), strict=True)
                dropped = max(dropped, *(offset - held for offset, held in gone))
        rnd += 1
        assert rnd < 100
    for i, (p, _, max_tokens) in enumerate(schedule):
        assert out[i] == reference(pair, prompts[p], max_tokens), f"row {i}"
    assert mixed > 0  # rows were rolled back by different amounts
    assert dropped > 30  # a row's oldest tokens were dropped, many compactions
    # the buffer never held more than a compaction lets it (+ the round's K + 1 columns)
    assert longest_idx <= tiny.WINDOW - 1 + MARGIN + SLACK + 4


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_kept_and_removed_continues_single_stream(window_dirs, small_window, family):
    """Rows added with keep=True hand back WindowedKVCaches (their oldest tokens dropped): one
    that finished, one removed mid-way; a single-stream decoder continues each with the
    tokens and rounds of a fresh `generate`."""
    pair = pair_of(window_dirs, family, "model")
    long = pair.tokenizer.encode(LONG)
    decoder = make_batch_decoder(pair, 3)
    finished = decoder.add(long, GenerationConfig(max_tokens=20), keep=True)
    removed = decoder.add(long[3:9], GenerationConfig(max_tokens=60), keep=True)
    other = decoder.add(long[20:24], GenerationConfig(max_tokens=60))
    states = {}
    for _ in range(40):
        for rid, u in decoder.step().items():
            if u.done:
                states[rid] = u.state
        if finished in states:
            break
    states[removed] = decoder.remove(removed)
    assert len(decoder) == 1 and decoder.row(other)
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    config = GenerationConfig(max_tokens=24, num_draft_tokens=3)
    for rid in (finished, removed):
        state = states[rid]
        layers = [c for c in state.cache if isinstance(c, WindowedKVCache)]
        assert layers and all(c.offset == len(state.sequence) - 1 for c in layers)
        assert all(c.dropped > 0 for c in layers)  # it ran past its window and forgot
        d = into_decoder(mlx_spec.make_decoder(pair), state)
        follow = state.sequence + more
        res, fresh = generate(pair, follow, config, decoder=d), generate(pair, follow, config)
        assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
        assert res.tokens == fresh.tokens == reference(pair, follow, 24)
        assert [r.to_json() for r in res.rounds] == [r.to_json() for r in fresh.rounds]


def test_a_roll_back_past_a_rows_window_is_refused(window_dirs, small_window):
    """A row that would lose part of its window raises before any layer changed."""
    pair = pair_of(window_dirs, "llama_sliding", "model")
    long = pair.tokenizer.encode(LONG)
    decoder = make_batch_decoder(pair, 3)
    decoder.add(long, GenerationConfig(max_tokens=40))
    decoder.add(long[:3], GenerationConfig(max_tokens=40))
    for _ in range(3):
        decoder.step()
    c = windowed(decoder.cache)[0]
    before = (c.offset.tolist(), c.left_padding.tolist(), c._idx)
    stored = c.stored()
    assert stored[0] < c.offset.tolist()[0]  # the long row dropped its oldest tokens
    too_many = stored[0] - (tiny.WINDOW - 1) + 1
    with pytest.raises(CacheRollbackError, match="row 0 cannot forget"):
        rollback_rows(decoder.cache, [too_many, 0])
    assert (c.offset.tolist(), c.left_padding.tolist(), c._idx) == before
    assert c.trim(too_many) == 0  # trimmed alike, it refuses too
    rollback_rows(decoder.cache, [0, 1])  # within the margin: done
    assert c.offset.tolist() == [before[0][0], before[0][1] - 1]


def test_attention_sinks_recurrent_and_chunked_stay_refused(tiny_models):
    from mlx_lm.models.cache import RotatingKVCache

    class Sinks:
        def make_cache(self):
            return [RotatingKVCache(max_size=8, keep=4)]

    with pytest.raises(SpecError, match="attention-sink"):
        check_batchable(Sinks())
    # (a plain batch's check: a BatchDecoder restores recurrent rows and runs Llama 4's chunked
    # attention row by row, test_batch_recurrent.py and test_llama4.py)
    for target, why in [(tiny_models.mamba, "recurrent"), (tiny_models.chunked, "chunked")]:
        with pytest.raises(SpecError, match=why):
            check_batchable(load_pair(target=str(target)).target)


def test_the_plain_batch_of_eagle_training_still_refuses_windows(window_dirs):
    target, _ = window_dirs["llama_sliding"]
    model = load_pair(target=str(target)).target
    check_batchable(model)
    with pytest.raises(SpecError, match="sliding-window"):
        check_batchable(model, windows=False)


def test_batch_generate_on_a_windowed_pair_equals_generate(window_dirs):
    """The default margin and slack, `batch_generate`'s rows in and out (max_batch 2): greedy
    rows give the target's plain decoding, a seeded sampled row the samples it draws alone."""
    pair = pair_of(window_dirs, "gemma3_text", "model")
    long = pair.tokenizer.encode(LONG)
    prompts = [long, long[:4], long[8:20], long[2:6]]
    settings = [{}, {}, {}, {"temperature": 0.8, "seed": 3}]
    configs = [
        GenerationConfig(max_tokens=m, num_draft_tokens=3, **kw)
        for m, kw in zip((30, 20, 25, 24), settings, strict=True)
    ]
    results = mlx_spec.batch_generate(pair, prompts, configs, max_batch=2)
    for p, c, res in zip(prompts[:3], configs[:3], results[:3], strict=True):
        assert res.tokens == generate(pair, p, c.replace(use_draft=False)).tokens
    assert results[3].tokens == generate(pair, prompts[3], configs[3]).tokens
    assert any(r.stats.drafted > 0 for r in results)
    mx.clear_cache()


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss"])
def test_real_sliding_configs_batch_losslessly(tiny_models, small_window, tmp_path, family):
    """Shrunk published configs (tests/real_configs.py): Gemma 3's multimodal checkpoint (5
    sliding layers to 1 global, a local rope base) and GPT-OSS (sliding and full layers, learned
    attention sinks, MoE, YaRN). Rows of different lengths, each the target's alone."""
    import real_configs

    cfg = real_configs.real_configs(320)[family]
    weights = real_configs.real_weights(cfg, seed=0)
    target = tiny.write_model(tmp_path / "t", cfg, weights, tiny_models.tokenizer)
    noisy = tiny.noisy(weights, 0.01 if family == "gemma3" else 0.03)
    draft = tiny.write_model(tmp_path / "d", cfg, noisy, tiny_models.tokenizer)
    pair = load_pair(target=str(target), draft=str(draft))
    assert any(isinstance(c, WindowedKVCache) for c in caches.make_cache(pair.target))
    long = pair.tokenizer.encode(LONG)
    prompts = [long, long[:3], long[20:32]]
    configs = [GenerationConfig(max_tokens=m, num_draft_tokens=3) for m in (24, 30, 20)]
    results = mlx_spec.batch_generate(pair, prompts, configs)
    for p, c, res in zip(prompts, configs, results, strict=True):
        assert res.tokens == reference(pair, p, c.max_tokens)
    assert any(0 < r.stats.accepted < r.stats.drafted for r in results)


@pytest.mark.parametrize("back", [3, 12])
def test_a_row_starts_from_a_kept_windowed_decoder(window_dirs, small_window, back):
    """Turn 1 single-stream (a kept Decoder, as the server's prompt cache keeps it, its
    windows past their front); turn 2 re-renders the last `back` tokens: within the margin
    the row starts from its caches (rolled back, only the rest prefilled), beyond it a window
    cannot forget that much and the row starts afresh. Either way a fresh run's tokens."""
    pair = pair_of(window_dirs, "llama_sliding", "model")
    config = GenerationConfig(max_tokens=20, num_draft_tokens=3)
    d = mlx_spec.make_decoder(pair)
    generate(pair, LONG, config, decoder=d)
    assert all(c.dropped > 0 for c in d.cache if isinstance(c, WindowedKVCache))
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    prompt = d.sequence[:-back] + more
    held = len(d.sequence) - 1
    decoder = make_batch_decoder(pair, 3)
    other = decoder.add(pair.tokenizer.encode("Once upon"), GenerationConfig(max_tokens=8))
    rid = decoder.add(prompt, config, kept=d)
    assert decoder.row(rid).reused == (held - back + 1 if back <= MARGIN else 0)
    out = []
    while len(decoder):
        for r, u in decoder.step().items():
            out += u.tokens if r == rid else []
    assert other != rid and out == generate(pair, prompt, config).tokens
