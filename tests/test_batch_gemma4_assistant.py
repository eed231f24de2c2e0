"""Gemma 4's assistant drafting inside a batch (decode/batch_assistant.py's AssistantBatch): every
row's guesses come from one step over all rows, each attending (through a mask) to its own
keys and values in the batch's target cache at its own position; every row's output is what
it is alone, greedy (mlx-lm on the target alone) and seeded (the single stream's rounds),
through rows joining and leaving at different rounds, past the 8-token window, and rows
handed to and from single-stream decoders. The head and targets are test_gemma4_assistant's."""

from __future__ import annotations

import numpy as np
import pytest
from test_batch import (
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_batch_generate_equals_generate,
    assert_seeded_rows_sample_as_alone,
    pin_costs,
)
from test_batch_dflash import assert_a_mixed_batch_as_alone, assert_seeded_rounds_as_alone
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_gemma4_assistant import dense_pair, models, moe_pair  # noqa: F401 (fixtures)

from mlx_spec import Decoder, load_pair
from mlx_spec.decode.batch_assistant import AssistantBatch
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.drafters import batched_kinds
from mlx_spec.drafters.assistant import AssistantDrafter


@pytest.fixture(scope="module")
def pair(dense_pair):  # noqa: F811
    return dense_pair


def test_the_kind_batches_with_drafts(pair):
    assert "assistant" in batched_kinds()
    decoder = make_batch_decoder(pair, 2)
    assert isinstance(decoder.heads, AssistantBatch) and decoder.drafting


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rows_equal_each_alone(pair, k):
    assert_greedy_rows_equal_each_alone(pair, make_batch_decoder(pair, k))


def test_auto_rows_are_the_target_alone(pair, monkeypatch):
    """`auto` (its costs pinned; it may still pause a head this poor): the target's tokens."""
    import mlx_spec
    from mlx_spec import generate

    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    real = make_batch_decoder
    monkeypatch.setattr(
        mlx_spec.decode.generate, "make_batch_decoder",
        lambda *a, **kw: pinned(real(*a, **kw), monkeypatch),
    )  # fmt: skip
    results = mlx_spec.batch_generate(pair, prompts, max_tokens=24, num_draft_tokens="auto")
    for prompt, res in zip(prompts, results, strict=True):
        assert res.tokens == generate(pair, prompt, max_tokens=24, use_draft=False).tokens


def pinned(decoder, monkeypatch):
    pin_costs(decoder, monkeypatch)
    return decoder


@pytest.mark.parametrize("k", [2, 4])
def test_batch_generate_equals_generate(pair, k):
    assert_batch_generate_equals_generate(pair, k)


def test_a_moe_target_batches_too(moe_pair):  # noqa: F811
    assert_batch_generate_equals_generate(moe_pair, 3)


def test_a_centroid_head_batches_too(models):  # noqa: F811
    head = str(models["ordered_head"])
    ordered = load_pair(target=str(models["dense"]), drafter="assistant", head=head)
    assert_batch_generate_equals_generate(ordered, 3, some_accepted=False)


def test_seeded_rows_propose_and_keep_what_they_do_alone(pair):
    assert_seeded_rounds_as_alone(pair)


def test_seeded_rows_sample_the_same_whatever_the_batch(pair):
    assert_seeded_rows_sample_as_alone(pair)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(pair):
    assert_a_mixed_batch_as_alone(pair)


def test_rows_from_and_into_single_stream_decoders(pair):
    """The drafter a row hands back holds what a fresh single-stream prefill's holds: its
    state row and the keys and values it attends to."""

    def inspect(decoder, state):
        assert type(state.head) is AssistantDrafter
        fresh = AssistantDrafter(pair.head, pair.target)
        Decoder(pair.target, fresh, ()).prefill(state.sequence)
        at = len(state.sequence) - 1
        assert state.head.target_at == fresh.target_at == at
        assert np.allclose(np.array(state.head.state), np.array(fresh.state), atol=1e-4)
        mine, theirs = state.head._shared(at), fresh._shared(at)
        for kind in theirs:
            for a, b in zip(mine[kind], theirs[kind], strict=True):
                assert np.allclose(np.array(a), np.array(b), atol=1e-4), kind

    assert_a_row_comes_from_and_goes_into_single_streams(pair, inspect)


def test_rows_past_a_compacting_window(pair, monkeypatch):
    """The sliding layers' buffers drop their front every few tokens (a margin of 7 beyond
    the window, 3 of slack, as test_batch_window's): rows still see their last window - 1
    keys, greedy rows and seeded rounds as alone."""
    from mlx_spec.core import batch_caches, caches

    monkeypatch.setattr(caches, "WINDOW_MARGIN", 7)
    monkeypatch.setattr(caches, "WINDOW_SLACK", 3)
    compactions = []
    update = batch_caches.BatchWindowedKVCache.update_and_fetch

    def spy(self, keys, values):
        before = self._idx
        out = update(self, keys, values)
        if self._idx < before + keys.shape[2]:
            compactions.append(before)
        return out

    monkeypatch.setattr(batch_caches.BatchWindowedKVCache, "update_and_fetch", spy)
    assert_greedy_rows_equal_each_alone(pair, make_batch_decoder(pair, 3))
    assert_seeded_rounds_as_alone(pair)
    assert compactions


def test_suffix_rows_beside_the_head_equal_each_alone(pair, monkeypatch):
    from test_suffix import assert_suffix_rows_beside_the_head

    assert_suffix_rows_beside_the_head(pair, monkeypatch)
