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
from test_batch import CANCELLED, MIXED, SCHEDULE, TEXTS, records, run_rows
from test_batch_eagle import run
from test_greedy_equality import reference
from test_mtp import checkpoint, mtp_pair  # noqa: F401 (fixtures)
from test_mtp_nextn import build

import mlx_spec
from mlx_spec import GenerationConfig, SpecError, generate, load_pair
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch import into_decoder, make_batch_decoder
from mlx_spec.decode.batch_head import MTPRows
from mlx_spec.decode.prompts import prompt_tokens
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
    """Rows join at rounds 0-6 (prompts of 1 to 15 tokens), leave at their max_tokens, one
    is cancelled; each row's tokens are the target's alone, and the rows drafted, with some
    guesses accepted and some rejected."""
    prompts = [mtp.tokenizer.encode(t) for t in TEXTS]
    prompts[3] = prompts[3][:1]  # a one-token prompt: its first pair (position 0) comes later
    decoder = make_batch_decoder(mtp, k)
    out, reasons, drafted, accepted = run(decoder, prompts)
    for i, (p, _, max_tokens) in enumerate(SCHEDULE):
        expected = reference(mtp, prompts[p], max_tokens)
        if i == CANCELLED:
            assert reasons[i] == "cancelled" and out[i] == expected[: len(out[i])]
        else:
            assert out[i] == expected, f"row {i}"
    assert len(decoder) == 0 and decoder.heads.cache is None
    assert drafted > 0 and 0 < accepted < drafted


@pytest.mark.parametrize("k", [1, 3])
def test_batch_generate_equals_generate(mtp, k):
    """batch_generate, two rows at a time (the others join as rows finish), a one-token
    prompt among them: each result's tokens are generate's without drafts, and each row's
    rounds (what the head proposed, what the target kept) are generate's with the head."""
    prompts = TEXTS[:3] + [[7], TEXTS[4]]
    results = mlx_spec.batch_generate(mtp, prompts, max_tokens=24, num_draft_tokens=k, max_batch=2)
    drafted = accepted = 0
    for prompt, res in zip(prompts, results, strict=True):
        assert res.tokens == generate(mtp, prompt, max_tokens=24, use_draft=False).tokens
        alone = generate(mtp, prompt, max_tokens=24, num_draft_tokens=k)
        assert records(res.rounds) == records(alone.rounds)
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert drafted > 0 and 0 < accepted < drafted


def test_seeded_rows_sample_the_same_whatever_the_batch(mtp):
    """A seeded sampled row draws the same tokens alone, beside other rows (greedy and
    sampled, joining before and after it) and in `generate` with the head at the same k."""
    prompts = [mtp.tokenizer.encode(t) for t in TEXTS]
    mine = GenerationConfig(max_tokens=24, temperature=1.0, seed=11)

    def in_batch(others) -> list[int]:
        decoder = make_batch_decoder(mtp, 3)
        got, rnd, me = [], 0, None
        while rnd < 100:
            for p, start, temp in others:
                if start == rnd:
                    decoder.add(
                        prompts[p], GenerationConfig(max_tokens=15, temperature=temp, seed=rnd)
                    )
            if rnd == 2:
                me = decoder.add(prompts[2], mine)
            updates = decoder.step()
            if me in updates:
                got += updates[me].tokens
                if updates[me].done:
                    return got
            rnd += 1
        raise AssertionError("the row never finished")

    alone = in_batch([])
    assert alone == in_batch([(0, 0, 0.0), (1, 1, 0.8), (3, 4, 1.0)])
    assert alone == in_batch([(4, 0, 1.0), (0, 3, 0.0)])
    assert alone == generate(mtp, TEXTS[2], mine, num_draft_tokens=3).tokens


def test_rows_from_and_into_single_stream_decoders(mtp):
    """Turn 1 runs single-stream (a kept decoder); turn 2 is a batch row started from its
    caches (the target's trimmed to the shared prefix, the head's drafter state taken along,
    so it proposes what a fresh run's head does), beside a fresh row; it is removed
    mid-reply with keep=True and continues single-stream from the caches and head state it
    hands back (nothing prefilled again). Every turn's tokens and proposals equal a fresh
    run's."""
    config = GenerationConfig(max_tokens=14, num_draft_tokens=3)
    d = mlx_spec.make_decoder(mtp)
    generate(mtp, TEXTS[1], config, decoder=d)
    more = mtp.tokenizer.encode(" and then", add_special_tokens=False)
    prompt = d.sequence[:-4] + more
    held = len(d.sequence) - 1
    decoder = make_batch_decoder(mtp, 3)
    other = decoder.add(mtp.tokenizer.encode(TEXTS[0]), GenerationConfig(max_tokens=30))
    rid = decoder.add(prompt, GenerationConfig(max_tokens=30), kept=d, keep=True)
    assert decoder.row(rid).reused == held - 3 and not d.sequence
    tokens, rounds = [], []
    for _ in range(4):
        u = decoder.step()[rid]
        tokens += u.tokens
        rounds += records([u.round])
    state = decoder.remove(rid)
    assert len(decoder) == 1
    assert tokens == reference(mtp, prompt, 30)[: len(tokens)]
    assert rounds == records(generate(mtp, prompt, config.replace(max_tokens=30)).rounds)[:4]
    assert state.sequence == prompt + tokens
    single = into_decoder(mlx_spec.make_decoder(mtp), state)
    follow = state.sequence + more
    res = generate(mtp, follow, config, decoder=single)
    fresh = generate(mtp, follow, config)
    assert res.tokens == fresh.tokens and res.stats.drafted > 0
    # the head's state came along: nothing computed again, its guesses a fresh run's
    assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
    assert records(res.rounds) == records(fresh.rounds)
    out, _ = run_rows(decoder, {other: None})  # the row beside it carries on
    assert out[other][0][-4:] == reference(mtp, TEXTS[0], 30)[-4:]


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
    configs = [
        GenerationConfig(max_tokens=24, num_draft_tokens=3, **settings)
        for settings in MIXED.values()
    ]
    prompts = [TEXTS[i % len(TEXTS)] for i in range(len(configs))]
    decoder = make_batch_decoder(mtp, 3)
    rows = {
        decoder.add(prompt_tokens(mtp, p, c)[0], c): (label, p, c)
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
        alone = list(mlx_spec.stream(mtp, prompt, config))
        assert got[rid][0] == [e.token for e in alone], label
        if label == "logprobs":
            assert np.allclose(got[rid][1], [e.logprob for e in alone], atol=1e-4), label


def test_a_recurrent_target_with_its_mtp_layer_batches_plainly(mtp_pair):  # noqa: F811
    """Qwen3.5 with its MTP layer (tests/test_mtp.py's): a batch takes the recurrent target
    with lookup or a draft model, not a head yet; the server's resident pair then batches
    plainly (a lone request drafts alone as a single stream), as before heads batched."""
    with pytest.raises(SpecError, match="not a head yet"):
        make_batch_decoder(mtp_pair)
    resident = Resident(lambda name: None, [], max_batch=4)
    resident.install(mtp_pair, "qwen35")
    assert resident.batch is not None and resident.batch_plain and resident.lone_alone
    assert "not a head yet" in resident.batch_refusal
