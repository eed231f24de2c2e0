"""Drafting heads beside a recurrent target in a batch (Qwen3.5 with its own MTP layer: the
pair most people with a Qwen3.5 or Qwen3.6 run). Each row's pass replays its unfed tokens
first, then its guesses and fillers; the head takes the features of the tokens the row kept
from where its last token sits in that pass (`BatchHead.take`'s starts), never those of its
replay again. Every row's output is what it is alone, through rows joining and leaving, rows
handed to and from single-stream decoders, and mixed request settings.

The target is the tiny Qwen3.5 checkpoint tests/test_mtp.py writes (Gated DeltaNet layers
beside attention, the MTP tensors as Qwen ships them, extracted by `mlx-spec heads extract`),
its head agreeing often (mixed rounds: full, partial, rejected); a random one for rounds that
are mostly rejected, so rows replay different amounts."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_batch import (
    TEXTS,
    assert_mixed_rows_as_alone,
    assert_seeded_rows_sample_as_alone,
    run_mixed,
)
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_heads_surfaces import head_pair, models  # noqa: F401 (fixture)
from test_mtp import checkpoint, mtp_pair, random_pair  # noqa: F401 (fixtures)

from mlx_spec import GenerationConfig, batch_generate, generate, load_pair, make_decoder
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch_head import MTPRows
from mlx_spec.decode.batch_rows import into_decoder
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.drafters.base import TargetOutput
from mlx_spec.server.resident import Resident


@pytest.fixture(scope="module")
def pair(request):
    return request.getfixturevalue("mtp_pair")


@pytest.fixture(scope="module")
def rejecting(request):
    return request.getfixturevalue("random_pair")


def test_a_recurrent_targets_head_drafts_inside_the_batch(pair):
    decoder = make_batch_decoder(pair, 3)
    assert decoder.recurrent and decoder.drafting
    assert isinstance(decoder.heads.kind, MTPRows)
    resident = Resident(lambda name: None, [], max_batch=4)
    resident.install(pair, "q35-mtp")
    assert not resident.batch_plain and resident.batch.heads is not None


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rows_equal_each_alone(pair, k):
    assert_greedy_rows_equal_each_alone(pair, make_batch_decoder(pair, k))


def test_greedy_rows_equal_each_alone_when_most_guesses_are_rejected(rejecting):
    assert_greedy_rows_equal_each_alone(
        rejecting, make_batch_decoder(rejecting, 3), some_accepted=False
    )


@pytest.mark.parametrize("k", [1, 3])
def test_batch_generate_equals_generate(pair, k):
    """Each result's tokens are generate's without drafts; the head drafted and some guesses
    were kept. (Rounds differ from a single stream's: a row's pass carries fillers.)"""
    prompts = TEXTS[:3] + [[7], TEXTS[4]]
    results = batch_generate(pair, prompts, max_tokens=24, num_draft_tokens=k, max_batch=2)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.tokens == generate(pair, prompt, max_tokens=24, use_draft=False).tokens
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    assert 0 < accepted < drafted


def assert_rows_hand_caches_and_head_to_single_streams(pair) -> None:
    """A row removed mid-reply (its replay pending) and rows that ran to their end come back
    as Decoders with the head's state (`into_decoder`): each continues as a fresh generate
    does, drafting from its head without prefilling its sequence again."""
    decoder = make_batch_decoder(pair, 3)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    ids = [
        decoder.add(p, GenerationConfig(max_tokens=m), keep=True)
        for p, m in zip(prompts, [40, 6, 40], strict=True)
    ]
    states, removed = {}, None
    for _ in range(40):
        for rid, u in decoder.step().items():
            if u.done:
                states[rid] = u.state
        if removed is None and decoder.rows and decoder.rows[0].unfed > 1:
            removed = decoder.rows[0].id
            states[removed] = decoder.remove(removed)
        if len(states) == 3:
            break
    assert removed is not None and states[removed].unfed > 1
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    config = GenerationConfig(max_tokens=12, num_draft_tokens=3)
    for rid in ids:
        state = states[rid]
        d = into_decoder(make_decoder(pair), state)
        follow = state.sequence + more
        res, fresh = (
            generate(pair, follow, config, decoder=d),
            generate(pair, follow, config),
        )
        assert res.tokens == fresh.tokens and res.stats.drafted > 0
        assert res.stats.prompt_tokens_reused == len(state.sequence) - state.unfed


def test_rows_hand_their_caches_and_head_to_single_streams(pair):
    assert_rows_hand_caches_and_head_to_single_streams(pair)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_the_other_heads_beside_a_recurrent_target(request, kind):
    """The other heads on the same hybrid target (random heads: mostly rejected, so rows
    replay): greedy rows are the target's alone, and rows go into single streams."""
    other = head_pair(request.getfixturevalue("models"), kind)
    decoder = make_batch_decoder(other, 3)
    assert decoder.recurrent and decoder.heads is not None
    assert_greedy_rows_equal_each_alone(other, decoder, some_accepted=False)
    assert_rows_hand_caches_and_head_to_single_streams(other)
    assert_seeded_rows_sample_as_alone(other)


def test_a_seeded_row_samples_what_it_samples_alone(pair):
    assert_seeded_rows_sample_as_alone(pair)


def test_mixed_rows_get_what_they_get_alone(pair):
    rows, got, _ = run_mixed(pair)
    # a seeded sampled row beside others keeps its distribution, not its exact samples
    # (fillers change how its key splits: tests/test_batch_recurrent.py)
    assert_mixed_rows_as_alone(pair, rows, got, skip=("sampled",))


@pytest.mark.parametrize("which", ["pair", "rejecting"])
def test_each_rows_head_holds_its_sequence_after_replays(request, which):
    """After rounds where rows rejected different numbers of guesses (their kept tokens
    replayed first in the next pass), every row's head cache holds what a fresh
    single-stream prefill of its sequence gives the head, and its last output is that
    prefill's: the features of a replayed token are taken once, from the pass that
    verified it, at that row's own place in the pass. (The agreeing head's fc reads only
    the embedding half; the random one reads the target's hidden states too.)"""
    pair = request.getfixturevalue(which)
    decoder = make_batch_decoder(pair, 3)
    for text in TEXTS:
        decoder.add(pair.tokenizer.encode(text), GenerationConfig(max_tokens=60))
    replayed = set()
    for _ in range(6):
        for u in decoder.step().values():
            replayed.add(u.round.replayed)
    assert len(replayed) > 1  # rows replayed different amounts
    decoder.heads.feed([r.sequence for r in decoder.rows])
    kind = decoder.heads.kind
    for b, row in enumerate(decoder.rows):
        hidden = dict.fromkeys(decoder.hidden_layers)
        target = pair.target
        prefill_cache(target, make_prompt_cache(target), row.sequence[:-1], hidden=hidden)
        n = len(row.sequence) - 1
        cache, last, entries, _, _ = kind.prefill(
            row.sequence, TargetOutput(None, hidden, n, n), None, False
        )
        assert entries == n
        for c, f in zip(decoder.heads.cache, cache, strict=True):
            got = c.extract(b)
            assert got.offset == f.offset == n
            for a, e in ((got.keys, f.keys), (got.values, f.values)):
                assert np.allclose(np.array(a[..., :n, :]), np.array(e[..., :n, :]), atol=1e-4)
        assert np.allclose(np.array(decoder.heads.last[b]), np.array(last), atol=1e-4)


@pytest.mark.parametrize("drafter", ["mtp", "ngram"])
def test_a_row_continues_a_kept_recurrent_decoder_its_prompt_extends(pair, drafter):
    """A kept single-stream decoder (the server's prompt cache keeps one per conversation)
    whose sequence the next prompt extends gives a batch row its caches: the recurrent state
    needs no trimming, so only the new tokens are prefilled, and the row's tokens are the
    target's alone. A prompt that parts from it earlier gets nothing (a state cannot forget):
    the row starts afresh."""
    if drafter != "mtp":
        pair = load_pair(target=pair.config.target).configured(drafter=drafter)
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    d = make_decoder(pair)
    generate(pair, TEXTS[1], GenerationConfig(max_tokens=14, num_draft_tokens=3), decoder=d)
    held = len(d.sequence) - d.unfed
    follow = d.sequence + more
    decoder = make_batch_decoder(pair, 3)
    beside = decoder.add(pair.tokenizer.encode(TEXTS[0]), GenerationConfig(max_tokens=20))
    rid = decoder.add(follow, GenerationConfig(max_tokens=20), kept=d)
    assert decoder.row(rid).reused == held and not d.sequence
    parted = make_decoder(pair)
    generate(pair, TEXTS[1], GenerationConfig(max_tokens=14), decoder=parted)
    earlier = parted.sequence[:-3] + more
    other = decoder.add(earlier, GenerationConfig(max_tokens=20), kept=parted)
    assert decoder.row(other).reused == 0
    out = {beside: [], rid: [], other: []}
    drafted = 0
    while len(decoder):
        for r, u in decoder.step().items():
            out[r] += u.tokens
            drafted += u.round.drafted
    assert out[rid] == generate(pair, follow, max_tokens=20, use_draft=False).tokens
    assert out[other] == generate(pair, earlier, max_tokens=20, use_draft=False).tokens
    assert drafted > 0
