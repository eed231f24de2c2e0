"""Families whose layer cache is an mlx-lm `CacheList` in a batch: every row's output is the
target's alone (they crashed the whole batch: `merge_rows` handed the CacheList itself to
BatchKVCache.merge). Target and draft are of the family (a noisy copy as the draft), so both
batched caches hold CacheLists; rows join, reject different numbers, leave, are cancelled,
come from and go into single streams. Two concurrent clients of a real server get the
target's text. gpt_bigcode, whose own code takes one position for the whole batch, is run
row by row (each row on its own caches).
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import tiny
from conftest import VOCAB
from mlx_lm.models.cache import CacheList, make_prompt_cache
from test_batch import (
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_schedule_exact,
    run_schedule,
)
from test_greedy_equality import reference
from test_server import serving

from mlx_spec import SpecError, generate, load_pair
from mlx_spec.core import caches
from mlx_spec.core.batch_caches import check_batchable
from mlx_spec.decode.generate import make_batch_decoder

FAMILIES = list(tiny.cachelist_configs(VOCAB))


@pytest.fixture(scope="module")
def dirs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("cachelist")
    out = {}
    configs = {**tiny.cachelist_configs(VOCAB), "gpt_bigcode": tiny.gpt_bigcode_config(VOCAB)}
    for name, cfg in configs.items():
        weights = tiny.family_weights(cfg, seed=0)
        target = tiny.write_model(root / name, cfg, weights, tiny_models.tokenizer)
        noisy = tiny.noisy(weights, 0.05)
        draft = tiny.write_model(root / f"{name}-draft", cfg, noisy, tiny_models.tokenizer)
        out[name] = (target, draft)
    return root, out


def pair_of(dirs, family):
    target, draft = dirs[1][family]
    return load_pair(target=str(target), draft=str(draft))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rows_equal_each_alone(dirs, family):
    pair = pair_of(dirs, family)
    assert any(isinstance(c, CacheList) for c in make_prompt_cache(pair.target))
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, 3)
    out, reasons = run_schedule(decoder, prompts)
    assert_schedule_exact(pair, prompts, out, reasons, family)
    assert decoder.drafted > 0 and len(decoder) == 0


# (attention-only CacheLists: a recurrent state, falcon_h1's, cannot go back to the shared part)
@pytest.mark.parametrize("family", ["deepseek_v32", "longcat_flash"])
def test_a_row_comes_from_and_goes_into_single_streams(dirs, family):
    assert_a_row_comes_from_and_goes_into_single_streams(pair_of(dirs, family))


def test_a_model_that_takes_one_offset_is_batched_row_by_row(dirs):
    """gpt_bigcode's own code computes its positions from one offset for the whole batch
    (np.arange): a plain batch refuses it in one line; a BatchDecoder runs it row by row,
    each row on its own caches (caches.RowsCache), every row the target's alone."""
    pair = pair_of(dirs, "gpt_bigcode")
    with pytest.raises(SpecError, match=r"gpt_bigcode\) computes its positions .*one request"):
        check_batchable(pair.target)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, 3)
    out, reasons = run_schedule(decoder, prompts)
    assert_schedule_exact(pair, prompts, out, reasons, "gpt_bigcode")
    assert decoder.apart and decoder.drafted > 0
    prompt = pair.tokenizer.encode(TEXTS[2])
    res = generate(pair, prompt, max_tokens=12, num_draft_tokens=3)  # alone it speculates
    assert res.tokens == reference(pair, prompt, 12) and res.stats.drafted > 0


@pytest.mark.parametrize("family", ["falcon_h1", "deepseek_v32", "gpt_bigcode"])
def test_two_concurrent_clients_get_the_targets_text(dirs, family):
    """`mlx-spec serve --max-batch 4`: two clients at once; each reply is what the target
    alone gives (a batch of CacheList rows; gpt_bigcode's row by row)."""
    root, _ = dirs
    target, draft = dirs[1][family]
    args = ["--target", str(target), "--draft", str(draft), "--num-draft-tokens", "3",
            "--max-batch", "4"]  # fmt: skip
    pair = pair_of(dirs, family)
    prompts = TEXTS[:2]
    alone = [generate(pair, p, max_tokens=24, use_draft=False) for p in prompts]
    assert [r.tokens for r in alone] == [reference(pair, p, 24) for p in prompts]
    expected = [r.text for r in alone]
    with serving(args, root) as (_, url):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)

        def ask(prompt):
            res = client.completions.create(
                model=family, prompt=prompt, max_tokens=24, temperature=0
            )
            return res.choices[0].text

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, prompts))
    assert got == expected


def test_a_cache_class_the_batch_does_not_know_is_refused_in_one_line():
    """Issue 58 item 4: every cache that reaches a batch has been checked by `check_batchable`;
    a class it does not know (here a layer's own, alone or inside a CacheList, or a subclass
    of KVCache that may keep state of its own) is refused by name before any row, never
    passed through to a merge that would hand it to the wrong batched class."""
    from mlx_lm.models.cache import KVCache, _BaseCache

    from mlx_spec.core.batch_caches import merge_layer
    from mlx_spec.decode.batch import BatchDecoder

    class Mine(_BaseCache):
        offset = 0

    class MyKV(KVCache):
        pass

    for layers in ([KVCache(), Mine()], [CacheList(KVCache(), Mine())], [MyKV()]):

        class Model:
            model_type = "mine"

            def make_cache(self, layers=layers):
                return layers

        name = type(caches._leaves(layers)[-1]).__name__
        for call in (lambda: check_batchable(Model()), lambda: BatchDecoder(Model())):
            with pytest.raises(SpecError, match=f"uses {name} layers") as refused:
                call()
            assert "\n" not in str(refused.value)
        with pytest.raises(SpecError, match=f"a {name} layer cannot be batched"):
            merge_layer([layers[-1]] * 2)  # (the second line of defence)
