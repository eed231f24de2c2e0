"""A DSpark head drafting inside a batch (decode/batch_head.py's DSparkRows): one backbone
forward for every row's block, then the Markov head's steps over each row's guesses; every
row's output is what it is alone, greedy (mlx-lm on the target alone) and seeded (the single
stream's samples, drawn position by position as DSparkDrafter draws them: a block drawn at once
from the unbiased logits, or without each row's own previous guess, fails the seeded tests),
through rows joining and leaving at different rounds and rows handed to and from single-stream
decoders. The head is tests/test_dspark.py's random one over the tiny Llama target (block 6)."""

from __future__ import annotations

import pytest
from test_batch import (
    assert_batch_generate_equals_generate,
    assert_seeded_rows_sample_as_alone,
    pin_costs,
)
from test_batch_dflash import (
    assert_a_mixed_batch_as_alone,
    assert_rows_hand_their_heads_over,
    assert_seeded_rounds_as_alone,
)
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_dspark import heads, llama_pair  # noqa: F401 (fixtures)

from mlx_spec.decode.batch_head import DSparkRows
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.drafters import batched_kinds
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
    assert_seeded_rounds_as_alone(dspark)


def test_seeded_rows_sample_the_same_whatever_the_batch(dspark):
    assert_seeded_rows_sample_as_alone(dspark)


def test_rows_from_and_into_single_stream_decoders(dspark):
    assert_rows_hand_their_heads_over(dspark, DSparkDrafter)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(dspark):
    """Processors (a schema, a regex, penalties, a logit bias) see each step's logits after the
    Markov bias, in a batch as alone: each row's tokens and log-probabilities are its own."""
    assert_a_mixed_batch_as_alone(dspark)


def test_suffix_rows_beside_the_head_equal_each_alone(dspark, monkeypatch):
    from test_suffix import assert_suffix_rows_beside_the_head

    assert_suffix_rows_beside_the_head(dspark, monkeypatch)
