"""A DFlash head drafting inside a batch (decode/batch_head.py's DFlashRows): one head forward
drafts every row's block, each row at its own position over its own context; every row's
output is what it is alone, greedy (mlx-lm on the target alone) and seeded (the single stream's
samples, a block's guesses drawn with one key as DFlashDrafter draws them), through rows
joining and leaving at different rounds and rows handed to and from single-stream decoders.
The head is tests/test_dflash.py's random one over the tiny Llama target (block 8)."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_batch import (
    MIXED,
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_batch_generate_equals_generate,
    assert_seeded_rows_sample_as_alone,
    pin_costs,
    records,
)
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_dflash import heads, llama_pair  # noqa: F401 (fixtures)

import mlx_spec
from mlx_spec import GenerationConfig, generate
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch_head import DFlashRows
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.decode.prompts import prompt_tokens
from mlx_spec.drafters import batched_kinds
from mlx_spec.drafters.base import TargetOutput
from mlx_spec.drafters.dflash import DFlashDrafter


@pytest.fixture(scope="module")
def dflash(llama_pair):  # noqa: F811
    return llama_pair


def test_the_kind_batches_with_drafts(dflash):
    assert "dflash" in batched_kinds()
    decoder = make_batch_decoder(dflash, 2)
    assert decoder.heads is not None and decoder.drafting
    assert isinstance(decoder.heads.kind, DFlashRows)
    # `auto`: one forward drafts the block, so the controller prices it once a round
    assert make_batch_decoder(dflash, "auto").controller.block


@pytest.mark.parametrize("k", [1, 3, 9, "auto"])
def test_greedy_rows_equal_each_alone(dflash, k, monkeypatch):
    """k 9: capped at the block's 7 guesses; the tiny random head's guesses all lose."""
    decoder = make_batch_decoder(dflash, k)
    if k == "auto":  # a cheap head step: the clock may find the tiny head as dear as the target
        pin_costs(decoder, monkeypatch)
        assert decoder.controller.k_max == 7  # the block's guesses
    assert_greedy_rows_equal_each_alone(dflash, decoder, some_accepted=False)


@pytest.mark.parametrize("k", [1, 4])
def test_batch_generate_equals_generate(dflash, k):
    assert_batch_generate_equals_generate(dflash, k, some_accepted=False)


def assert_seeded_rounds_as_alone(pair):
    """Seeded sampled rows (each its own seed and temperature, three at a time, so rows join
    as others leave): each row's rounds (what the head proposed, what the target kept) are
    `generate`'s with the head; some guesses are accepted, so rows keep different counts."""
    configs = [
        GenerationConfig(max_tokens=30, num_draft_tokens=4, temperature=t, seed=s)
        for t, s in ((1.0, 3), (0.7, 4), (1.0, 5), (1.3, 6), (1.0, 7))
    ]
    results = mlx_spec.batch_generate(pair, TEXTS, configs, max_batch=3)
    drafted = accepted = 0
    for text, config, res in zip(TEXTS, configs, results, strict=True):
        alone = generate(pair, text, config)
        assert records(res.rounds) == records(alone.rounds)
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert 0 < accepted < drafted


def test_seeded_rows_propose_and_keep_what_they_do_alone(dflash):
    assert_seeded_rounds_as_alone(dflash)


def test_seeded_rows_sample_the_same_whatever_the_batch(dflash):
    assert_seeded_rows_sample_as_alone(dflash)


def assert_rows_hand_their_heads_over(pair, drafter_type=DFlashDrafter):
    """Rows from and into single-stream decoders: the head a row hands back is a
    `drafter_type` holding what a fresh single-stream prefill's holds."""

    def inspect(decoder, state):
        assert type(state.head) is drafter_type
        n = len(state.sequence) - 1
        hidden = dict.fromkeys(decoder.hidden_layers)
        prefill_cache(
            pair.target, make_prompt_cache(pair.target), state.sequence[:-1], hidden=hidden
        )
        fresh_head = drafter_type(pair.head, pair.target)
        fresh_head.prefill(state.sequence, output=TargetOutput(None, hidden, n, n))
        fresh_head.settle()
        assert state.head.spans == fresh_head.spans == [[0, n]] and not state.head.pending
        for c, f in zip(state.head.cache, fresh_head.cache, strict=True):
            for a, e in ((c.keys, f.keys), (c.values, f.values)):
                assert np.allclose(np.array(a[..., :n, :]), np.array(e[..., :n, :]), atol=1e-4)

    assert_a_row_comes_from_and_goes_into_single_streams(pair, inspect)


def test_rows_from_and_into_single_stream_decoders(dflash):
    assert_rows_hand_their_heads_over(dflash)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(dflash):
    assert_a_mixed_batch_as_alone(dflash)


def assert_a_mixed_batch_as_alone(pair):
    """A schema, a regex, penalties and a logit bias, log-probabilities, a plain row and a
    seeded sampled one with a penalty (test_batch's MIXED), the head drafting for all: each
    row's tokens and log-probabilities are what it gets alone with the head."""
    configs = [
        GenerationConfig(max_tokens=24, num_draft_tokens=3, **settings)
        for settings in MIXED.values()
    ]
    prompts = [TEXTS[i % len(TEXTS)] for i in range(len(configs))]
    decoder = make_batch_decoder(pair, 3)
    rows = {
        decoder.add(prompt_tokens(pair, p, c)[0], c): (label, p, c)
        for label, p, c in zip(MIXED, prompts, configs, strict=True)
    }
    got = {rid: ([], []) for rid in rows}
    drafted = 0
    while len(decoder):
        for rid, u in decoder.step().items():
            got[rid][0].extend(u.tokens)
            got[rid][1].extend(u.round.logprobs or [])
            drafted += u.round.drafted
    assert drafted > 0
    for rid, (label, prompt, config) in rows.items():
        alone = list(mlx_spec.stream(pair, prompt, config))
        assert got[rid][0] == [e.token for e in alone], label
        if label == "logprobs":
            assert np.allclose(got[rid][1], [e.logprob for e in alone], atol=1e-4), label


def test_a_row_copied_while_it_stays_keeps_its_own_spans(dflash):
    """A request that shares a running row's prompt starts from a copy of its caches
    (`copy_row`, the server's parallel sub-tasks) while the row goes on: the copy's head
    spans are its own (once they were the row's list: the copy's prefill cut it, and the row
    failed its next hand-over, ending the whole batch). Both rows equal their runs alone."""
    from mlx_spec.decode.batch_rows import into_decoder
    from mlx_spec.decode.generate import make_decoder

    config = GenerationConfig(max_tokens=24, temperature=0.0, num_draft_tokens=4)
    decoder = make_batch_decoder(dflash)
    first = prompt_tokens(dflash, TEXTS[0], config)[0]
    second = first[: len(first) - 2] + prompt_tokens(dflash, " and the sea", config)[0]
    a = decoder.add(first, config, keep=True)
    out = {a: [], "b": []}
    for _ in range(3):
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
    kept = into_decoder(make_decoder(dflash), decoder.copy_row(a))
    b = decoder.add(second, config, kept=kept, keep=True)
    assert decoder.row(b).reused == len(first) - 2
    ended = {}
    while len(decoder):
        for rid, u in decoder.step().items():
            out[rid if rid == a else "b"] += u.tokens
            if u.done:
                ended[rid] = u
    for state in (ended[a].state, ended[b].state):
        assert sum(n for _, n in state.head.spans) == state.head.cache[0].offset
    assert out[a] == generate(dflash, first, config).tokens
    assert out["b"] == generate(dflash, second, config).tokens


def test_suffix_rows_beside_the_head_equal_each_alone(dflash, monkeypatch):
    from test_suffix import assert_suffix_rows_beside_the_head

    assert_suffix_rows_beside_the_head(dflash, monkeypatch)
