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
from test_batch import CANCELLED, MIXED, SCHEDULE, TEXTS, pin_costs, records, run_rows
from test_batch_eagle import run
from test_dflash import heads, llama_pair  # noqa: F401 (fixtures)
from test_greedy_equality import reference

import mlx_spec
from mlx_spec import GenerationConfig, generate
from mlx_spec.core.caches import prefill_cache
from mlx_spec.decode.batch import into_decoder, make_batch_decoder
from mlx_spec.decode.batch_head import DFlashRows
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


@pytest.mark.parametrize("k", [1, 3, 9, "auto"])
def test_greedy_rows_equal_each_alone(dflash, k, monkeypatch):
    """Rows join at rounds 0-6 (prompts of 1 to 15 tokens), leave at their max_tokens, one
    is cancelled; each row's tokens are the target's alone and the rows drafted (k 9: capped
    at the block's 7 guesses)."""
    prompts = [dflash.tokenizer.encode(t) for t in TEXTS]
    prompts[3] = prompts[3][:1]  # a one-token prompt: a block over an empty context
    decoder = make_batch_decoder(dflash, k)
    if k == "auto":  # a cheap head step: the clock may find the tiny head as dear as the target
        pin_costs(decoder, monkeypatch)
        assert decoder.controller.k_max == 7  # the block's guesses
    out, reasons, drafted, accepted = run(decoder, prompts)
    for i, (p, _, max_tokens) in enumerate(SCHEDULE):
        expected = reference(dflash, prompts[p], max_tokens)
        if i == CANCELLED:
            assert reasons[i] == "cancelled" and out[i] == expected[: len(out[i])]
        else:
            assert out[i] == expected, f"row {i}"
    assert len(decoder) == 0 and decoder.heads.cache is None
    assert drafted > 0 and accepted < drafted


@pytest.mark.parametrize("k", [1, 4])
def test_batch_generate_equals_generate(dflash, k):
    """batch_generate, two rows at a time, a one-token prompt among them: each result's
    tokens are generate's without drafts, and each row's rounds (what the head proposed,
    what the target kept) are generate's with the head."""
    prompts = TEXTS[:3] + [[7], TEXTS[4]]
    results = mlx_spec.batch_generate(
        dflash, prompts, max_tokens=24, num_draft_tokens=k, max_batch=2
    )
    drafted = 0
    for prompt, res in zip(prompts, results, strict=True):
        assert res.tokens == generate(dflash, prompt, max_tokens=24, use_draft=False).tokens
        alone = generate(dflash, prompt, max_tokens=24, num_draft_tokens=k)
        assert records(res.rounds) == records(alone.rounds)
        drafted += res.stats.drafted
    assert drafted > 0


def test_seeded_rows_propose_and_keep_what_they_do_alone(dflash):
    """Seeded sampled rows (each its own seed and temperature, two at a time, so rows join
    as others leave): each row's rounds (what the head proposed, what the target kept) are
    `generate`'s with the head; some guesses are accepted, so rows keep different counts."""
    configs = [
        GenerationConfig(max_tokens=30, num_draft_tokens=4, temperature=t, seed=s)
        for t, s in ((1.0, 3), (0.7, 4), (1.0, 5), (1.3, 6), (1.0, 7))
    ]
    results = mlx_spec.batch_generate(dflash, TEXTS, configs, max_batch=3)
    drafted = accepted = 0
    for text, config, res in zip(TEXTS, configs, results, strict=True):
        alone = generate(dflash, text, config)
        assert records(res.rounds) == records(alone.rounds)
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert 0 < accepted < drafted


def test_seeded_rows_sample_the_same_whatever_the_batch(dflash):
    """A seeded sampled row draws the same tokens alone, beside other rows (greedy and
    sampled, joining before and after it) and in `generate` with the head at the same k."""
    prompts = [dflash.tokenizer.encode(t) for t in TEXTS]
    mine = GenerationConfig(max_tokens=24, temperature=1.0, seed=11)

    def in_batch(others) -> list[int]:
        decoder = make_batch_decoder(dflash, 3)
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
    assert alone == generate(dflash, TEXTS[2], mine, num_draft_tokens=3).tokens


def test_rows_from_and_into_single_stream_decoders(dflash):
    """Turn 1 runs single-stream (a kept decoder); turn 2 is a batch row started from its
    caches (the head's context taken along, so it proposes what a fresh run's head does),
    beside a fresh row; it is removed mid-reply with keep=True and continues single-stream
    from the caches and head context it hands back (nothing prefilled again). Every turn's
    tokens and proposals equal a fresh run's."""
    config = GenerationConfig(max_tokens=14, num_draft_tokens=3)
    d = mlx_spec.make_decoder(dflash)
    generate(dflash, TEXTS[1], config, decoder=d)
    more = dflash.tokenizer.encode(" and then", add_special_tokens=False)
    prompt = d.sequence[:-4] + more
    held = len(d.sequence) - 1
    decoder = make_batch_decoder(dflash, 3)
    other = decoder.add(dflash.tokenizer.encode(TEXTS[0]), GenerationConfig(max_tokens=30))
    rid = decoder.add(prompt, GenerationConfig(max_tokens=30), kept=d, keep=True)
    assert decoder.row(rid).reused == held - 3 and not d.sequence
    tokens, rounds = [], []
    for _ in range(4):
        u = decoder.step()[rid]
        tokens += u.tokens
        rounds += records([u.round])
    state = decoder.remove(rid)
    # the head handed back is what a fresh single-stream prefill of the sequence gives
    n = len(state.sequence) - 1
    hidden = dict.fromkeys(decoder.hidden_layers)
    prefill_cache(
        dflash.target, make_prompt_cache(dflash.target), state.sequence[:-1], hidden=hidden
    )
    fresh_head = DFlashDrafter(dflash.head, dflash.target)
    fresh_head.prefill(state.sequence, output=TargetOutput(None, hidden, n, n))
    fresh_head.settle()
    assert state.head.spans == fresh_head.spans == [[0, n]] and not state.head.pending
    for c, f in zip(state.head.cache, fresh_head.cache, strict=True):
        for a, e in ((c.keys, f.keys), (c.values, f.values)):
            assert np.allclose(np.array(a[..., :n, :]), np.array(e[..., :n, :]), atol=1e-4)
    assert tokens == reference(dflash, prompt, 30)[: len(tokens)]
    assert rounds == records(generate(dflash, prompt, config.replace(max_tokens=30)).rounds)[:4]
    single = into_decoder(mlx_spec.make_decoder(dflash), state)
    follow = state.sequence + more
    res = generate(dflash, follow, config, decoder=single)
    fresh = generate(dflash, follow, config)
    assert res.tokens == fresh.tokens and res.stats.drafted > 0
    # the head's context came along: nothing computed again, its guesses a fresh run's
    assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
    assert records(res.rounds) == records(fresh.rounds)
    out, _ = run_rows(decoder, {other: None})
    assert out[other][0][-4:] == reference(dflash, TEXTS[0], 30)[-4:]


def test_a_mixed_batch_gives_each_row_what_it_gets_alone(dflash):
    """A schema, a regex, penalties and a logit bias, log-probabilities, a plain row and a
    seeded sampled one with a penalty (test_batch's MIXED), the head drafting for all: each
    row's tokens and log-probabilities are what it gets alone with the head."""
    configs = [
        GenerationConfig(max_tokens=24, num_draft_tokens=3, **settings)
        for settings in MIXED.values()
    ]
    prompts = [TEXTS[i % len(TEXTS)] for i in range(len(configs))]
    decoder = make_batch_decoder(dflash, 3)
    rows = {
        decoder.add(prompt_tokens(dflash, p, c)[0], c): (label, p, c)
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
        alone = list(mlx_spec.stream(dflash, prompt, config))
        assert got[rid][0] == [e.token for e in alone], label
        if label == "logprobs":
            assert np.allclose(got[rid][1], [e.logprob for e in alone], atol=1e-4), label
