"""Continuous batching that still speculates: every row's output is what it would be alone.

Rows join at different rounds (prefilled alone, merged in), reject different numbers of draft
tokens (each rolled back by its own count), and leave when they finish or are cancelled. The
references are mlx-lm on the target alone (greedy) and the exact joint distribution of the
first two tokens (sampled), as in test_greedy_equality.py and test_distribution.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tiny
from mlx_lm.models.cache import KVCache, make_prompt_cache
from test_distribution import PROMPT, VOCAB, accept_everything, chi_square, exact_joint
from test_greedy_equality import reference

import mlx_spec
import mlx_spec.decode.rounds
from mlx_spec import GenerationConfig, SpecError, generate, load_pair
from mlx_spec.core.batch_caches import check_batchable
from mlx_spec.core.batch_policy import (
    PROBE_ROUNDS,
    PROBE_ROUNDS_HOPELESS,
    BatchController,
    batch_speed,
    choose_batch_k,
    interpolate,
)
from mlx_spec.core.caches import prefill_cache
from mlx_spec.core.grammar import GrammarStateError
from mlx_spec.core.processors import make_processors
from mlx_spec.decode.batch import BatchDecoder, BatchTiming
from mlx_spec.decode.batch_rows import into_decoder
from mlx_spec.decode.events import RoundRecord
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.decode.prompts import prompt_tokens

TEXTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Paris is the capital of France. Berlin is the capital of",
    "Once",
    "Speculative decoding drafts tokens with a small model and verifies them",
]
# (prompt, joins before round, max_tokens): rows join at different rounds and leave at
# different rounds (their max_tokens), one is cancelled (below)
SCHEDULE = [(0, 0, 40), (1, 0, 24), (2, 2, 36), (3, 3, 12), (4, 6, 30)]
CANCELLED = 1  # the schedule index cancelled after round 5


@pytest.fixture(scope="module")
def qwen3_dirs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_qwen3")
    cfg = tiny.family_configs(320)["qwen3"]
    weights = tiny.family_weights(cfg, seed=0)
    target = tiny.write_model(root / "qwen3", cfg, weights, tiny_models.tokenizer)
    draft = tiny.write_model(
        root / "qwen3-draft", cfg, tiny.noisy(weights, 0.05), tiny_models.tokenizer
    )
    return target, draft


def pair_of(tiny_models, qwen3_dirs, family: str, drafter: str | None):
    target, draft = (tiny_models.target, tiny_models.draft) if family == "llama" else qwen3_dirs
    if drafter in ("model", "ngram+model"):
        return load_pair(target=str(target), draft=str(draft), drafter=drafter)
    pair = load_pair(target=str(target))
    return pair.configured(drafter="ngram") if drafter == "ngram" else pair


def run_schedule(decoder: BatchDecoder, prompts: list[list[int]], cancel_at: int | None = 5):
    """Drive the decoder through SCHEDULE: {schedule index: tokens, finish reason}."""
    ids, out, reasons, rnd = {}, {}, {}, 0
    decoder.drafted = 0
    while len(reasons) < len(SCHEDULE):
        for i, (p, start, max_tokens) in enumerate(SCHEDULE):
            if start == rnd:
                config = GenerationConfig(max_tokens=max_tokens)
                ids[decoder.add(prompts[p], config)] = i
                out[i] = []
        if rnd == cancel_at:
            decoder.cancel(next(r for r, i in ids.items() if i == CANCELLED))
        for row, u in decoder.step().items():
            out[ids[row]] += u.tokens
            decoder.drafted += u.round.drafted
            if u.done:
                reasons[ids[row]] = u.finish_reason
        rnd += 1
        assert rnd < 200
    return out, reasons


def assert_schedule_exact(pair, prompts, out: dict, reasons: dict, label: str = "") -> None:
    """Every row of SCHEDULE equal to the target alone (greedy, mlx-lm's reference); the
    cancelled one a prefix of it."""
    for i, (p, _, max_tokens) in enumerate(SCHEDULE):
        expected = reference(pair, prompts[p], max_tokens)
        if i == CANCELLED:
            assert reasons[i] == "cancelled"
            assert 0 < len(out[i]) < len(expected) and out[i] == expected[: len(out[i])]
        else:
            assert out[i] == expected, f"{label} row {i}"
            assert reasons[i] == ("length" if len(expected) == max_tokens else "stop")


@pytest.mark.parametrize(
    "family,drafter,k",
    [
        (family, drafter, k)
        for family, drafter in [
            ("llama", "model"),
            ("llama", "ngram"),
            ("llama", "ngram+model"),
            ("qwen3", "model"),
        ]
        for k in (3, "auto")
    ]
    + [("llama", None, 0), ("qwen3", None, 0)],
)
def test_greedy_rows_equal_each_alone(tiny_models, qwen3_dirs, family, drafter, k):
    pair = pair_of(tiny_models, qwen3_dirs, family, drafter)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, k if k else None)
    out, reasons = run_schedule(decoder, prompts)
    assert_schedule_exact(pair, prompts, out, reasons)
    assert len(decoder) == 0 and decoder.cache is None
    if k == 3:  # the rows did draft (else the test would show nothing of speculation)
        assert decoder.drafted > 0


def test_long_rows_past_the_cache_allocation_step(tiny_models):
    """Past 256 positions mlx-lm's BatchKVCache grows its buffer and a row's roll wraps
    into the left padding: still each row's own output (a noisy draft: mixed rejections)."""
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    prompts, lengths = [TEXTS[2], TEXTS[4], TEXTS[0]], [300, 200, 260]
    configs = [GenerationConfig(max_tokens=m, num_draft_tokens=5) for m in lengths]
    results = mlx_spec.batch_generate(pair, prompts, configs)
    for prompt, m, res in zip(prompts, lengths, results, strict=True):
        assert res.tokens == reference(pair, prompt, m)
    assert any(0 < r.stats.accepted < r.stats.drafted for r in results)


class PlainThen:
    """A draft-length policy (policies.Policy): `plain` plain tokens first, then k a round."""

    def __init__(self, plain: int, k: int):
        self.left, self.k = plain, k
        self.k_max = k

    def next(self, available=None) -> int:
        return 0 if self.left else self.k

    def plain_burst(self) -> int:
        n, self.left = self.left, 0
        return n or 1  # 1: a reply's last token, which no round may draft past

    def update(self, *args, **kwargs) -> None:
        pass

    update_plain = consumed = update

    def wants_split(self) -> bool:
        return False


def test_rows_join_after_plain_rounds_and_draft_at_once(pair, monkeypatch):
    """The batch decodes plainly for 6 rounds (as `auto` may), so the draft falls behind on the
        first row; rows join after that (their drafts prefilled to the batch's lag, so the others
    do not catch up then; all catch up in one pass when drafting starts) and every row drafts.
        Each row keeps its own output and its own draft context: its rounds (what the draft
        proposed, what was accepted) are those of a single-stream decoder under the same k."""
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, 4)
    rnd = 0
    monkeypatch.setattr(decoder, "_choose_k", lambda: 0 if rnd < 6 else 4)
    rows, out = {}, {}
    while rnd == 0 or len(decoder):
        if rnd in (0, 6, 9):
            row = decoder.add(prompts[rnd // 3], GenerationConfig(max_tokens=20))
            rows[row], out[row] = rnd // 3, []
        for row, u in decoder.step().items():
            out[row].append((u.round.proposal, u.round.accepted, u.tokens))
        rnd += 1
    for row, p in rows.items():
        alone = mlx_spec.make_decoder(pair)
        alone.prefill(prompts[p])
        policy = PlainThen(6 if p == 0 else 0, 4)
        rounds = alone.rounds(20, GenerationConfig().sampling, policy)
        expected = [(r.proposal, r.accepted, r.tokens) for r in rounds]
        assert out[row] == expected
        assert sum(len(t) for *_, t in out[row]) == 20
    assert len(rows) == 3


def test_batch_generate_equals_generate_per_prompt(pair):
    """Same tokens, text and stats per prompt as `generate` alone; with max_batch=2 the later
    prompts join as the first ones finish; a list of configs mixes settings per prompt, k
    too: each row drafts its own k every round (the batch's is the longest)."""
    configs = [  # the last one does not draft (its draft row is never prefilled)
        GenerationConfig(max_tokens=m, num_draft_tokens=k, temperature=t, seed=s, use_draft=d)
        for m, k, t, s, d in [
            (30, 4, 0.0, None, True),
            (12, 2, 1.0, 7, True),
            (25, 3, 0.7, 3, True),
            (18, 4, 0.0, None, False),
        ]
    ]
    prompts = TEXTS[:4]
    results = mlx_spec.batch_generate(pair, prompts, configs, max_batch=2)
    for prompt, config, res in zip(prompts, configs, results, strict=True):
        alone = generate(pair, prompt, config)
        assert res.tokens == alone.tokens
        assert res.text == alone.text
        assert res.kinds == alone.kinds and res.accepted == alone.accepted
        assert res.finish_reason == alone.finish_reason
        for name in ("generated_tokens", "drafted", "accepted", "target_passes", "prompt_tokens"):
            assert getattr(res.stats, name) == getattr(alone.stats, name), name
        assert [r.to_json() for r in res.rounds] == [r.to_json() for r in alone.rounds]
    assert sum(r.stats.drafted for r in results) > 0


def test_end_of_sequence_ends_a_row_mid_round(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    free_run = reference(pair, TEXTS[2], 40)
    position = next(i for i in range(8, 40) if free_run[i] not in free_run[:i])
    pair.tokenizer.add_eos_token(str(free_run[position]))
    results = mlx_spec.batch_generate(pair, TEXTS[:3], max_tokens=40, num_draft_tokens=5)
    assert results[2].tokens == free_run[:position] and results[2].finish_reason == "stop"
    for text, res in zip(TEXTS[:3], results, strict=True):
        assert res.tokens == reference(pair, text, 40)


def test_a_row_ended_by_an_accepted_draft_token_hands_back_exact_caches(tiny_models):
    """A draft identical to its target has every token accepted, so the end-of-sequence token
    comes as an accepted draft token in the middle of a round, the tokens after it dropped: the
    caches the row hands back hold its sequence (not the round's whole accepted run), and a
    single stream continues from them with a fresh run's tokens."""
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.target))
    free_run = reference(pair, TEXTS[2], 40)
    position = next(i for i in range(8, 40) if free_run[i] not in free_run[:i])
    k = next(k for k in (5, 4, 3) if position % (k + 1) not in (0, k))  # mid-round, not last
    pair.tokenizer.add_eos_token(str(free_run[position]))
    decoder = make_batch_decoder(pair, k)
    prompt = pair.tokenizer.encode(TEXTS[2])
    rid = decoder.add(prompt, GenerationConfig(max_tokens=40), keep=True)
    other = decoder.add(pair.tokenizer.encode(TEXTS[0]), GenerationConfig(max_tokens=40))
    out, states = run_rows(decoder, {rid: None, other: None})
    assert out[rid][0] == free_run[:position]
    last = out[rid][1][-1]
    assert len(last["drafted"]) == k and last["accepted"] > last["emitted"]  # cut mid-round
    state = states[rid]
    assert state.sequence == prompt + free_run[: position + 1]  # ... its end token kept
    assert_holds(pair.target, state.cache, state.sequence[:-1])
    assert_holds(pair.draft, state.draft_cache, state.draft_tokens)
    follow = state.sequence + pair.tokenizer.encode(" So", add_special_tokens=False)
    config = GenerationConfig(max_tokens=8, num_draft_tokens=k)
    d = into_decoder(mlx_spec.make_decoder(pair), state)
    res, fresh = generate(pair, follow, config, decoder=d), generate(pair, follow, config)
    assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
    assert res.tokens == fresh.tokens


def assert_seeded_rows_sample_as_alone(pair, k: int = 3) -> None:
    """A seed belongs to its request: alone, beside other rows (greedy and sampled, joining
    before and after it), and in `generate` at the same k, the same seed samples the same
    tokens (for every drafter a batch takes: tests/test_batch_eagle.py and the others)."""
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    mine = GenerationConfig(max_tokens=24, temperature=1.0, seed=11)

    def in_batch(others: list[tuple[int, int, float]]) -> list[int]:
        decoder = make_batch_decoder(pair, k)
        got, rnd, me = [], 0, None
        while me is None or rnd < 100:
            for p, start, temp in others:
                if start == rnd:
                    cfg = GenerationConfig(max_tokens=15, temperature=temp, seed=rnd)
                    decoder.add(prompts[p], cfg)
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
    assert alone == generate(pair, TEXTS[2], mine, num_draft_tokens=k).tokens


def assert_batch_generate_equals_generate(pair, k: int, some_accepted: bool = True) -> None:
    """batch_generate over prompts of different lengths (a one-token one among them), two
    rows at a time (the others join as rows finish): each result's tokens are generate's
    without drafts, each row's rounds (what the drafter proposed, what the target kept)
    generate's with it; some drafts accepted and some not (`some_accepted`; else drafts at
    least: a tiny random DFlash head is never right on greedy guesses)."""
    prompts = TEXTS[:3] + [[7], TEXTS[4]]
    results = mlx_spec.batch_generate(pair, prompts, max_tokens=24, num_draft_tokens=k, max_batch=2)
    drafted = accepted = 0
    for prompt, res in zip(prompts, results, strict=True):
        assert res.tokens == generate(pair, prompt, max_tokens=24, use_draft=False).tokens
        alone = generate(pair, prompt, max_tokens=24, num_draft_tokens=k)
        assert records(res.rounds) == records(alone.rounds)
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    assert drafted > 0 and (0 < accepted < drafted or not some_accepted)


def assert_a_row_comes_from_and_goes_into_single_streams(pair, inspect=None) -> None:
    """Turn 1 runs single-stream (a kept decoder, as the server's prompt cache keeps it);
    turn 2 is a batch row started from its caches (the target's trimmed to the shared
    prefix, a head's state taken along, so it proposes what a fresh run's does), beside a
    fresh row; it is removed mid-reply with keep=True (`inspect(decoder, state)` then looks
    at what it handed back) and continues single-stream from those caches and head state:
    nothing prefilled again. Every turn's tokens and proposals equal a fresh run's."""
    config = GenerationConfig(max_tokens=14, num_draft_tokens=3)
    d = mlx_spec.make_decoder(pair)
    generate(pair, TEXTS[1], config, decoder=d)
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    prompt = d.sequence[:-4] + more
    held = len(d.sequence) - 1
    decoder = make_batch_decoder(pair, 3)
    other = decoder.add(pair.tokenizer.encode(TEXTS[0]), GenerationConfig(max_tokens=30))
    rid = decoder.add(prompt, GenerationConfig(max_tokens=30), kept=d, keep=True)
    assert decoder.row(rid).reused == held - 3 and not d.sequence
    tokens, rounds = [], []
    for _ in range(4):
        u = decoder.step()[rid]
        tokens += u.tokens
        rounds += records([u.round])
    state = decoder.remove(rid)
    assert len(decoder) == 1 and state.sequence == prompt + tokens
    if inspect is not None:
        inspect(decoder, state)
    assert tokens == reference(pair, prompt, 30)[: len(tokens)]
    assert rounds == records(generate(pair, prompt, config.replace(max_tokens=30)).rounds)[:4]
    single = into_decoder(mlx_spec.make_decoder(pair), state)
    follow = state.sequence + more
    res = generate(pair, follow, config, decoder=single)
    fresh = generate(pair, follow, config)
    assert res.tokens == fresh.tokens and res.stats.drafted > 0
    assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
    assert records(res.rounds) == records(fresh.rounds)
    out, _ = run_rows(decoder, {other: None})  # the row beside it carries on
    assert out[other][0][-4:] == reference(pair, TEXTS[0], 30)[-4:]


def test_seeded_rows_sample_the_same_whatever_the_batch(pair):
    assert_seeded_rows_sample_as_alone(pair)


JOINING = 4  # sampled rows joining per round


def sampled_first_two(pair, params, runs: int, neighbours: bool = True) -> np.ndarray:
    """Counts of a temperature-`params` row's first two tokens over `runs` seeded rows that
    join a long-running batch one per round, beside a greedy row and a temperature-0.6 row
    that keep joining and leaving too; one decoder all along."""
    decoder = make_batch_decoder(pair, 2)
    counts = np.zeros((VOCAB, VOCAB))
    tokens: dict[int, list[int]] = {}
    seed, done = 0, 0
    others = 0
    while done < runs:
        for _ in range(min(JOINING, runs - seed)):  # a few join each round
            config = GenerationConfig(
                max_tokens=2, temperature=params.temperature, top_p=params.top_p, seed=seed
            )
            tokens[decoder.add(PROMPT, config)] = []
            seed += 1
        if neighbours and others < 2:  # neighbours of other settings and prompt lengths
            temp = 0.0 if seed % 2 else 0.6
            prompt = PROMPT[: 2 + seed % 4]
            decoder.add(prompt, GenerationConfig(max_tokens=7, temperature=temp, seed=seed))
            others += 1
        for row, u in decoder.step().items():
            if row in tokens:
                tokens[row] += u.tokens
                if u.done:
                    t = tokens.pop(row)
                    counts[t[0], t[1]] += 1
                    done += 1
            elif u.done:
                others -= 1
    return counts


def test_a_sampled_row_in_a_mixed_batch_follows_the_target(tiny_models, monkeypatch):
    pair = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    params = GenerationConfig(temperature=1.0, top_p=0.9).sampling
    probs = exact_joint(pair, params)
    stat, threshold = chi_square(sampled_first_two(pair, params, 2000), probs)
    print(f"batched: chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold
    # the same harness rejects a wrong acceptance rule, so the check can fail
    monkeypatch.setattr(mlx_spec.decode.rounds, "verify_stochastic", accept_everything)
    stat, threshold = chi_square(sampled_first_two(pair, params, 800), probs)
    assert stat > threshold


def test_caches_a_batch_cannot_roll_back_are_refused():
    """A cache class the batch does not know is refused by name before any row (sliding
    windows batch: test_batch_window.py; recurrent states: test_batch_recurrent.py; Llama 4
    and deepseek_v41's compressed LayerCache row by row: test_llama4.py, test_compressed.py)."""

    class Mine(KVCache):  # (a subclass may keep state of its own)
        pass

    class Model:
        model_type = "mine"

        def make_cache(self):
            return [KVCache(), Mine()]

    with pytest.raises(SpecError, match="uses Mine layers, which cannot be batched"):
        check_batchable(Model(), recurrent=True)


# ------------------------------------------------------------------ kept caches in and out


def records(rounds) -> list[dict]:
    """A result's rounds (RoundRecord) or a row's (Round), as what was drafted and kept."""
    return [
        (
            RoundRecord(r.proposal, r.accepted, r.target_token, len(r.tokens))
            if hasattr(r, "proposal")
            else r
        ).to_json()
        for r in rounds
    ]


def assert_holds(model, cache: list, tokens: list[int]) -> None:
    """Each layer holds exactly the keys and values a fresh prefill of `tokens` computes."""
    fresh = make_prompt_cache(model)
    prefill_cache(model, fresh, tokens)
    for c, f in zip(cache, fresh, strict=True):
        assert c.offset == f.offset == len(tokens)
        for a, b in ((c.keys, f.keys), (c.values, f.values)):
            n = len(tokens)
            assert np.allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-5)


def run_rows(decoder: BatchDecoder, rows: dict) -> tuple[dict, dict]:
    """Step until the rows (id -> anything) leave: {id: (tokens, round records)}, {id: state}."""
    out, states = {r: ([], []) for r in rows}, {}
    while len(states) < len(rows):
        for rid, u in decoder.step().items():
            out[rid][0].extend(u.tokens)
            out[rid][1].append(records([u.round])[0])
            if u.done:
                states[rid] = u.state
    return out, states


def pin_costs(decoder: BatchDecoder, monkeypatch, draft: float = 0.005) -> None:
    """The lone row's timed costs replaced by given ones (a target step 0.1 s, a draft step
    `draft`): on tiny models the clock may find the draft as dear as the target, and an
    `auto` batch then never runs it (the tests that need drafting pin a cheap one)."""
    calibrate = decoder.controller.calibrate
    monkeypatch.setattr(decoder.controller, "calibrate", lambda p, d: calibrate(0.1, draft))


@pytest.mark.parametrize("drafter", ["model", "ngram", "ngram+model"])
def test_rows_start_from_kept_caches_and_hand_them_back(tiny_models, qwen3_dirs, drafter):
    """Turn 1 runs single-stream (a kept Decoder, as the server's prompt cache keeps it);
    turn 2 of each conversation (one greedy, one seeded) is a batch row started from that
    decoder's caches (target and draft: trimmed to the shared prefix, only the rest
    prefilled); its caches come back as a Decoder that turn 3 continues single-stream. Every
    turn's tokens and rounds (what the draft proposed and the target kept) equal a fresh
    `generate`, so every handed-over cache held exactly its tokens."""
    pair = pair_of(tiny_models, qwen3_dirs, "llama", drafter)
    settings = [dict(temperature=0.0), dict(temperature=1.0, seed=5)]
    configs = [GenerationConfig(max_tokens=14, num_draft_tokens=3, **s) for s in settings]
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    kept, prompts = [], []
    for text, config in zip(TEXTS[1:3], configs, strict=True):
        d = mlx_spec.make_decoder(pair)
        generate(pair, text, config, decoder=d)
        kept.append(d)
        # the next turn re-renders the end of the reply differently: the cache is trimmed
        prompts.append(d.sequence[:-4] + more)
    held = [len(d.sequence) - 1 for d in kept]
    decoder = make_batch_decoder(pair, 3)
    neighbour = pair.tokenizer.encode(TEXTS[0])
    rows = {decoder.add(neighbour, GenerationConfig(max_tokens=6)): None}  # a fresh one
    for p, config, d in zip(prompts, configs, kept, strict=True):
        rows[decoder.add(p, config, kept=d, keep=True)] = (p, config)
    assert [decoder.row(r).reused for r in list(rows)[1:]] == [h - 3 for h in held]
    assert all(not d.sequence for d in kept)  # their caches are the rows' now
    out, states = run_rows(decoder, rows)
    assert states[next(iter(rows))] is None  # a row added without keep hands nothing back
    for rid, entry in list(rows.items())[1:]:
        p, config = entry
        fresh = generate(pair, p, config)
        assert out[rid] == (fresh.tokens, records(fresh.rounds))
        state = states[rid]
        assert state.sequence[: len(p) + len(fresh.tokens)] == p + fresh.tokens
        assert_holds(pair.target, state.cache, state.sequence[:-1])
        if drafter == "model":
            assert_holds(pair.draft, state.draft_cache, state.draft_tokens)
        # turn 3 continues single-stream from the row's caches
        d = into_decoder(mlx_spec.make_decoder(pair), state)
        if drafter == "model":
            assert d.drafter.cached and d.drafter.cached == state.sequence[: len(d.drafter.cached)]
        follow = state.sequence + more
        res = generate(pair, follow, config, decoder=d)
        fresh = generate(pair, follow, config)
        assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
        assert (res.tokens, records(res.rounds)) == (fresh.tokens, records(fresh.rounds))
    if drafter == "model":
        greedy = states[list(rows)[1]]
        assert greedy.draft_cache is not None and greedy.draft_tokens


def test_a_row_removed_after_plain_rounds_hands_its_draft_back_exactly(pair, monkeypatch):
    """Plain rounds leave the draft behind (its cache holds the row's sequence but its last
    `lag` tokens); a row removed then (a stop string, a client gone) hands back a draft cache
    of exactly those tokens, and a single stream continues from it with a fresh run's rounds."""
    decoder = make_batch_decoder(pair, 3)
    ks = iter([3, 3, 3, 0, 0, 0])  # k of each round: drafting, then plain
    monkeypatch.setattr(decoder, "_choose_k", lambda: next(ks))
    rid = decoder.add(pair.tokenizer.encode(TEXTS[4]), GenerationConfig(max_tokens=40), keep=True)
    other = decoder.add(pair.tokenizer.encode(TEXTS[2]), GenerationConfig(max_tokens=40))
    for _ in range(6):
        decoder.step()
    assert decoder.lag == 5
    state = decoder.remove(rid)
    assert len(decoder) == 1 and decoder.remove(rid) is None and decoder.remove(other) is None
    assert state.draft_tokens == state.sequence[:-5]
    assert_holds(pair.target, state.cache, state.sequence[:-1])
    assert_holds(pair.draft, state.draft_cache, state.draft_tokens)
    d = into_decoder(mlx_spec.make_decoder(pair), state)
    follow = state.sequence + pair.tokenizer.encode(" So", add_special_tokens=False)
    config = GenerationConfig(max_tokens=12, num_draft_tokens=3)
    res, fresh = generate(pair, follow, config, decoder=d), generate(pair, follow, config)
    assert res.stats.prompt_tokens_reused == len(state.sequence) - 1
    assert (res.tokens, records(res.rounds)) == (fresh.tokens, records(fresh.rounds))


def test_rows_shorter_than_the_drafts_lag_join_it(pair, monkeypatch):
    """After plain rounds the draft lags the rows by 8 tokens. A row that does not draft
    (use_draft=False: its draft row holds nothing) with a 2-token prompt joins, then a row
    with a one-token prompt (its draft row holds the token twice), both shorter than that
    lag: the catch-up and the drafting rounds feed every row its tail, padded alike. Every
    row's tokens are the target's; the one-token row, added with keep=True, hands back its
    target cache, not its draft's (which is no prefix of its sequence)."""
    decoder = make_batch_decoder(pair, 3)
    ks = iter([0] * 6 + [3] * 60)
    monkeypatch.setattr(decoder, "_choose_k", lambda: next(ks))
    long = pair.tokenizer.encode(TEXTS[4])
    first = decoder.add(long, GenerationConfig(max_tokens=30))
    for _ in range(6):
        decoder.step()
    assert decoder.lag == 8
    ids = pair.tokenizer.encode(TEXTS[2])
    plain = decoder.add(ids[:2], GenerationConfig(max_tokens=12, use_draft=False))
    one = decoder.add(ids[:1], GenerationConfig(max_tokens=12), keep=True)
    out, states = run_rows(decoder, {first: None, plain: None, one: None})
    assert out[plain][0] == reference(pair, ids[:2], 12)
    assert out[one][0] == reference(pair, ids[:1], 12)
    assert sum(len(r["drafted"]) for r in out[one][1]) > 0  # the one-token row drafted
    state = states[one]
    assert state.draft_cache is None and state.sequence == ids[:1] + out[one][0]
    assert_holds(pair.target, state.cache, state.sequence[:-1])


def test_a_kept_cache_that_is_not_what_it_says_is_refused(pair):
    d = mlx_spec.make_decoder(pair)
    generate(pair, TEXTS[0], max_tokens=6, decoder=d)
    d.sequence = d.sequence + [5, 6]  # the caches do not hold these
    with pytest.raises(SpecError, match="holds"):
        make_batch_decoder(pair, 3).add(d.sequence + [7], kept=d)


def test_a_rows_bad_input_is_refused_and_the_batch_goes_on(tiny_models, pair):
    """What `add` takes is checked as `generate` checks it (found by an adversarial run): an
    id past the vocabulary crashed the process (MLX does not bounds-check a gather), -1 broke
    every later step of the batch, a decoder of another pair gave other tokens, max_tokens 0
    emitted one. Each is one SpecError, and the batch then serves a good row as alone."""
    batch = make_batch_decoder(pair, 3)
    ids = pair.tokenizer.encode(TEXTS[0])
    other = load_pair(target=str(tiny_models.mamba), drafter="ngram")
    theirs = mlx_spec.make_decoder(other)
    generate(other, ids, max_tokens=4, decoder=theirs)
    bad = [
        ((ids + [pair.vocab_size],), {}, "out of range"),
        ((ids + [10**6],), {}, "out of range"),
        (([-1] + ids,), {}, "out of range"),
        ((ids + [1.5],), {}, "integers"),
        ((TEXTS[0],), {}, "list of token ids"),
        ((ids,), {"max_tokens": 0}, "max_tokens"),
        ((ids,), {"max_tokens": 1.5}, "max_tokens"),
        ((ids,), {"kept": theirs}, "another pair"),
    ]
    for args, kwargs, why in bad:
        with pytest.raises(SpecError, match=why):
            batch.add(*args, **kwargs)
    assert len(batch) == 0
    with pytest.raises(SpecError, match="no row 999"):
        batch.row(999)
    row = batch.add(ids, GenerationConfig(max_tokens=12))
    tokens = []
    while len(batch):
        tokens += batch.step()[row].tokens
    assert tokens == generate(pair, ids, max_tokens=12).tokens


def test_what_is_not_batched_yet_is_refused(tiny_models, pair):
    """A drafter kind that does not say how a batch drafts with it (here the example kind of
    tests/example_kind.py) is refused by name, with the kinds that do."""
    from example_kind import RepeatKind

    from mlx_spec.drafters import KINDS, register

    register(RepeatKind)
    try:
        repeat = load_pair(target=str(tiny_models.target), drafter="repeat")
        with pytest.raises(SpecError, match="repeat drafter is not batched yet .*ngram\\+model"):
            make_batch_decoder(repeat)
    finally:
        KINDS.pop(RepeatKind.name)
    assert mlx_spec.batch_generate(pair, []) == []
    with pytest.raises(SpecError, match="a list of prompts"):  # (it ran one per character)
        mlx_spec.batch_generate(pair, "hello")


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_draft_confidence_stop_cuts_each_row_as_alone(pair, temperature):
    """draft_confidence in a batch: each row's proposal stops after the first guess the
    draft is less sure of, as ModelDrafter does alone: the same rounds, draft for draft."""
    pair = pair.configured(draft_confidence=0.6)
    configs = [
        GenerationConfig(max_tokens=24, num_draft_tokens=4, temperature=temperature, seed=5)
        for _ in range(3)
    ]
    results = mlx_spec.batch_generate(pair, TEXTS[:3], configs)
    cut = 0
    for prompt, config, res in zip(TEXTS[:3], configs, results, strict=True):
        alone = generate(pair, prompt, config)
        assert res.tokens == alone.tokens
        assert [r.drafted for r in res.rounds] == [r.drafted for r in alone.rounds]
        cut += sum(0 < len(r.drafted) < 4 for r in res.rounds)
    assert cut > 0  # some proposals were cut short (else the test shows nothing)


MIXED = {  # one row each: what a request may ask, batched beside the others
    "schema": {"schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    "regex": {"regex": "(ab|cd)+e"},
    "penalties": {"processors": make_processors(repetition_penalty=1.5, logit_bias={7: 4.0})},
    "logprobs": {"logprobs": 3},
    "plain": {},
    "sampled": {
        "temperature": 0.8,
        "seed": 11,
        "processors": make_processors(presence_penalty=0.7),
    },
}


def run_mixed(pair, texts=TEXTS) -> tuple[dict, dict, list]:
    """One row per MIXED setting (prompts from `texts` in turn) in one batch, run to the
    end: {row: (name, prompt, config)}, {row: (tokens, log-probabilities)}, every Round."""
    configs = [
        GenerationConfig(max_tokens=24, num_draft_tokens=3, **settings)
        for settings in MIXED.values()
    ]
    prompts = [texts[i % len(texts)] for i in range(len(configs))]
    decoder = make_batch_decoder(pair, 3)
    rows = {
        decoder.add(prompt_tokens(pair, p, c)[0], c): (name, p, c)
        for name, p, c in zip(MIXED, prompts, configs, strict=True)
    }
    got = {rid: ([], []) for rid in rows}
    rounds = []
    while len(decoder):
        for rid, u in decoder.step().items():
            got[rid][0].extend(u.tokens)
            got[rid][1].extend(u.round.logprobs or [])
            rounds.append((rid, u.round))
    return rows, got, rounds


def assert_mixed_rows_as_alone(pair, rows: dict, got: dict, skip=()) -> None:
    """Each row's tokens (and log-probabilities, where asked; none elsewhere) are what it
    gets alone."""
    for rid, (name, prompt, config) in rows.items():
        if name in skip:
            continue
        alone = list(mlx_spec.stream(pair, prompt, config))
        assert got[rid][0] == [e.token for e in alone], name
        if name == "logprobs":
            assert np.allclose(got[rid][1], [e.logprob for e in alone], atol=1e-4), name
        else:
            assert got[rid][1] == [], name


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(pair, drafter):
    """A schema, a regex, penalties and a logit bias, log-probabilities, a plain row and a
    seeded sampled one with a penalty, in one batch: each row's tokens (and log-probabilities)
    are what it gets alone; each grammar holds its own matcher, rolled back with its row."""
    if drafter == "ngram":
        pair = load_pair(target=str(pair.config.target), drafter="ngram")
    rows, got, rounds = run_mixed(pair)
    assert sum(r.drafted for _, r in rounds) > 0
    # the grammars' forced tokens (braces, a key, the b after an a) are drafted for free
    forced = {rid: sum(r.forced for i, r in rounds if i == rid) for rid in rows}
    assert [forced[rid] > 0 for rid in rows] == [
        n in ("schema", "regex") for n, _, _ in rows.values()
    ]
    assert_mixed_rows_as_alone(pair, rows, got)
    # the grammars held: the regex row's text matches it
    name_of = {v[0]: k for k, v in rows.items()}
    text = pair.tokenizer.decode(got[name_of["regex"]][0])
    assert re.fullmatch("(ab|cd)+e", text) or not text.endswith("e"), text


def test_batch_generate_reports_each_rows_grammar_as_generate_does(pair):
    """batch_generate's stats say what constrained each row and what its masks cost, as
    generate's do (they were left empty: a schema's row reported no grammar at all)."""
    configs = [GenerationConfig(max_tokens=12, num_draft_tokens=2, **MIXED[n]) for n in MIXED]
    results = mlx_spec.batch_generate(pair, [TEXTS[0]] * len(configs), configs)
    for name, config, res in zip(MIXED, configs, results, strict=True):
        alone = generate(pair, TEXTS[0], config)
        assert res.tokens == alone.tokens, name
        assert res.stats.constrained == alone.stats.constrained, name
        asked = name in ("schema", "regex")
        assert (res.stats.masks > 0 and res.stats.mask_seconds > 0) == asked, name
    assert results[0].stats.constrained == "json_schema" and results[1].stats.constrained == "regex"


def test_a_row_drafts_at_most_its_own_k_in_an_auto_batch(pair, monkeypatch):
    """Rows asking k = 1 and `auto` share a batch whose controller chooses 4 (fixed here,
    timings aside): the first drafts one token a round, the other four; both are the
    target's tokens. batch_generate's stats say each row's own k."""
    decoder = make_batch_decoder(pair, "auto")
    pin_costs(decoder, monkeypatch)
    monkeypatch.setattr(decoder, "_choose_k", lambda: 4)
    ids = [pair.tokenizer.encode(t) for t in TEXTS[1:3]]
    rows = [
        decoder.add(p, GenerationConfig(max_tokens=30, num_draft_tokens=n))
        for p, n in zip(ids, (1, "auto"), strict=True)
    ]
    out, _ = run_rows(decoder, dict.fromkeys(rows))
    drafted = [{len(r["drafted"]) for r in out[row][1]} for row in rows]
    assert drafted[0] <= {0, 1} and 1 in drafted[0] and 4 in drafted[1]
    for row, text in zip(rows, TEXTS[1:3], strict=True):
        assert out[row][0] == reference(pair, text, 30)
    configs = [GenerationConfig(max_tokens=4, num_draft_tokens=n) for n in (1, "auto")]
    one, auto = mlx_spec.batch_generate(pair, TEXTS[1:3], configs)
    assert one.stats.num_draft_tokens == 1 and auto.stats.num_draft_tokens == 8


# ------------------------------------------------------------------ the controller knows the batch


def test_interpolated_pass_costs():
    points = {2: 1.0, 4: 2.0}
    assert interpolate(points, 3, 0.1) == pytest.approx(1.5)
    assert interpolate(points, 8, 0.1) == pytest.approx(4.0)  # the last segment's slope
    assert interpolate({4: 2.0}, 8, 0.1) == pytest.approx(2.4)  # one point: the prior slope
    assert interpolate({}, 8, 0.1) is None


@pytest.mark.parametrize("per_row", [0.01, 0.05])
def test_k_shrinks_as_the_batch_grows_and_reaches_plain(per_row):
    """A pass of `rows` rows costs 1 + per_row * rows (memory-bound until the rows add up):
    the best k falls with B and reaches 0, where verifying drafts costs more than they save."""
    acceptance = [0.8] * 8
    ks = [
        choose_batch_k(b, 8, lambda rows: 1 + per_row * rows, 0.05, acceptance)
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 512)
    ]
    assert ks[0] >= 3
    assert all(a >= b for a, b in zip(ks, ks[1:], strict=False)), ks
    assert ks[-1] == 0


def test_a_block_heads_draft_is_priced_once_a_round():
    """A block head (DFlash) drafts every position in one forward: its round costs one draft
    whatever k, so at the same costs it drafts longer than a chained drafter paying k steps,
    and a draft step dearer than a whole pass can still pay at a long k."""
    acceptance = [0.9] * 8
    pass_seconds = lambda rows: 1 + 0.01 * rows  # noqa: E731
    chained = choose_batch_k(2, 8, pass_seconds, 0.3, acceptance)
    block = choose_batch_k(2, 8, pass_seconds, 0.3, acceptance, block=True)
    assert block == 8 > chained
    tokens = 2 * sum(0.9**j for j in range(1, 5)) + 2  # E(4) a row, two rows
    speed = batch_speed(4, 2, pass_seconds, 0.3, acceptance, block=True)
    assert speed == pytest.approx(tokens / (pass_seconds(10) + 0.3))
    assert batch_speed(0, 2, pass_seconds, 5.0, acceptance, block=True) == pytest.approx(
        2 / pass_seconds(2)
    )
    assert choose_batch_k(1, 8, pass_seconds, 1.5, acceptance, block=True) > 0
    assert choose_batch_k(1, 8, pass_seconds, 1.5, acceptance) == 0


def test_compute_bound_passes_and_empty_lookups_choose_plain():
    acceptance = [0.9] * 8
    assert choose_batch_k(1, 8, lambda rows: 0.1 * rows, 0.0, acceptance) == 0  # rows cost alike
    never = [[0.0] * 8] * 4  # lookup has nothing for any row: drafts would only cost rows
    assert choose_batch_k(4, 8, lambda rows: 1 + 0.01 * rows, 0.0, acceptance, never) == 0
    assert BatchController(8, draft_model=False).next(4, [False] * 4) == 0


def test_a_draft_that_cannot_pay_is_not_tried_by_a_lone_row():
    """Calibrated from a lone row's prefill (as batch.add times it), a draft step as dear as a
    target pass that barely grows with rows (a compute-bound draft): even always accepted it
    cannot pay, so a batch of one decodes plainly from the first round, as a single stream
    does, and probes only after PROBE_ROUNDS_HOPELESS rounds; a cheap draft is tried at once."""
    hopeless = BatchController(8, draft_model=True)
    assert hopeless.wants_timing()
    hopeless.calibrate(0.1, 0.1)
    assert not hopeless.wants_timing()
    ks = [hopeless.next(1) for _ in range(PROBE_ROUNDS_HOPELESS)]
    assert ks[:-1] == [0] * (PROBE_ROUNDS_HOPELESS - 1) and ks[-1] == 1
    cheap = BatchController(8, draft_model=True)
    cheap.calibrate(0.1, 0.005)
    assert cheap.next(1) == 1  # the warm-up that times a wider pass


@pytest.mark.parametrize("per_token,probes", [(0.02, False), (0.005, True), (0.001, True)])
def test_a_probe_waits_while_the_catch_up_costs_more_than_a_pass(per_token, probes):
    """A cheap draft whose tokens were all rejected: the batch of one decodes plainly and
    probes after PROBE_ROUNDS rounds, unless the draft's catch-up of the 40 tokens it missed
    (at the measured seconds per token) would cost more than a plain pass and more than a
    tenth of the 40 plain rounds (at 0.005 s a token: 0.2 s, two passes, once never probed:
    the lag grows with every plain round, so a batch that stopped drafting never drafted
    again)."""
    c = BatchController(8, draft_model=True)
    c.calibrate(0.1, 0.02)
    c.update(1, BatchTiming(2, 1, 0.02, 0.1), [(1, 1, 0)])  # drafted one token, rejected
    c.observe_catch_up(40, 40 * per_token)
    ks = [c.next(1, None, missed=40) for _ in range(PROBE_ROUNDS + 1)]
    assert (1 in ks) is probes and ks[0] == 0


def test_one_slow_wide_draft_step_does_not_make_a_wider_batch_hopeless():
    """A draft step over two rows measured once at 23 ms (a cold shape) beside 6 ms for one:
    extrapolated, four rows would cost 56 ms and drafting looked hopeless there (the sliding
    pair's batch never drafted). A step is never costed above the rows' single steps."""
    c = BatchController(8, draft_model=True)
    c.calibrate(0.05, 0.006)
    c.update(1, BatchTiming(2, 1, 0.006, 0.05), [(1, 1, 1)])
    c.update(2, BatchTiming(8, 3, 0.069, 0.06), [(3, 3, 3), (3, 3, 3)])
    c.update(4, BatchTiming(4, 0, 0.0, 0.065), [], timed=True)
    assert c.draft_seconds(4) == pytest.approx(4 * 0.006)
    assert not c.hopeless(4, c.draft_seconds(4))


@pytest.mark.parametrize("draft_step", [0.1, 0.005])
def test_rows_join_without_the_draft_when_it_cannot_pay(pair, draft_step):
    """Once a draft step is measured as dear as a target pass (it could not pay even always
    accepted), a joining row is not prefilled through the draft and decodes plainly; its
    tokens are the target's. A cheap draft is prefilled (to the batch's lag) as before."""
    decoder = make_batch_decoder(pair, "auto")
    decoder.controller.calibrate(0.1, draft_step)
    prompt = pair.tokenizer.encode(TEXTS[2])
    rid = decoder.add(prompt, GenerationConfig(max_tokens=16))
    drafts = draft_step < 0.1
    assert decoder.row(rid).use_draft is drafts
    assert decoder.draft_cache[0].size() == (len(prompt) - 2 if drafts else 0)
    out, _ = run_rows(decoder, {rid: None})
    assert out[rid][0] == reference(pair, TEXTS[2], 16)


@pytest.mark.parametrize("dear", [True, False])
def test_the_first_row_times_the_draft_before_prefilling_it(pair, monkeypatch, dear):
    """The first row calibrates the controller with a draft step timed before the draft's
    prefill: measured as dear as a target step (the clock's figures replaced by given ones),
    the row is never prefilled through the draft and decodes plainly, the target's tokens;
    measured cheap, it is prefilled to the batch's lag, as before."""
    decoder = make_batch_decoder(pair, "auto")
    pin_costs(decoder, monkeypatch, 0.1 if dear else 0.005)
    prompt = pair.tokenizer.encode(TEXTS[4])
    rid = decoder.add(prompt, GenerationConfig(max_tokens=16))
    assert decoder.row(rid).use_draft is not dear
    assert decoder.draft_cache[0].size() == (0 if dear else len(prompt) - 2)
    out, _ = run_rows(decoder, {rid: None})
    assert out[rid][0] == reference(pair, TEXTS[4], 16)


def test_a_long_catch_up_is_a_pass_of_its_own(pair, monkeypatch):
    """After plain rounds the draft takes in what it missed in one pass before the round's
    timed draft steps (whose first step then feeds 2 tokens a row, as after any round)."""
    decoder = make_batch_decoder(pair, "auto")
    pin_costs(decoder, monkeypatch)
    ks = iter([0] * 8 + [3])
    monkeypatch.setattr(decoder, "_choose_k", lambda: next(ks))
    rid = decoder.add(pair.tokenizer.encode(TEXTS[4]), GenerationConfig(max_tokens=30))
    for _ in range(8):
        decoder.step()
    widths, draft = [], decoder.draft_pass  # the draft model, recording what each pass feeds

    def recording(y, cache):
        widths.append(y.shape[1])
        return draft(y, cache=cache)

    monkeypatch.setattr(decoder, "draft_pass", recording)
    u = decoder.step()[rid]
    assert widths == [8, 2, 1, 1] and decoder.timing.draft_steps == 3
    assert u.round.drafted == 3 and decoder.lag == 2


def test_the_controller_learns_costs_per_row_count():
    """Fed the costs of a pass per row count (given numbers, no clock: 1 + 0.1 x rows) and
    rows whose drafts are accepted with probability 0.75 each (seeded), the controller
    settles on a long draft at B = 1, a short one at B = 16 and none at B = 256, as
    choose_batch_k does for the true costs (4-5, 1, 0)."""
    rng = np.random.default_rng(0)

    def settle(batch: int) -> int:
        c, chosen = BatchController(8, draft_model=True), []
        for _ in range(80):
            k = c.next(batch)
            chosen.append(k)
            rows = batch * (k + 1)
            timing = BatchTiming(rows, k, 0.02 * k, 1 + 0.1 * rows)
            if k:
                runs = (rng.random((batch, k)) < 0.75).cumprod(axis=1).sum(axis=1)
                c.update(batch, timing, [(k, k, int(a)) for a in runs])
            else:
                c.update_plain(batch, timing)
        return max(set(chosen[40:]), key=chosen[40:].count)  # its usual choice, once settled

    small, mid, large = settle(1), settle(16), settle(256)
    assert small >= 3 and 1 <= mid < small and large == 0, (small, mid, large)


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_short_row_alone_hands_back_its_caches(pair, max_tokens):
    """A 2-token prompt alone in a batch with a draft model, finished after one or two tokens:
    the draft was never fed (it lags by two), so the row keeps its target cache only. Once this
    raised TypeError from mlx-lm's BatchKVCache.extract (keys None): the server's fuzzer found
    it as a 500 for {"prompt": "Hi", "max_tokens": 1}."""
    decoder = make_batch_decoder(pair, 3)
    ids = pair.tokenizer.encode(TEXTS[2])[:2]
    rid = decoder.add(ids, GenerationConfig(max_tokens=max_tokens), keep=True)
    out, states = run_rows(decoder, {rid: None})
    assert out[rid][0] == reference(pair, ids, max_tokens)
    state = states[rid]
    assert state.sequence == ids + out[rid][0]
    assert_holds(pair.target, state.cache, state.sequence[:-1])
    if state.draft_cache is not None:
        assert_holds(pair.draft, state.draft_cache, state.draft_tokens)


class FailsOnCall:
    """A logits processor whose state breaks on its n-th call (as a grammar matcher that
    cannot follow the sequence raises GrammarStateError)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, context, proposed, logits):
        self.calls += 1
        if self.calls == self.n:
            raise GrammarStateError("the grammar cannot take the emitted token 7")
        return logits


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_row_whose_grammar_fails_fails_alone(pair, drafter):
    if drafter == "ngram":
        pair = load_pair(target=str(pair.config.target), drafter="ngram")
    decoder = make_batch_decoder(pair, 3)
    ok_config = GenerationConfig(max_tokens=20, num_draft_tokens=3)
    ok = decoder.add(prompt_tokens(pair, TEXTS[0], ok_config)[0], ok_config, keep=True)
    bad_config = GenerationConfig(max_tokens=20, num_draft_tokens=3, processors=[FailsOnCall(3)])
    bad = decoder.add(prompt_tokens(pair, TEXTS[1], bad_config)[0], bad_config, keep=True)
    tokens, ended = [], {}
    while len(decoder):
        for rid, u in decoder.step().items():
            if rid == ok:
                tokens += u.tokens
            if u.done:
                ended[rid] = u
    assert ended[bad].finish_reason == "error" and ended[bad].tokens == []
    assert isinstance(ended[bad].error, GrammarStateError) and ended[bad].state is None
    assert tokens == generate(pair, TEXTS[0], ok_config).tokens  # the other row goes on
    assert ended[ok].finish_reason == "length" and ended[ok].state is not None
