"""A DFlash2 head drafting inside a batch (decode/batch_head.py's DFlash2Rows): one forward for
every row's block (each layer's convolutions over each row's own block), then the selector's
steps, each row choosing among its own processed top candidates after its own previous guess;
every row's output is what it is alone, greedy and seeded (the single stream's samples: both
draw from the same -inf-masked scores with the same split keys), with processors, through rows
joining, leaving and handed to and from single-stream decoders. The head is
tests/test_dflash2.py's random one over the tiny Llama target (block 8)."""

from __future__ import annotations

import pytest
from test_batch import (
    TEXTS,
    assert_batch_generate_equals_generate,
    assert_seeded_rows_sample_as_alone,
    pin_costs,
    records,
)
from test_batch_dflash import (
    assert_a_mixed_batch_as_alone,
    assert_rows_hand_their_heads_over,
    assert_seeded_rounds_as_alone,
)
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_batch_recurrent_heads import assert_rows_hand_caches_and_head_to_single_streams
from test_dflash2 import heads, llama_pair  # noqa: F401 (fixtures)

import mlx_spec
from mlx_spec import GenerationConfig, generate, load_pair
from mlx_spec.decode.batch_head import DFlash2Rows
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.drafters.dflash2 import DFlash2Drafter


@pytest.fixture(scope="module")
def dflash2(llama_pair):  # noqa: F811
    return llama_pair


def test_the_kind_batches_with_drafts(dflash2):
    decoder = make_batch_decoder(dflash2, 2)
    assert decoder.heads is not None and decoder.drafting
    assert isinstance(decoder.heads.kind, DFlash2Rows)


@pytest.mark.parametrize("k", [1, 3, 9, "auto"])
def test_greedy_rows_equal_each_alone(dflash2, k, monkeypatch):
    """k 9: capped at the block's 7 guesses."""
    decoder = make_batch_decoder(dflash2, k)
    if k == "auto":
        pin_costs(decoder, monkeypatch)
        assert decoder.controller.k_max == 7
    assert_greedy_rows_equal_each_alone(dflash2, decoder, some_accepted=False)


@pytest.mark.parametrize("k", [2, 4])
def test_batch_generate_equals_generate(dflash2, k):
    assert_batch_generate_equals_generate(dflash2, k, some_accepted=False)


def test_seeded_rows_propose_and_keep_what_they_do_alone(dflash2):
    assert_seeded_rounds_as_alone(dflash2)


def test_seeded_rows_sample_the_same_whatever_the_batch(dflash2):
    assert_seeded_rows_sample_as_alone(dflash2)


def test_rows_from_and_into_single_stream_decoders(dflash2):
    assert_rows_hand_their_heads_over(dflash2, DFlash2Drafter)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(dflash2):
    """Processors go before the selector in a batch as alone (a grammar rules candidates out
    before they are chosen): each row's tokens and log-probabilities are its own."""
    assert_a_mixed_batch_as_alone(dflash2)


def test_sampled_rows_under_a_grammar_propose_what_they_do_alone(dflash2):
    """Seeded sampled rows under a regex: the grammar masks each position's logits before the
    selector picks its candidates, in a batch as alone, so each row's proposals are the single
    stream's (masked after the choice, a position whose candidates the grammar all rules out
    has no distribution at all)."""
    configs = [
        GenerationConfig(
            max_tokens=16, num_draft_tokens=3, temperature=1.0, seed=s, regex="(ab|cd)+e"
        )
        for s in (1, 2, 3)
    ]
    results = mlx_spec.batch_generate(dflash2, TEXTS[:3], configs, max_batch=3)
    drafted = 0
    for text, config, res in zip(TEXTS[:3], configs, results, strict=True):
        assert records(res.rounds) == records(generate(dflash2, text, config).rounds)
        drafted += res.stats.drafted - res.stats.forced_drafted
    assert drafted > 0


def test_rows_beside_a_recurrent_target(heads):  # noqa: F811
    """Qwen3.5 (rows replay their rejected tokens): greedy rows are the target's alone and
    rows go into single streams with their caches and head."""
    target, head = str(heads["qwen3_5_target"]), str(heads["qwen3_5"])
    pair = load_pair(target=target, drafter="dflash", head=head)
    decoder = make_batch_decoder(pair, 3)
    assert decoder.recurrent and isinstance(decoder.heads.kind, DFlash2Rows)
    assert_greedy_rows_equal_each_alone(pair, decoder, some_accepted=False)
    assert_rows_hand_caches_and_head_to_single_streams(pair)
