"""The target's own MTP layer drafting inside a batch (decode/batch_head.py's MTPRows): every
row's output is what it is alone, greedy (mlx-lm on the target alone) and seeded (the single
stream's samples), through rows joining and leaving at different rounds, different rejections
per row, rows handed to and from single-stream decoders; and each row's head cache holds what
a fresh single-stream prefill gives it.

The target is a tiny GLM-4.5 (plain KV attention, MoE: a batch takes it) with its MTP layer in
the DeepSeek / GLM layout (NextNHead, the real checkpoints' tensors, extracted by `mlx-spec
heads extract`), built as tests/test_mtp_nextn.py builds it: a head that predicts the damped,
nearly-bigram target well but not always (noise on eh_proj: mixed rounds). Its attention
still fills its cache: a row whose cache held the wrong entries would propose otherwise than
alone (the tests compare proposals with `generate`'s)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_batch import (
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_batch_generate_equals_generate,
    assert_mixed_rows_as_alone,
    assert_seeded_rows_sample_as_alone,
    run_mixed,
)
from test_batch_eagle import assert_greedy_rows_equal_each_alone
from test_mtp import checkpoint, mtp_pair  # noqa: F401 (fixtures)
from test_mtp_nextn import build

from mlx_spec import GenerationConfig, load_pair
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch_head import MTPRows
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.drafters import batched_kinds
from mlx_spec.drafters.base import TargetOutput
from mlx_spec.server.resident import Resident


@pytest.fixture(scope="module")
def mtp(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_mtp")
    target, _, head, _ = build(root, "glm-4.5", tiny_models.tokenizer, agree=0.3)
    return load_pair(target=str(target), drafter="mtp", head=str(head))


def test_the_kind_batches_with_drafts(mtp):
    assert "mtp" in batched_kinds()
    decoder = make_batch_decoder(mtp, 2)
    assert decoder.heads is not None and decoder.drafting
    assert isinstance(decoder.heads.kind, MTPRows)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rows_equal_each_alone(mtp, k):
    assert_greedy_rows_equal_each_alone(mtp, make_batch_decoder(mtp, k))


@pytest.mark.parametrize("k", [1, 3])
def test_batch_generate_equals_generate(mtp, k):
    assert_batch_generate_equals_generate(mtp, k)


def test_seeded_rows_sample_the_same_whatever_the_batch(mtp):
    assert_seeded_rows_sample_as_alone(mtp)


def test_rows_from_and_into_single_stream_decoders(mtp):
    assert_a_row_comes_from_and_goes_into_single_streams(mtp)


def test_each_rows_head_holds_its_sequence_after_rejections(mtp):
    """After rounds where rows rejected different numbers of guesses (each rolled back by
    its own), every row's head cache holds the pairs a fresh single-stream prefill of its
    sequence gives the head (all but its last token's), and its last output is that
    prefill's."""
    decoder = make_batch_decoder(mtp, 3)
    for text in TEXTS:
        decoder.add(mtp.tokenizer.encode(text), GenerationConfig(max_tokens=60))
    rejections = set()
    for _ in range(6):
        for u in decoder.step().values():
            rejections.add(u.round.drafted - u.round.accepted)
    assert len(rejections) > 1
    decoder.heads.feed([r.sequence for r in decoder.rows])
    kind = decoder.heads.kind
    for b, row in enumerate(decoder.rows):
        hidden = dict.fromkeys(decoder.hidden_layers)
        prefill_cache(mtp.target, make_prompt_cache(mtp.target), row.sequence[:-1], hidden=hidden)
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
        assert (
            mx.argmax(kind.logits(last)).item()
            == mx.argmax(kind.logits(decoder.heads.last[b])).item()
        )


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(mtp):
    """A schema, a regex, penalties and a logit bias, log-probabilities, a plain row and a
    seeded sampled one with a penalty (test_batch's MIXED), the head drafting for all: each
    row's tokens and log-probabilities are what it gets alone with the head."""
    rows, got, rounds = run_mixed(mtp)
    assert sum(r.drafted for _, r in rounds) > 0
    assert_mixed_rows_as_alone(mtp, rows, got)


def test_a_recurrent_target_with_its_mtp_layer_drafts_in_the_batch(mtp_pair):  # noqa: F811
    """Qwen3.5 with its MTP layer (tests/test_mtp.py's): the server's resident pair batches
    with the head drafting (tests/test_batch_recurrent_heads.py), and a lone request runs as
    a single stream (it keeps the prompt cache's checkpoints of the recurrent state)."""
    resident = Resident(lambda name: None, [], max_batch=4)
    resident.install(mtp_pair, "qwen35")
    assert resident.batch is not None and not resident.batch_plain and resident.lone_alone
    assert resident.batch.heads is not None and resident.batch.recurrent


def test_suffix_rows_beside_the_head_equal_each_alone(mtp, monkeypatch):
    from test_suffix import assert_suffix_rows_beside_the_head

    assert_suffix_rows_beside_the_head(mtp, monkeypatch)
