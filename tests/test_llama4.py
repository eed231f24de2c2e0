"""Llama 4 speculates: its chunked attention (mlx-lm's ChunkedKVCache) rolls back within a chunk.

Tiny Llama 4 targets shrunk from the published Scout and Maverick configs
(tests/real_configs.py: an 8-token chunk, so prompts and replies cross many chunk edges;
no-RoPE global layers with attention temperature tuning, qk-norm, MoE). The draft is the
target plus noise, itself a Llama 4 whose cache rolls back too. mlx-lm's ChunkedKVCache keeps
only the last chunk before each pass: a draft fed one token a step drops the front of its chunk
as it goes, and could not undo its drafts (the first try here: "no longer holds the chunk of
position 47" at k = 6). `caches.MarginChunkedKVCache` keeps a margin more. A roll-back past
what it holds is refused in one line and changes nothing. Its own code computes the chunk mask
from one offset for the whole batch: a batch runs it row by row, each row on its own caches,
every row exact.
"""

from __future__ import annotations

import pytest
import real_configs
import tiny
from conftest import VOCAB
from mlx_lm.models.cache import ChunkedKVCache, KVCache
from test_batch import (
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_schedule_exact,
    run_schedule,
)
from test_families import reference

import mlx_spec
from mlx_spec import SpecError, generate, load_pair, make_decoder
from mlx_spec.core import caches
from mlx_spec.core.batch_caches import check_batchable
from mlx_spec.decode.generate import make_batch_decoder

CONFIGS = real_configs.llama4_configs(VOCAB)
TEXT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."
REPLY = 40


@pytest.fixture(scope="module")
def dirs(tiny_models, tmp_path_factory):
    return tiny.noisy_pairs(tmp_path_factory.mktemp("llama4"), CONFIGS, tiny_models.tokenizer)


@pytest.fixture(scope="module")
def pairs(dirs):
    loaded = {}

    def get(name, drafter="model"):
        if (name, drafter) not in loaded:
            target, draft = dirs[name]
            extra = {"draft": str(draft)} if drafter == "model" else {"drafter": drafter}
            loaded[name, drafter] = load_pair(target=str(target), **extra)
        return loaded[name, drafter]

    return get


def prompt_ids(pair) -> list[int]:
    ids = pair.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 2 * CONFIGS["llama4-scout"]["text_config"]["attention_chunk_size"]
    return ids


def test_the_caches_are_chunked_as_mlx_lm_builds_them(pairs):
    pair = pairs("llama4-scout")
    kinds = [type(c) for c in pair.target.make_cache()]
    assert kinds == [ChunkedKVCache, ChunkedKVCache, ChunkedKVCache, KVCache]
    decoder = make_decoder(pair)
    assert [type(c) for c in decoder.cache][:3] == [caches.MarginChunkedKVCache] * 3


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_equals_the_target_alone(pairs, family, k):
    pair = pairs(family)
    prompt = prompt_ids(pair)
    ref = reference(pair, prompt, REPLY)
    assert len(ref) == REPLY
    res = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=k)
    assert res.tokens == ref
    assert 0 < res.stats.acceptance_rate < 1  # rounds were rolled back, some partly


def test_prompt_lookup_equals_the_target_alone(pairs):
    pair = pairs("llama4-scout", "ngram")
    prompt = prompt_ids(pair) * 2  # something to look up
    res = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=4)
    assert res.tokens == reference(pair, prompt, REPLY)
    assert res.stats.drafted > 0


def test_a_second_turn_through_a_kept_decoder_equals_a_fresh_run(pairs):
    """The kept caches forget the end of the first turn (within the chunk) and go on; a
    rewrite of the middle of the conversation (far back, past the chunk they hold) starts
    over rather than decode from a cache that dropped what it needs."""
    pair = pairs("llama4-scout")
    prompt = prompt_ids(pair)
    decoder = make_decoder(pair)
    first = generate(pair, prompt, max_tokens=13, num_draft_tokens=3, decoder=decoder)
    follow = prompt + first.tokens + pair.tokenizer.encode(" and then", add_special_tokens=False)
    again = generate(pair, follow, max_tokens=REPLY, num_draft_tokens=3, decoder=decoder)
    assert again.stats.prompt_tokens_reused > len(prompt)
    assert again.tokens == reference(pair, follow, REPLY)
    rewrite = prompt[:5] + follow[-9:]
    third = generate(pair, rewrite, max_tokens=REPLY, num_draft_tokens=3, decoder=decoder)
    assert third.tokens == reference(pair, rewrite, REPLY)


def test_a_roll_back_across_a_chunk_it_no_longer_holds_is_refused(pairs, monkeypatch):
    """A margin and slack far below the defaults: the cache drops its front every few tokens,
    stays exact, and a roll-back into a chunk whose front it dropped is refused in one line,
    leaving every layer as it was; one within what it holds goes through."""
    monkeypatch.setattr(caches, "WINDOW_MARGIN", 7)  # k = 6: a round feeds 7 tokens
    monkeypatch.setattr(caches, "WINDOW_SLACK", 2)
    pair = pairs("llama4-scout")
    prompt = prompt_ids(pair)
    decoder = make_decoder(pair)
    chunked = [c for c in decoder.cache if isinstance(c, caches.MarginChunkedKVCache)]
    assert len(chunked) == 3 and all(c.margin == 7 for c in chunked)
    res = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=6, decoder=decoder)
    assert res.tokens == reference(pair, prompt, REPLY)
    c = chunked[0]
    offset, start, size = c.offset, c.start_position, c.chunk_size
    # trimmed before each pass to chunk + margin, once past chunk + margin + slack
    assert start > 0 and offset - start <= size + 7 + 2 + 7
    with pytest.raises(caches.CacheRollbackError, match="no longer holds the chunk of position"):
        caches.rollback(decoder.cache, offset - start + 1)  # past what it holds
    assert [(x.offset, x.start_position) for x in chunked] == [(offset, start)] * 3
    if start % size:  # to its first token held: its chunk began before it
        assert not caches.can_rollback(decoder.cache, offset - start)
    first_whole = -(-start // size) * size  # the first position whose whole chunk it holds
    assert first_whole <= offset and caches.can_rollback(decoder.cache, offset - first_whole)
    caches.rollback(decoder.cache, offset - first_whole)
    assert all(x.offset == first_whole for x in chunked)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_batched_rows_equal_each_alone(pairs, family, drafter):
    """Its own code computes the chunk mask from one offset for the whole batch (mx.arange),
    so a batch runs it row by row, each row on its own caches (caches.RowsCache): rows join
    at different rounds, reject different numbers, leave, one is cancelled; every row is the
    target's alone. A plain batch (check_batchable without `apart`) still refuses it."""
    pair = pairs(family, drafter)
    with pytest.raises(SpecError, match=r"\(llama4\) computes its chunked attention mask"):
        check_batchable(pair.target)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, 3)
    out, reasons = run_schedule(decoder, prompts)
    assert_schedule_exact(pair, prompts, out, reasons, family)
    assert decoder.drafted > 0 and len(decoder) == 0
    assert decoder.apart


def test_a_batched_row_comes_from_and_goes_into_single_streams(pairs):
    assert_a_row_comes_from_and_goes_into_single_streams(pairs("llama4-scout"))


def test_two_rows_of_batch_generate_equal_generate(pairs):
    pair = pairs("llama4-maverick")
    got = mlx_spec.batch_generate(pair, [TEXT, TEXTS[1]], max_tokens=16, num_draft_tokens=4)
    for res, text in zip(got, [TEXT, TEXTS[1]], strict=True):
        ids = pair.tokenizer.encode(text)
        assert res.tokens == reference(pair, ids, 16) and res.stats.drafted > 0


def test_two_concurrent_clients_get_the_targets_text(dirs, tmp_path):
    """`mlx-spec serve --max-batch 4` on a Llama 4 pair: two clients at once, each reply
    what the target alone gives (its rows batched row by row)."""
    import concurrent.futures

    import openai
    from test_server import serving

    target, draft = dirs["llama4-scout"]
    pair = load_pair(target=str(target), draft=str(draft))
    prompts = [TEXT, TEXTS[1]]
    expected = [generate(pair, p, max_tokens=24, use_draft=False).text for p in prompts]
    args = ["--target", str(target), "--draft", str(draft), "--num-draft-tokens", "3",
            "--max-batch", "4"]  # fmt: skip
    with serving(args, tmp_path) as (_, url):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)

        def ask(prompt):
            res = client.completions.create(
                model="llama4-scout", prompt=prompt, max_tokens=24, temperature=0
            )
            return res.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, prompts))
    assert got == expected
