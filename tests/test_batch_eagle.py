"""An EAGLE-3 head drafting inside a batch (decode/batch_head.py): every row's output is what
it is alone, greedy (mlx-lm on the target alone) and seeded (the single stream's samples),
through rows joining and leaving at different rounds, different rejections per row, rows
handed to and from single-stream decoders, and the controller turning drafting off.

The head is an "echo" head over the tiny target: it reads the target's last layer as its
features, its own layer adds its attention's output (random) and no MLP, and its norm and
lm_head are the target's, so it mostly guesses the token the target chose at the previous
position: right where the target repeats itself (the tiny target loops), wrong elsewhere —
mixed rounds. Its attention makes the guesses depend on the head's cache: a row whose cache
held the wrong entries would propose otherwise than alone (the tests compare proposals).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_batch import (
    CANCELLED,
    MIXED,
    SCHEDULE,
    TEXTS,
    assert_a_row_comes_from_and_goes_into_single_streams,
    assert_batch_generate_equals_generate,
    assert_mixed_rows_as_alone,
    assert_seeded_rows_sample_as_alone,
    pin_costs,
    run_mixed,
    run_rows,
)
from test_eagle import head_weights, write_head
from test_greedy_equality import reference

import mlx_spec
from mlx_spec import GenerationConfig, SamplingParams, load_pair
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch import BatchDecoder
from mlx_spec.decode.batch_head import PENDING_MAX
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.drafters import batched_kinds
from mlx_spec.drafters.base import TargetOutput
from mlx_spec.drafters.eagle import EagleDrafter


def echo_head(target_dir, path):
    """An EAGLE-3 head (EAGLE layout) reading the outputs of layers 0, 1 and 3 of the
    4-layer target whose guess is the target's own choice one position back."""
    cfg = json.loads((target_dir / "config.json").read_text())
    target = mx.load(str(target_dir / "model.safetensors"))
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    w = head_weights(cfg, list(range(vocab)), seed=5, embed=False)
    fc = mx.zeros((hidden, 3 * hidden))
    fc[:, 2 * hidden :] = mx.eye(hidden)  # the last layer read (layer 3): the features
    w["fc.weight"] = fc
    # the layer adds little to its residual, but enough that its attention over the head's
    # cache changes guesses (a wrong cache would show in the proposals)
    # (scaled by 3, nothing is accepted any more; by 0 the proposals ignore the cache)
    w["midlayer.mlp.down_proj.weight"] = mx.zeros_like(w["midlayer.mlp.down_proj.weight"])
    w["norm.weight"] = target["model.norm.weight"]
    w["lm_head.weight"] = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    return write_head(path, cfg, w, ids=[0, 1, 3])


@pytest.fixture(scope="module")
def eagle(tiny_models, tmp_path_factory):
    head = echo_head(tiny_models.target, tmp_path_factory.mktemp("batch_eagle") / "head")
    return load_pair(target=str(tiny_models.target), drafter="eagle3", head=str(head))


def run(decoder: BatchDecoder, prompts, cancel_at: int | None = 5):
    """SCHEDULE (test_batch) through the decoder: {index: tokens}, {index: reason} and the
    drafted and accepted counts of all rows."""
    ids, out, reasons, rnd, drafted, accepted = {}, {}, {}, 0, 0, 0
    while len(reasons) < len(SCHEDULE):
        for i, (p, start, max_tokens) in enumerate(SCHEDULE):
            if start == rnd:
                ids[decoder.add(prompts[p], GenerationConfig(max_tokens=max_tokens))] = i
                out[i] = []
        if rnd == cancel_at:
            decoder.cancel(next(r for r, i in ids.items() if i == CANCELLED))
        for row, u in decoder.step().items():
            out[ids[row]] += u.tokens
            drafted += u.round.drafted
            accepted += u.round.accepted
            if u.done:
                reasons[ids[row]] = u.finish_reason
        rnd += 1
        assert rnd < 200
    return out, reasons, drafted, accepted


def assert_greedy_rows_equal_each_alone(pair, decoder, some_accepted: bool = True) -> None:
    """SCHEDULE through `decoder` (rows join at rounds 0-6, prompts of 1 to 15 tokens, leave
    at their max_tokens, one is cancelled): each row's tokens are the target's alone, the
    rows drafted (and some guesses were accepted, `some_accepted`), some rejected; the head's
    batched cache is gone with the last row."""
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    prompts[3] = prompts[3][:1]  # a one-token prompt: nothing to draft from until a pass
    out, reasons, drafted, accepted = run(decoder, prompts)
    for i, (p, _, max_tokens) in enumerate(SCHEDULE):
        expected = reference(pair, prompts[p], max_tokens)
        if i == CANCELLED:
            assert reasons[i] == "cancelled" and out[i] == expected[: len(out[i])]
        else:
            assert out[i] == expected, f"row {i}"
    assert len(decoder) == 0 and decoder.heads.cache is None
    assert drafted > 0 and (0 < accepted or not some_accepted) and accepted < drafted


def test_the_kind_batches_with_drafts(eagle):
    assert "eagle3" in batched_kinds()
    decoder = make_batch_decoder(eagle, 2)
    assert decoder.heads is not None and decoder.drafting


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_rows_equal_each_alone(eagle, k):
    assert_greedy_rows_equal_each_alone(eagle, make_batch_decoder(eagle, k))


@pytest.mark.parametrize("k", [1, 3])
def test_batch_generate_equals_generate(eagle, k):
    assert_batch_generate_equals_generate(eagle, k)


def test_seeded_rows_sample_the_same_whatever_the_batch(eagle):
    assert_seeded_rows_sample_as_alone(eagle)


def test_rows_from_and_into_single_stream_decoders(eagle):
    assert_a_row_comes_from_and_goes_into_single_streams(eagle)


@pytest.mark.parametrize("dear", [True, False])
def test_the_controller_turns_the_head_off_where_it_cannot_pay(eagle, monkeypatch, dear):
    """`auto`: a head step timed as dear as a target step could not pay even always
    accepted: the row decodes plainly (nothing drafted); timed cheap, it drafts. The tokens
    are the target's either way."""
    decoder = make_batch_decoder(eagle, "auto")
    pin_costs(decoder, monkeypatch, 0.1 if dear else 0.005)
    prompt = eagle.tokenizer.encode(TEXTS[4])
    rid = decoder.add(prompt, GenerationConfig(max_tokens=24))
    assert decoder.row(rid).use_draft is not dear
    out, _ = run_rows(decoder, {rid: None})
    assert out[rid][0] == reference(eagle, TEXTS[4], 24)
    drafted = sum(len(r["drafted"]) for r in out[rid][1])
    assert (drafted == 0) if dear else (drafted > 0)


def assert_head_holds(pair, decoder: BatchDecoder) -> list[list[int]]:
    """Each row's head cache holds exactly what a fresh single-stream prefill of its
    sequence gives the head (entries for all but its last token); each row's greedy guesses
    from that fresh head (k = 3)."""
    decoder.heads.feed([r.sequence for r in decoder.rows])
    guesses = []
    for b, row in enumerate(decoder.rows):
        hidden = dict.fromkeys(decoder.hidden_layers)
        prefill_cache(pair.target, make_prompt_cache(pair.target), row.sequence[:-1], hidden=hidden)
        fresh = EagleDrafter(pair.head)
        n = len(row.sequence) - 1
        fresh.prefill(row.sequence, output=TargetOutput(None, hidden, n, n))
        for c, f in zip(decoder.heads.cache, fresh.cache, strict=True):
            got = c.extract(b)
            assert got.offset == f.offset == n
            for a, e in ((got.keys, f.keys), (got.values, f.values)):
                assert np.allclose(np.array(a[..., :n, :]), np.array(e[..., :n, :]), atol=1e-4)
        guesses.append(fresh.propose(3, SamplingParams(temperature=0.0), None)[0].tolist())
    return guesses


def test_plain_stretches_pile_features_up_and_drafting_resumes(eagle, monkeypatch):
    """Rounds of k = 0 (the controller's plain stretch) give the head one position a row
    each, taken in once PENDING_MAX have piled up; drafting then resumes from heads that
    hold exactly each row's sequence and propose what a fresh head does, rows of different
    lengths; tokens are the target's."""
    decoder = make_batch_decoder(eagle, 3)
    ks = iter([3, 3] + [0] * (PENDING_MAX + 3) + [3] * 100)
    monkeypatch.setattr(decoder, "_choose_k", lambda: next(ks))
    rows = {}
    for text in (TEXTS[0], TEXTS[4], TEXTS[2]):
        prompt = eagle.tokenizer.encode(text)
        rows[decoder.add(prompt, GenerationConfig(max_tokens=40))] = prompt
    out, fed = {r: [] for r in rows}, False
    for _ in range(2 + PENDING_MAX + 3):
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
        fed = fed or all(p is None for p in decoder.heads.pending)  # the pile taken in
    assert fed and 0 < max(p.shape[0] for p in decoder.heads.pending) <= PENDING_MAX
    ids = [r.id for r in decoder.rows]
    guesses = dict(zip(ids, assert_head_holds(eagle, decoder), strict=True))
    first = True
    while decoder.rows:
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
            if first:  # the heads draft what a fresh prefill's would
                assert u.round.proposal == guesses[rid]
        first = False
    for rid, prompt in rows.items():
        assert out[rid] == reference(eagle, prompt, 40)


def test_each_rows_head_holds_its_sequence_after_rejections(eagle):
    """After rounds where rows rejected different numbers of guesses (each rolled back by
    its own), every row's head cache is a fresh prefill's of its sequence."""
    decoder = make_batch_decoder(eagle, 3)
    for text in TEXTS:
        decoder.add(eagle.tokenizer.encode(text), GenerationConfig(max_tokens=60))
    rejections = set()
    for _ in range(6):
        for u in decoder.step().values():
            rejections.add(u.round.drafted - u.round.accepted)
    assert len(rejections) > 1
    assert_head_holds(eagle, decoder)


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(eagle):
    """A schema, a regex, penalties and a logit bias, log-probabilities, a plain row and a
    seeded sampled one with a penalty (test_batch's MIXED), the head drafting for all: each
    row's tokens and log-probabilities are what it gets alone with the head."""
    rows, got, rounds = run_mixed(eagle)
    assert sum(r.drafted for _, r in rounds) > 0
    assert_mixed_rows_as_alone(eagle, rows, got)


def test_a_one_token_row_with_forced_tokens_drafts_them_before_the_head_can(eagle):
    """A one-token prompt gives the head no entry before its first pass; a schema forces the
    first tokens all the same (drafted without the head), and the row is what it is alone."""
    config = GenerationConfig(max_tokens=12, num_draft_tokens=3, **MIXED["schema"])
    prompt = eagle.tokenizer.encode(TEXTS[3])[:1]
    decoder = make_batch_decoder(eagle, 3)
    rid = decoder.add(prompt, config)
    assert not decoder.heads.can_draft(0)
    out, _ = run_rows(decoder, {rid: None})
    assert out[rid][1][0]["kind"] != "plain" and len(out[rid][1][0]["drafted"]) > 0
    assert out[rid][0] == [e.token for e in mlx_spec.stream(eagle, prompt, config)]


def test_suffix_rows_beside_the_head_equal_each_alone(eagle, monkeypatch):
    from test_suffix import assert_suffix_rows_beside_the_head

    assert_suffix_rows_beside_the_head(eagle, monkeypatch)
