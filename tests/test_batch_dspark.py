"""A DSpark head drafting inside a batch (decode/batch_head.py's DSparkRows): one backbone
forward for every row's block, then the Markov head's steps over each row's guesses; every
row's output is what it is alone, greedy (mlx-lm on the target alone) and seeded (the single
stream's samples, drawn position by position as DSparkDrafter draws them), through rows joining
and leaving at different rounds and rows handed to and from single-stream decoders. The head is
tests/test_dspark.py's random one over the tiny Llama target (block 6)."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_batch import (
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_batch_generate_equals_generate,
    assert_seeded_rows_sample_as_alone,
    pin_costs,
    records,
)
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_dspark import heads, llama_pair  # noqa: F401 (fixtures)

import mlx_spec
from mlx_spec import GenerationConfig, generate
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch import make_batch_decoder
from mlx_spec.decode.batch_head import DSparkRows
from mlx_spec.drafters import batched_kinds
from mlx_spec.drafters.base import TargetOutput
from mlx_spec.drafters.dspark import DSparkDrafter


@pytest.fixture(scope="module")
def dspark(llama_pair):  # noqa: F811
    return llama_pair


def test_the_kind_batches_with_drafts(dspark):
    assert "dspark" in batched_kinds()
    decoder = make_batch_decoder(dspark, 2)
    assert decoder.heads is not None and decoder.drafting
    assert isinstance(decoder.heads.kind, DSparkRows)


@pytest.mark.parametrize("k", [1, 3, 9, "auto"])
def test_greedy_rows_equal_each_alone(dspark, k, monkeypatch):
    """k 9: capped at the block's 6 guesses."""
    decoder = make_batch_decoder(dspark, k)
    if k == "auto":  # a cheap head step: the clock may find the tiny head as dear as the target
        pin_costs(decoder, monkeypatch)
        assert decoder.controller.k_max == 6  # the block's guesses, the anchor's row's too
    assert_greedy_rows_equal_each_alone(dspark, decoder, some_accepted=False)


@pytest.mark.parametrize("k", [2, 4])
def test_batch_generate_equals_generate(dspark, k):
    assert_batch_generate_equals_generate(dspark, k, some_accepted=False)


def test_seeded_rows_propose_and_keep_what_they_do_alone(dspark):
    """Seeded sampled rows (each its own seed and temperature, rows joining as others leave):
    each row's rounds (what the head proposed, what the target kept) are `generate`'s with
    the head — the Markov step over each row's own previous guess, the keys split per position
    as alone."""
    configs = [
        GenerationConfig(max_tokens=30, num_draft_tokens=4, temperature=t, seed=s)
        for t, s in ((1.0, 3), (0.7, 4), (1.0, 5), (1.3, 6), (1.0, 7))
    ]
    results = mlx_spec.batch_generate(dspark, TEXTS, configs, max_batch=3)
    drafted = accepted = 0
    for text, config, res in zip(TEXTS, configs, results, strict=True):
        alone = generate(dspark, text, config)
        assert records(res.rounds) == records(alone.rounds)
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert 0 < accepted < drafted


def test_seeded_rows_sample_the_same_whatever_the_batch(dspark):
    assert_seeded_rows_sample_as_alone(dspark)


def test_rows_from_and_into_single_stream_decoders(dspark):
    def inspect(decoder, state):  # the head handed back: a fresh single-stream prefill's
        assert isinstance(state.head, DSparkDrafter)
        n = len(state.sequence) - 1
        hidden = dict.fromkeys(decoder.hidden_layers)
        prefill_cache(
            dspark.target, make_prompt_cache(dspark.target), state.sequence[:-1], hidden=hidden
        )
        fresh_head = DSparkDrafter(dspark.head, dspark.target)
        fresh_head.prefill(state.sequence, output=TargetOutput(None, hidden, n, n))
        fresh_head.settle()
        assert state.head.spans == fresh_head.spans == [[0, n]] and not state.head.pending
        for c, f in zip(state.head.cache, fresh_head.cache, strict=True):
            for a, e in ((c.keys, f.keys), (c.values, f.values)):
                assert np.allclose(np.array(a[..., :n, :]), np.array(e[..., :n, :]), atol=1e-4)

    assert_a_row_comes_from_and_goes_into_single_streams(dspark, inspect)
