"""Recurrent targets in a batch: every row's output is what the target gives it alone.

Targets: a tiny hybrid Qwen3.5 (Gated DeltaNet layers beside attention layers) and a tiny Mamba
(recurrent layers only), drafted by prompt lookup, a draft model (the tiny Llama draft, an
unrelated attention model), both, or nothing. These drafts are mostly wrong, so rows reject
different amounts: a row that rejects has its recurrent state restored (its row only), its
attention layers roll back its whole pass and its kept tokens are replayed in the next pass,
whose rows are all one width with no padding (fillers).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import test_batch
import tiny
from mlx_lm.models.cache import ArraysCache
from test_batch import (
    TEXTS,
    assert_holds,
    assert_mixed_rows_as_alone,
    assert_seeded_rows_sample_as_alone,
    run_mixed,
    sampled_first_two,
)
from test_distribution import accept_everything, chi_square, exact_joint

import mlx_spec
import mlx_spec.decode.rounds
from mlx_spec import GenerationConfig, SpecError, generate, load_pair
from mlx_spec.core import caches
from mlx_spec.core.batch_caches import check_batchable
from mlx_spec.decode.batch_rows import into_decoder
from mlx_spec.decode.generate import make_batch_decoder
from mlx_spec.server.resident import Resident

FAMILIES = ["qwen3_5", "mamba"]
REPEATS = [  # repetitive prompts: lookup finds something to draft
    "a b c a b c a b c a b",
    "The quick brown fox. The quick brown fox. The quick",
    "x",
    "1 2 3 4 1 2 3 4 1 2",
]


@pytest.fixture(scope="module")
def targets(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_recurrent")
    cfg = tiny.family_configs(320)["qwen3_5"]
    weights = tiny.family_weights(cfg, seed=0)
    hybrid = tiny.write_model(root / "qwen3_5", cfg, weights, tiny_models.tokenizer)
    small = tiny.family_configs(16)["qwen3_5"]  # 16 tokens: distributions to enumerate
    weights = tiny.family_weights(small, seed=3)
    small_dir = tiny.write_model(root / "qwen3_5-16", small, weights, tiny_models.tokenizer)
    return {"qwen3_5": hybrid, "mamba": tiny_models.mamba, "small": small_dir}


def lookup_pair(targets, family):
    return load_pair(target=str(targets[family])).configured(drafter="ngram")


def pair_of(tiny_models, targets, family, drafter):
    if drafter == "ngram":
        return lookup_pair(targets, family)
    draft = tiny_models.small_draft if family == "small" else tiny_models.draft
    pair = load_pair(target=str(targets[family]), draft=str(draft))
    return pair if drafter == "model" else pair.configured(drafter=drafter)


def alone(pair, prompt, max_tokens):
    return generate(pair, prompt, max_tokens=max_tokens, use_draft=False).tokens


@pytest.mark.parametrize("drafter", ["ngram", "model", "ngram+model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rows_joining_and_leaving_equal_each_alone(tiny_models, targets, family, drafter):
    pair = pair_of(tiny_models, targets, family, drafter)
    decoder = make_batch_decoder(pair, 3)
    prompts = [pair.tokenizer.encode(t) for t in REPEATS + TEXTS[:2]]
    budgets = [30, 12, 25, 8, 20, 16]
    joins = {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]}  # round -> prompts joining then
    rows, out, rounds = {}, {}, []
    rnd = 0
    while rnd in joins or rnd < max(joins) or len(decoder):
        for i in joins.get(rnd, []):
            rid = decoder.add(prompts[i], GenerationConfig(max_tokens=budgets[i]))
            rows[rid], out[rid] = i, []
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
            rounds.append(u.round)
        rnd += 1
    for rid, i in rows.items():
        assert out[rid] == alone(pair, prompts[i], budgets[i]), (family, i)
    assert any(r.replayed for r in rounds)  # some row replayed rejected rounds
    assert any(r.filled for r in rounds)  # some row's pass was filled to the batch's width
    if drafter != "model":  # (the unrelated draft is never right)
        assert any(min(r.accepted, r.drafted - r.filled) for r in rounds)  # guesses taken


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_generate_equals_generate_per_prompt(tiny_models, targets, family):
    pair = pair_of(tiny_models, targets, family, "ngram+model")
    res = mlx_spec.batch_generate(pair, REPEATS, max_tokens=24, num_draft_tokens=3, max_batch=3)
    for text, r in zip(REPEATS, res, strict=True):
        assert r.tokens == alone(pair, text, 24)
    plain = load_pair(target=str(targets[family]))  # no drafter: continuous batching
    res = mlx_spec.batch_generate(plain, TEXTS[:3], max_tokens=10)
    assert [r.tokens for r in res] == [alone(plain, t, 10) for t in TEXTS[:3]]


def test_a_long_replay_ends_with_a_pass_that_cannot_be_rejected(targets, monkeypatch):
    """Past the replay limit a row drafts nothing (its pass is its replay, and fillers when a
    neighbour's pass is wider): it is still the target's output."""
    monkeypatch.setattr(mlx_spec.decode.batch_draft, "REPLAY_LIMIT", 2)
    pair = lookup_pair(targets, "qwen3_5")
    decoder = make_batch_decoder(pair, 4)
    prompts = [pair.tokenizer.encode(t) for t in REPEATS]
    rows = {decoder.add(p, GenerationConfig(max_tokens=30)): p for p in prompts}
    out = {r: [] for r in rows}
    widest = 0
    while len(decoder):
        widest = max([widest] + [r.unfed for r in decoder.rows])
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
    assert widest > 3
    for rid, p in rows.items():
        assert out[rid] == alone(pair, p, 30)


@pytest.mark.parametrize("drafter", ["ngram", "ngram+model"])
def test_kept_rows_hand_back_caches_a_single_stream_continues(tiny_models, targets, drafter):
    """A row removed mid-way (its replay pending) and one that ran to its end come back as
    Decoders (`into_decoder`, the replay in `unfed`; a draft model's cache holding exactly its
    tokens) that continue as a fresh generate does; a kept recurrent Decoder whose state the
    new row's prompt does not extend (it generated past it) gives it nothing (`give_up`): the
    row starts afresh (tests/test_batch_recurrent_heads.py: one it extends)."""
    pair = pair_of(tiny_models, targets, "qwen3_5", drafter)
    decoder = make_batch_decoder(pair, 3)
    prompts = [pair.tokenizer.encode(t) for t in REPEATS[:3]]
    budgets = [40, 6, 40]
    ids = [
        decoder.add(p, GenerationConfig(max_tokens=m), keep=True)
        for p, m in zip(prompts, budgets, strict=True)
    ]
    states, removed = {}, None
    for _ in range(40):
        for rid, u in decoder.step().items():
            if u.done:
                states[rid] = u.state
        if removed is None and decoder.rows[0].unfed > 1:
            removed = decoder.rows[0].id
            states[removed] = decoder.remove(removed)
        if len(states) == 3:
            break
    assert removed is not None and states[removed].unfed > 1
    more = pair.tokenizer.encode(" and then", add_special_tokens=False)
    drafted = []
    for rid in ids:
        state = states[rid]
        if state.draft_cache is not None:  # (a one-token prompt's draft row is not its text)
            assert_holds(pair.draft, state.draft_cache, state.draft_tokens)
            drafted.append(rid)
        d = into_decoder(mlx_spec.make_decoder(pair), state)
        assert d.unfed == state.unfed
        config = GenerationConfig(max_tokens=10, num_draft_tokens=3)
        follow = state.sequence + more
        res, fresh = generate(pair, follow, config, decoder=d), generate(pair, follow, config)
        assert res.tokens == fresh.tokens
        # a kept recurrent decoder: the next row starts afresh from its prompt
        row = decoder.add(follow, GenerationConfig(max_tokens=4), kept=d)
        assert decoder.row(row).reused == 0
        decoder.remove(row)
    assert len(drafted) == (2 if pair.draft is not None else 0)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_a_sampled_row_beside_replaying_rows_follows_the_target(
    tiny_models, targets, monkeypatch, drafter
):
    """A sampled row beside rows that replay (their passes wider than its own, so its pass
    carries fillers) draws from the target's distribution: chi-square over its first two
    tokens, rows joining and leaving around it; a draft model's rows verified with its q. (A
    seeded row keeps none of its fillers: it draws what it draws alone, a test below.)"""
    pair = pair_of(tiny_models, targets, "small", drafter)

    def no_end(pair, k):  # token 2 (the end) is likely in 16 tokens: rows run to max_tokens
        decoder = make_batch_decoder(pair, k)
        decoder.eos = set()
        return decoder

    monkeypatch.setattr(test_batch, "make_batch_decoder", no_end)
    replays = []
    step = mlx_spec.decode.batch.BatchDecoder.step

    def counted(self):
        updates = step(self)
        replays.extend(u.round.replayed for u in updates.values())
        return updates

    monkeypatch.setattr(mlx_spec.decode.batch.BatchDecoder, "step", counted)
    params = GenerationConfig(temperature=1.0, top_p=0.9).sampling
    probs = exact_joint(pair, params)
    stat, threshold = chi_square(sampled_first_two(pair, params, 1200), probs)
    print(f"recurrent batch: chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold
    assert any(replays)  # rows beside it replayed (their passes wider than its own)
    # the harness can fail: drafts kept whatever the target says, plain steps greedy
    monkeypatch.setattr(mlx_spec.decode.rounds, "verify_stochastic", accept_everything)
    monkeypatch.setattr(mlx_spec.decode.batch_draft, "sample", lambda p, key: mx.argmax(p, axis=-1))
    stat, threshold = chi_square(sampled_first_two(pair, params, 600), probs)
    assert stat > threshold


def test_rows_restore_their_own_state_only():
    """restore_rows: the chosen rows take the snapshot's state, the others keep theirs; a
    state the snapshot did not hold yet (None) is zeros."""
    from mlx_lm.models.cache import ArraysCache

    c = ArraysCache(2)
    c.cache = [mx.ones((3, 2)), None]
    saved = caches.snapshot([c])
    c.cache = [mx.full((3, 2), 5.0), mx.full((3, 4), 7.0)]
    caches.restore_rows([c], saved, [True, False, True])
    assert np.array(c.cache[0]).tolist() == [[1, 1], [5, 5], [1, 1]]
    assert np.array(c.cache[1])[:, 0].tolist() == [0, 7, 0]


def test_what_stays_refused(tiny_models, targets):
    check_batchable(load_pair(target=str(targets["qwen3_5"])).target, recurrent=True)
    check_batchable(load_pair(target=str(tiny_models.mamba)).target, "draft", recurrent=True)
    with pytest.raises(SpecError, match="recurrent state"):
        check_batchable(load_pair(target=str(tiny_models.mamba)).target)  # (not asked to)


# ------------------------------------------------------------- a recurrent draft model


@pytest.fixture(scope="module")
def recurrent_drafts(tiny_models, targets, tmp_path_factory):
    """Pairs whose draft model keeps a recurrent state: the hybrid target drafted by a noisy
    copy of itself (agrees often, not always: rows keep different numbers of guesses), and
    the tiny Llama drafted by that hybrid or by the Mamba (unrelated: greedy guesses rejected,
    sampled ones kept now and then)."""
    cfg = tiny.family_configs(320)["qwen3_5"]
    noisy = tiny.noisy(tiny.family_weights(cfg, seed=0), 0.03)
    root = tmp_path_factory.mktemp("recurrent_draft")
    draft = tiny.write_model(root / "qwen3_5-noisy", cfg, noisy, tiny_models.tokenizer)
    return {
        "hybrid": load_pair(target=str(targets["qwen3_5"]), draft=str(draft)),
        "llama": load_pair(target=str(tiny_models.target), draft=str(draft)),
        "mamba": load_pair(target=str(tiny_models.target), draft=str(tiny_models.mamba)),
    }


def assert_state_holds(model, cache: list, tokens: list[int]) -> None:
    """Every layer, recurrent states included, is what a fresh prefill of `tokens` makes."""
    fresh = caches.make_cache(model, "draft")
    caches.prefill_cache(model, fresh, tokens)
    mx.eval([c.state for c in fresh])
    for c, f in zip(cache, fresh, strict=True):
        if isinstance(f, ArraysCache):
            for a, b in zip(c.cache, f.cache, strict=True):
                assert np.allclose(np.array(a), np.array(b), atol=1e-4)
        else:
            n = len(tokens)
            assert c.offset == n
            assert np.allclose(
                np.array(c.keys[..., :n, :]), np.array(f.keys[..., :n, :]), atol=1e-4
            )


@pytest.mark.parametrize("which", ["hybrid", "mamba"])
def test_a_recurrent_draft_drafts_in_the_batch(recurrent_drafts, which):
    """A recurrent draft model drafts for every row in one batched pass a step: each row's
    state goes back to the one its draft steps left after what it kept (a row that kept no
    guess: the state before the tail's last token, fed apart). Greedy rows joining and leaving
    equal the target alone; a row handed back holds exactly its draft tokens, recurrent state
    included (it would propose other tokens otherwise, and the next turn with it)."""
    pair = recurrent_drafts[which]
    decoder = make_batch_decoder(pair, 3)
    assert decoder.draft_recurrent and decoder.drafting
    prompts = [pair.tokenizer.encode(t) for t in REPEATS + TEXTS[:2]]
    budgets = [30, 12, 25, 8, 20, 16]
    joins = {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]}
    rows, out, kept, states = {}, {}, [], {}
    rnd = 0
    while rnd in joins or rnd < max(joins) or len(decoder):
        for i in joins.get(rnd, []):
            rid = decoder.add(prompts[i], GenerationConfig(max_tokens=budgets[i]), keep=True)
            rows[rid], out[rid] = i, []
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
            kept.append(min(u.round.accepted, u.round.drafted - u.round.filled))
            if u.done:
                states[rid] = u.state
        rnd += 1
    for rid, i in rows.items():
        assert out[rid] == alone(pair, prompts[i], budgets[i]), (which, i)
    if which == "hybrid":
        assert len(set(kept)) > 2  # rows kept different numbers of guesses
    checked = 0
    for state in states.values():
        if state.draft_cache is not None:
            assert_state_holds(pair.draft, state.draft_cache, state.draft_tokens)
            checked += 1
    assert checked >= 4


def test_a_recurrent_draft_proposes_in_a_batch_what_it_proposes_alone(recurrent_drafts):
    """On a Llama target (its rounds are a single stream's, no replays) every row's rounds
    (proposals and what was kept) are `generate`'s with the same hybrid draft, two rows at a
    time and the others joining as rows finish: its state is exact whatever the rows beside
    it kept. (A one-token prompt is left out: a batch's draft sees its token twice, see
    BatchDecoder.add, so its guesses, not its tokens, may differ.)"""
    pair = recurrent_drafts["llama"]
    prompts = TEXTS + REPEATS[:2]
    results = mlx_spec.batch_generate(pair, prompts, max_tokens=24, num_draft_tokens=3, max_batch=2)
    drafted = 0
    for prompt, res in zip(prompts, results, strict=True):
        alone_res = generate(pair, prompt, max_tokens=24, num_draft_tokens=3)
        assert res.tokens == alone_res.tokens
        assert test_batch.records(res.rounds) == test_batch.records(alone_res.rounds)
        drafted += res.stats.drafted
    assert drafted > 0


@pytest.mark.parametrize("which", ["hybrid", "llama"])
def test_a_seeded_row_with_a_recurrent_draft_samples_as_alone(recurrent_drafts, which):
    """Sampled guesses are kept now and then (p/q), so rows keep different numbers of them;
    a seeded row's q is the draft's alone only if its state is: it draws the very tokens
    `generate` draws with that seed."""
    assert_seeded_rows_sample_as_alone(recurrent_drafts[which])


def test_a_recurrent_draft_models_pair_batches_with_drafts_in_the_server(recurrent_drafts):
    """The curated Qwen3.5 pairs (a Qwen3.5-0.8B draft for a Qwen3.5 target) batch with their
    draft in the server; a lone request still runs as a single stream (a recurrent target's
    kept checkpoints, above)."""
    resident = Resident(lambda name: None, [], max_batch=4)
    resident.install(recurrent_drafts["hybrid"], "qwen35")
    assert resident.batch is not None and not resident.batch_plain
    assert resident.batch.drafting and resident.batch.draft_recurrent
    assert resident.lone_alone


@pytest.mark.parametrize("drafter", ["ngram", "ngram+model"])
def test_a_mixed_batch_of_recurrent_rows_gives_each_what_it_gets_alone(
    tiny_models, targets, drafter
):
    """A schema, a regex (forced tokens drafted, fillers after them masked by the grammar),
    penalties and a logit bias, log-probabilities, a plain row and a seeded sampled one, in
    one batch on the hybrid: each greedy row's tokens (and log-probabilities) are what it gets
    alone; the sampled row runs to its end beside them."""
    pair = pair_of(tiny_models, targets, "qwen3_5", drafter)
    rows, got, rounds = run_mixed(pair, REPEATS)
    rounds = [r for _, r in rounds]
    assert any(r.replayed for r in rounds) and any(r.filled for r in rounds)
    assert any(r.forced for r in rounds)
    sampled = next(rid for rid, (name, _, _) in rows.items() if name == "sampled")
    assert got[sampled][0]  # it runs to its end (its samples are its own beside others)
    assert_mixed_rows_as_alone(pair, rows, got, skip=("sampled",))


@pytest.mark.parametrize("drafter", ["ngram", "ngram+model"])
def test_fillers_the_target_accepts(tiny_models, targets, drafter, monkeypatch):
    """Fillers that are the target's own next tokens (an oracle, patched in past the draft's
    own picks) are kept: a row keeps more than it proposed and its state stays; beside a draft
    model a row keeps at most what the draft was fed (its draft cache rolls back per row), the
    rest replayed. Every row is still the target's, and a row handed back holds exactly its
    tokens (its draft cache too)."""
    pair = pair_of(tiny_models, targets, "qwen3_5", drafter)
    prompts = [pair.tokenizer.encode(t) for t in REPEATS + TEXTS[:1]]
    budgets = [30, 12, 25, 8, 20]
    full = {
        tuple(p): p + alone(pair, p, m) + [0] * 40 for p, m in zip(prompts, budgets, strict=True)
    }
    fill = mlx_spec.decode.batch_rows.fill

    def oracle(rows, guesses, spare=None):
        out = []
        for b, (r, g, x) in enumerate(zip(rows, guesses, fill(rows, guesses, spare), strict=True)):
            ours = len(g) + (len(spare[b]) if spare is not None else 0)  # what the draft was fed
            start = len(r.sequence) + ours
            right = full[tuple(r.sequence[: r.prompt_tokens])][start : start + len(x) - ours]
            out.append(x[:ours] + right)
        return out

    monkeypatch.setattr(mlx_spec.decode.batch_draft, "fill", oracle)
    decoder = make_batch_decoder(pair, 3)
    rows = {
        decoder.add(p, GenerationConfig(max_tokens=m), keep=True): p
        for p, m in zip(prompts, budgets, strict=True)
    }
    out, rounds, states = {r: [] for r in rows}, [], {}
    while len(decoder):
        for rid, u in decoder.step().items():
            out[rid] += u.tokens
            rounds.append((u.round, u.done))
            if u.done:
                states[rid] = u.state
    for rid, p in rows.items():
        m = budgets[prompts.index(p)]
        assert out[rid] == alone(pair, p, m)
        state = states[rid]
        if state.draft_cache is not None:
            assert_holds(pair.draft, state.draft_cache, state.draft_tokens)
    assert any(r.filled and r.accepted > r.drafted - r.filled for r, _ in rounds)
    cut = [r for r, done in rounds if not done and len(r.tokens) < r.accepted + 1]
    assert bool(cut) == (drafter != "ngram")  # only a draft model's rows are cut short


@pytest.mark.parametrize("drafter", ["ngram", "model", "ngram+model"])
def test_a_seeded_row_samples_what_it_samples_alone(tiny_models, targets, drafter):
    """A seeded sampled row beside greedy and sampled rows that join before and after it (so
    its passes carry fillers and it replays): it never keeps a filler and judges its replay
    limit by what it would replay alone, so its key splits as alone's and it draws the very
    tokens `generate` draws with the same seed and k."""
    assert_seeded_rows_sample_as_alone(pair_of(tiny_models, targets, "qwen3_5", drafter))
