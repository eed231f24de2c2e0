"""Suffix decoding (drafters/suffix.py): lossless like any drafter, drafts past K_MAX where the
match supports it, hands over to the pair's drafter where it does not, memory bounded under
hostile input, and each key's history its own (through a real server process)."""

from __future__ import annotations

import json
import time

import numpy as np
import openai
import pytest
from test_distribution import PROMPT, chi_square, exact_joint, first_two
from test_eagle import heads, target_cfg  # noqa: F401  (fixtures)
from test_greedy_equality import reference
from test_server import serving

from mlx_spec import GenerationConfig, SamplingParams, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.core.lookup_length import LookupCosts
from mlx_spec.core.policies import K_MAX, Auto
from mlx_spec.decode.engine import Decoder
from mlx_spec.drafters.suffix import (
    CONTEXT_TOKENS,
    DRAFT_MAX,
    MATCH_MAX,
    POSITIONS,
    REQUEST_LENGTHS,
    SuffixDrafter,
    SuffixHistory,
    SuffixIndex,
)

REPEATING = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("


@pytest.fixture(scope="module")
def suffix_pair(tiny_models):
    return load_pair(target=str(tiny_models.target)).configured(drafter="suffix")


@pytest.fixture(scope="module")
def hybrid_pair(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    return pair.configured(drafter="suffix+model")


# ------------------------------------------------------------------------------ the index


def test_longest_match_and_most_frequent_continuation():
    idx = SuffixIndex(1000)
    # "1 2 3" continues with 4 twice and with 9 once; "7 1 2 3" once, with 9
    idx.extend([1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 7, 1, 2, 3, 9, 0])
    n, found = idx.match([8, 1, 2, 3])
    assert n == 3 and len(found) == 3
    assert idx.continuation(found, 2) == [4, 6]  # two votes for 4, then a tie: the latest
    n, found = idx.match([7, 1, 2, 3])  # the longer match wins
    assert n == 4 and idx.continuation(found, 3) == [9, 0]


def test_a_request_drafts_past_k_max_what_it_saw():
    d = SuffixDrafter()
    text = list(range(100, 160))
    d.prefill(text + [7] + text[:20])
    match, reach = d.suffix_match()
    assert match >= 16 and reach > K_MAX
    assert d.lookup(61) == text[20:] + [7] + text[:20]  # up to the request's end
    d.commit(text[20:30])
    assert d.lookup(5) == text[30:35]


def test_the_history_drafts_when_it_matches_longer():
    history = SuffixHistory(1000)
    history.add([5, 6, 7, 8, 9, 10, 11, 12])
    d = SuffixDrafter(history=history)
    d.prefill([1, 6, 7, 8])
    assert d.suffix_match()[0] == 3 and d.lookup(4) == [9, 10, 11, 12]
    d.use_history(None)
    d.commit([40])
    assert d.suffix_match() == (0, 0)


def test_memory_is_bounded_under_hostile_input():
    """One token repeated 100k times: one entry per n-gram length, at most POSITIONS each;
    a huge prompt: at most max_tokens held. Sizes, not times."""
    d = SuffixDrafter(context_tokens=20_000)
    d.prefill([7] * 100_000)
    assert len(d.context) <= 20_000
    assert len(d.context.index) == len(d.context.lengths)
    assert d.context.entries() <= POSITIONS * len(d.context.lengths)
    assert d.lookup(DRAFT_MAX) == [7] * DRAFT_MAX
    rng = np.random.default_rng(0)
    history = SuffixHistory(30_000)
    for _ in range(4):
        history.add(rng.integers(0, 50_000, 100_000).tolist())
    assert len(history) <= 30_000
    assert history.entries() <= len(history) * len(history.lengths)
    d = SuffixDrafter(history=history, context_tokens=20_000)
    d.prefill(rng.integers(0, 50_000, 300_000).tolist())
    assert len(d.context) <= 20_000
    assert d.context.entries() <= 20_000 * len(d.context.lengths)


class CountingTokens(list):
    """A token list that counts the tokens read from it (a slice: its length)."""

    reads = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got


# the most tokens one look-up may read: each n-gram length's occurrences measured back, the
# continuation's vote over them, the sequence's recent tokens
LOOKUP_READS = (
    len(REQUEST_LENGTHS) * POSITIONS * (max(REQUEST_LENGTHS) + MATCH_MAX)
    + POSITIONS * DRAFT_MAX
    + MATCH_MAX
)


def lookups(drafter, indexes, stream) -> tuple[int, float]:
    """(the most tokens one look-up read from `indexes`, the seconds of them all), a look-up
    after each token of `stream` is committed (which drops the cached draft)."""
    for index in indexes:
        index.tokens = CountingTokens(index.tokens)
    most, seconds = 0, 0.0
    for token in stream:
        drafter.commit([token])
        before = sum(index.tokens.reads for index in indexes)
        start = time.perf_counter()
        assert drafter.lookup(DRAFT_MAX)
        seconds += time.perf_counter() - start
        most = max(most, sum(index.tokens.reads for index in indexes) - before)
    return most, seconds


def test_lookups_stay_bounded_under_hostile_input():
    """A look-up reads a bounded number of tokens whatever the index holds: the same over a
    token repeated 1,000 or 100,000 times, in the request or in the key's history, and over a
    huge random prompt; 200 of them take well under a second (~0.35 ms each here)."""
    reads = {}
    for size in (1_000, 100_000):
        d = SuffixDrafter(context_tokens=200_000)
        d.prefill([7] * size)
        assert d.lookup(DRAFT_MAX) == [7] * DRAFT_MAX
        reads[size], seconds = lookups(d, [d.context], [7] * 200)
        assert reads[size] <= LOOKUP_READS and seconds < 5.0, (size, reads[size], seconds)
    assert reads[100_000] == reads[1_000]  # not a token more for a longer repetition
    rng = np.random.default_rng(0)
    history = SuffixHistory(200_000)
    history.add([7] * 100_000)
    d = SuffixDrafter(history=history)
    d.prefill(rng.integers(100, 50_000, 1_000).tolist() + [7])  # (7, 7): the history's
    most, seconds = lookups(d, [d.context, history], [7] * 200)
    assert most <= LOOKUP_READS and seconds < 5.0, (most, seconds)
    d = SuffixDrafter()  # the request's bound: 131,072 tokens
    huge = rng.integers(0, 50_000, 300_000).tolist()
    d.prefill(huge)
    assert len(d.context) <= CONTEXT_TOKENS
    most, seconds = lookups(d, [d.context], huge[-20_000:-19_800])  # matches a stretch
    assert most <= LOOKUP_READS and seconds < 5.0, (most, seconds)


@pytest.mark.parametrize("bound", [CONTEXT_TOKENS, 64])
@pytest.mark.parametrize("k", [3, "auto"])
def test_one_token_repeated_equals_target_alone(suffix_pair, k, bound):
    """A request of one token repeated (400: the tiny target's context is 512) drafts the
    repetition, at most DRAFT_MAX a round, and the reply is the target's; so with the
    request's index bounded at 64 tokens, dropped and indexed again mid-reply."""
    from mlx_spec.decode.generate import make_decoder

    prompt = [7] * 400
    decoder = make_decoder(suffix_pair)
    decoder.drafter.context = SuffixIndex(bound)
    res = generate(suffix_pair, prompt, max_tokens=60, num_draft_tokens=k, decoder=decoder)
    assert res.tokens == reference(suffix_pair, prompt, 60)
    assert res.stats.drafted > 0 and len(res.stats.draft_lengths) - 1 <= DRAFT_MAX
    assert len(decoder.drafter.context) <= bound
    if bound == 64:
        assert decoder.drafter.context.dropped >= 400


def test_the_cost_model_chooses_long_drafts_only_for_long_matches():
    costs = LookupCosts()
    assert costs.choose(16, 64, 0.05, None) > K_MAX  # a verified row costs 7 % of a step
    assert costs.choose(1, 4, 0.05, None) <= 4
    # a rival that makes 3 tokens a step beats a 1-token match's guesses
    assert costs.choose(1, 4, 0.05, 3 / 0.05) == 0
    for _ in range(30):  # long matches that are always rejected at once
        costs.update(16, 32, 0, 0.05 + 0.0035 * 32)
    assert costs.choose(16, 64, 0.05, None) <= 2


# --------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("k", [2, 5, "auto"])
@pytest.mark.parametrize("prompt", [REPEATING, "The quick brown fox"])
def test_greedy_suffix_equals_target_alone(suffix_pair, prompt, k):
    expected = reference(suffix_pair, prompt, 60)
    res = generate(suffix_pair, prompt, max_tokens=60, num_draft_tokens=k)
    assert res.tokens == expected


@pytest.mark.parametrize("k", [2, "auto"])
@pytest.mark.parametrize("prompt", [REPEATING, "The quick brown fox"])
def test_greedy_suffix_model_equals_target_alone(hybrid_pair, prompt, k):
    expected = reference(hybrid_pair, prompt, 60)
    res = generate(hybrid_pair, prompt, max_tokens=60, num_draft_tokens=k)
    assert res.tokens == expected
    assert res.stats.drafted > 0


def test_long_lookup_rounds_equal_target_alone(suffix_pair):
    """A prompt that holds the reply the target will give: lookup rounds past K_MAX."""
    expected = reference(suffix_pair, REPEATING, 80)
    prompt = suffix_pair.tokenizer.encode(REPEATING) + expected + [0] * 3
    prompt += suffix_pair.tokenizer.encode(REPEATING)
    again = reference(suffix_pair, prompt, 80)
    res = generate(suffix_pair, prompt, max_tokens=80, num_draft_tokens="auto")
    assert res.tokens == again
    assert len(res.stats.draft_lengths) - 1 > K_MAX  # some round drafted more than K_MAX


# PROMPT, 15 (the small target's likeliest token) and 4, PROMPT again: a lookup the target
# mostly accepts (PROMPT * 3 looks up 5 next, which it nearly always rejects)
LIKELY = [5, 9, 3, 12, 7, 15, 4, 5, 9, 3, 12, 7]


@pytest.mark.parametrize(
    "k, prompt, runs",
    [("auto", PROMPT * 3, 1500), (2, LIKELY, 1000)],
    ids=["auto-rejected", "2-accepted"],
)
def test_suffix_distribution_is_the_target(tiny_models, k, prompt, runs):
    """Every run's first round is a lookup (the prompt repeats itself): with a fixed k, two
    guesses (each run's policy fresh, no timing in its choice); `auto`, one policy over all
    the runs, learns from this machine's timings whether lookups pay, so how many it drafts
    after its first runs varies (on a loaded machine, down to a few)."""
    pair = load_pair(target=str(tiny_models.small_target))
    params = SamplingParams(temperature=1.0)
    probs = exact_joint(pair, params, prompt)
    drafted = []
    policy = Auto().policy() if k == "auto" else k
    counts = first_two(pair, params, runs, policy, SuffixDrafter(), prompt, drafted)
    stat, threshold = chi_square(counts, probs)
    print(f"suffix: chi-square {stat:.1f} (threshold {threshold:.1f}), drafted {sum(drafted)}")
    assert sum(drafted) >= (2 * runs if k == 2 else 1)
    assert stat < threshold


def test_suffix_model_distribution_is_the_target(tiny_models):
    from mlx_spec.drafters.model import ModelDrafter

    pair = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    params = SamplingParams(temperature=1.0)
    prompt = PROMPT * 3
    probs = exact_joint(pair, params, prompt)
    drafter = SuffixDrafter(ModelDrafter(pair.draft))
    counts = first_two(pair, params, 1500, 2, drafter, prompt)
    stat, threshold = chi_square(counts, probs)
    print(f"suffix+model: chi-square {stat:.1f} (threshold {threshold:.1f})")
    assert stat < threshold


@pytest.mark.parametrize(
    "prompt",
    [PROMPT * 3, LIKELY],
    ids=["lookup-rejected", "lookup-accepted"],
)
def test_suffix_eagle3_distribution_is_the_target(tiny_models, tmp_path, prompt):
    """Temperature 1 beside an EAGLE-3 head (test_eagle's small one: 6 of the 16 tokens). The
    first round is always a lookup (a point mass on each guess): one the target nearly always
    rejects (5 after PROMPT), so the head's round (its q) draws the second token, or one it
    mostly accepts (15, its likeliest token, then 4), head rounds where it does not. The
    first two tokens' joint is the target's either way. (A wrong q in the head's rounds —
    uniform — gives a statistic ~8x the threshold on the first prompt, 2026-12-06.)"""
    import tiny
    from test_eagle import DRAFTED, head_weights
    from test_eagle import write_head as write_eagle

    from mlx_spec.drafters.eagle import EagleDrafter

    small = tiny.llama_config(16, layers=2, hidden=32)
    weights = head_weights(small, DRAFTED, 9, False, 0.3)
    head = write_eagle(tmp_path / "head", small, weights, ids=[0, 0, 1])
    pair = load_pair(target=str(tiny_models.small_target), drafter="suffix+eagle3", head=str(head))
    params = SamplingParams(temperature=1.0)
    probs = exact_joint(pair, params, prompt)
    drafter = SuffixDrafter(EagleDrafter(pair.head))
    rounds = {"lookup": 0, "head": 0}
    lookup, propose = drafter.propose_lookup, drafter.propose

    def spy_lookup(k):
        rounds["lookup"] += 1
        return lookup(k)

    def spy_propose(k, *args, **kwargs):
        rounds["head"] += 1
        return propose(k, *args, **kwargs)

    drafter.propose_lookup, drafter.propose = spy_lookup, spy_propose
    runs = 800
    counts = first_two(pair, params, runs, 2, drafter, prompt)
    stat, threshold = chi_square(counts, probs)
    print(f"suffix+eagle3: chi-square {stat:.1f} (threshold {threshold:.1f}), rounds {rounds}")
    assert rounds["lookup"] >= runs and rounds["head"] > runs // 10
    assert stat < threshold


def test_a_decoder_forks_with_its_own_index(suffix_pair):
    decoder = Decoder(suffix_pair.target, SuffixDrafter(), eos_token_ids=())
    decoder.prefill(suffix_pair.tokenizer.encode(REPEATING))
    twin = decoder.fork()
    assert twin.drafter.context is not decoder.drafter.context
    assert twin.drafter.context.tokens == decoder.drafter.context.tokens


def test_cli_drafter_suffix(tiny_models, capsys):
    args = ["generate", "--target", str(tiny_models.target), "--drafter", "suffix", "--raw"]
    assert main([*args, "--max-tokens", "24", "--json", REPEATING]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == reference(
        load_pair(target=str(tiny_models.target)), REPEATING, len(out["tokens"])
    )


# ------------------------------------------------------------------------------- batch


@pytest.mark.parametrize("drafter", ["suffix", "suffix+model"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_batch_rows_equal_each_alone(tiny_models, drafter, k):
    from test_batch import TEXTS, assert_schedule_exact, run_schedule

    from mlx_spec.decode.generate import make_batch_decoder

    draft = str(tiny_models.draft) if drafter == "suffix+model" else None
    pair = load_pair(target=str(tiny_models.target), draft=draft).configured(drafter=drafter)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, k)
    out, reasons = run_schedule(decoder, prompts)
    assert_schedule_exact(pair, prompts, out, reasons)


# ------------------------------------------------------------------------------ server

KEY_A, KEY_B = "suffix-a", "suffix-b"
SECRET = "Berlin is the capital of Germany. Speculative decoding drafts tokens with a small model"


def test_another_keys_text_never_drafts(tiny_models, tmp_path):
    """Key A's reply is in A's suffix history: A drafts it again, B (the same prompt, after
    A) does not."""
    args = ["--target", str(tiny_models.target), "--drafter", "suffix",
            "--api-key", KEY_A, "--api-key", KEY_B]  # fmt: skip
    with serving(args, tmp_path) as (_, url):

        def ask(key, prompt):
            c = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
            r = c.completions.create(model="target", prompt=prompt, max_tokens=60, temperature=0)
            return r.choices[0].text, r.model_extra["speculation"]

        text, first = ask(KEY_A, SECRET)
        ask(KEY_A, "def add(a, b):")  # another conversation in between
        again, spec_a = ask(KEY_A, SECRET)
        other, spec_b = ask(KEY_B, SECRET)
    assert again == other == text
    assert spec_a["history_lookup"] and spec_a["drafter"] == "suffix"
    assert spec_a["accepted"] >= 0.7 * 60 > first["accepted"]
    # B drafts only from its own request, as A did the first time (the lengths the policy
    # picks vary with its timings: not the same count, far from what A's history gives)
    assert spec_b["accepted"] < 0.7 * 60


# ------------------------------------------------------------------- beside an EAGLE-3 head


@pytest.fixture(scope="module")
def suffix_eagle_pair(tiny_models, heads):  # noqa: F811
    return load_pair(
        target=str(tiny_models.target), drafter="suffix+eagle3", head=str(heads["sglang"])
    )


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_suffix_eagle3_equals_target_alone_and_keeps_the_heads_cache(suffix_eagle_pair, request, k):
    """Lookup rounds (past K_MAX: the prompt holds the reply) and head rounds interleaved:
    the target's tokens, and the head's cache what a fresh forward over the sequence gives
    (it took the target's features of the looked-up tokens as of its own)."""
    from types import SimpleNamespace

    from test_eagle import check_sglang_cache

    from mlx_spec.decode.generate import make_decoder

    pair = suffix_eagle_pair
    made, cfg = request.getfixturevalue("heads"), request.getfixturevalue("target_cfg")
    expected = reference(pair, REPEATING, 50)
    prompt = pair.tokenizer.encode(REPEATING) + expected[:30] + [0] * 3
    prompt += pair.tokenizer.encode(REPEATING)
    decoder = make_decoder(pair)
    res = generate(pair, prompt, max_tokens=50, num_draft_tokens=k, decoder=decoder)
    assert res.tokens == reference(pair, prompt, 50)
    if k == 1:
        assert len(res.stats.draft_lengths) - 1 > K_MAX  # a lookup round past K_MAX
        assert res.stats.draft_lengths[1] > 0  # and head rounds
    inner = SimpleNamespace(drafter=decoder.drafter.inner, sequence=decoder.sequence)
    check_sglang_cache(inner, pair, made, cfg)


def long_rows(pair, max_tokens: int = 60):
    """Three prompts and the first one's history: the key's earlier request and the target's
    reply to it, the same prompt again (an agent repeating itself), so its suffix match
    supports a draft far past K_MAX that the target accepts; the others have none."""
    first = pair.tokenizer.encode(REPEATING)
    history = SuffixHistory()
    history.add(first + reference(pair, first, max_tokens))
    prompts = [first, pair.tokenizer.encode("The quick brown fox"), pair.tokenizer.encode("Once")]
    return prompts, [history, None, None]


def run_rows_longest(decoder, prompts, histories, max_tokens: int = 60) -> tuple[list, list]:
    """Every prompt a row from the start: (each row's tokens, the most it accepted in a
    round)."""
    config = GenerationConfig(max_tokens=max_tokens)
    ids = [decoder.add(p, config, history=h) for p, h in zip(prompts, histories, strict=True)]
    out, most = {i: [] for i in ids}, dict.fromkeys(ids, 0)
    for _ in range(4 * max_tokens):
        if not len(decoder):
            break
        for row, u in decoder.step().items():
            out[row] += u.tokens
            most[row] = max(most[row], u.round.accepted)
    assert not len(decoder)
    return [out[i] for i in ids], [most[i] for i in ids]


@pytest.mark.parametrize(
    "drafter,k,dear",
    [("suffix", k, dear) for k in (3, "auto") for dear in (False, True)]
    + [("suffix+model", 3, False), ("suffix+model", "auto", False), ("mamba", 3, False)],
)
def test_a_batch_row_drafts_past_k_max_where_the_pass_pays(
    tiny_models, monkeypatch, drafter, k, dear
):
    """In a batch a suffix row's lookup draft is as long as the pass's cost says, not the
    batch's k (<= K_MAX): where a wider pass costs little (memory-bound) the row that holds
    its reply accepts more than K_MAX tokens in a round; where every verified row costs a
    step's worth, none goes past K_MAX. Every row is the target alone either way: beside a
    draft model (fed every looked-up guess), and on a recurrent target (Mamba: no padding,
    fillers) too."""
    from mlx_spec.decode.generate import make_batch_decoder

    if drafter == "mamba":
        pair = load_pair(target=str(tiny_models.mamba)).configured(drafter="suffix")
    else:
        draft = str(tiny_models.draft) if drafter == "suffix+model" else None
        pair = load_pair(target=str(tiny_models.target), draft=draft).configured(drafter=drafter)
    prompts, histories = long_rows(pair)
    decoder = make_batch_decoder(pair, k)
    per_row = 0.05 if dear else 0.0002
    monkeypatch.setattr(decoder.curve, "pass_seconds", lambda rows: 0.05 + per_row * rows)
    out, most = run_rows_longest(decoder, prompts, histories)
    for p, tokens in zip(prompts, out, strict=True):
        assert tokens == reference(pair, p, 60)
    assert (most[0] > K_MAX) is not dear
    assert decoder.lookup_costs.rounds > 0 or dear


@pytest.mark.parametrize("cheap", [True, False])
def test_the_lookup_width_is_what_the_pass_cost_pays_for(cheap):
    """A long match widens the pass while a wider pass costs little; where each column costs
    as much as the batch's whole pass, it does not (the rows draft their k as before). A
    draft model fed every column pays a step a column: a shorter lookup."""
    from mlx_spec.core.batch_policy import lookup_width

    per_row = 0.001 if cheap else 1.0

    def pass_seconds(rows):
        return 1.0 + per_row * (rows - 3)

    found = {0: (0.93, 64)}  # row 0: a long match, accepted 93 %; rows 1, 2: their k of 2
    chosen = lookup_width([2, 2, 2], [2.0, 2.0, 2.0], found, pass_seconds, 0.0)
    if cheap:
        assert chosen[0] > K_MAX
        fed = lookup_width([2, 2, 2], [2.0, 2.0, 2.0], found, pass_seconds, 0.05, fed=True)
        assert fed[0] < chosen[0]
        # the same beside a head: its steps are its own rows' (k), not the width's
        head = lookup_width([2, 2, 2], [2.0, 2.0, 2.0], found, pass_seconds, 0.05)
        assert head[0] > K_MAX
    else:  # (a lookup within the pass's width still goes where it beats the row's k)
        assert all(n <= 2 for n in chosen.values())


def assert_suffix_rows_beside_the_head(pair, monkeypatch, k: int = 2) -> None:
    """`suffix+<the pair's head kind>` in a batch: a row whose match supports a long lookup
    drafts it past K_MAX (accepted), the others draft with the head, and every row is the
    target alone; then the join / leave / cancel schedule of test_batch_eagle, exact too."""
    from test_batch_eagle import assert_greedy_rows_equal_each_alone

    from mlx_spec.decode.generate import make_batch_decoder

    suffix = pair.configured(drafter=f"suffix+{pair.config.drafter}")
    decoder = make_batch_decoder(suffix, k)
    assert decoder.heads is not None and decoder.suffix
    # a memory-bound pass (a wider one costs little): long lookups pay
    monkeypatch.setattr(decoder.curve, "pass_seconds", lambda rows: 0.05 + 0.0002 * rows)
    prompts, histories = long_rows(suffix)
    config = GenerationConfig(max_tokens=60)
    ids = [decoder.add(p, config, history=h) for p, h in zip(prompts, histories, strict=True)]
    out, most = {i: [] for i in ids}, dict.fromkeys(ids, 0)
    head_steps = 0
    while len(decoder):
        for row, u in decoder.step().items():
            out[row] += u.tokens
            most[row] = max(most[row], u.round.accepted)
            head_steps += u.round.draft_steps
    for p, i in zip(prompts, ids, strict=True):
        assert out[i] == reference(suffix, p, 60), f"row {i}"
    assert most[ids[0]] > K_MAX and head_steps > 0
    assert_greedy_rows_equal_each_alone(suffix, make_batch_decoder(suffix, k), False)


def test_sampled_batch_rows_drafting_long_lookups_follow_the_target(tiny_models, monkeypatch):
    """Sampled rows (temperature 1) in a batch whose rounds are lookup drafts longer than k
    (a repeated prompt, a cheap pass): their first two tokens follow the target's exact
    joint distribution (chi-square); the same harness with every guess accepted does not."""
    from test_distribution import VOCAB, accept_everything

    import mlx_spec.decode.rounds
    from mlx_spec.decode.generate import make_batch_decoder

    pair = load_pair(target=str(tiny_models.small_target)).configured(drafter="suffix")
    params = SamplingParams(temperature=1.0)
    prompt = PROMPT * 3  # repeated: every row has a long match
    probs = exact_joint(pair, params, prompt)

    def first_two_in_batch(runs: int) -> tuple[np.ndarray, int]:
        decoder = make_batch_decoder(pair, 2)
        decoder.eos = set()  # (the joint is over every token, as test_distribution's)
        monkeypatch.setattr(decoder.curve, "pass_seconds", lambda rows: 0.05 + 0.0002 * rows)
        counts, tokens = np.zeros((VOCAB, VOCAB)), {}
        seed = longest = 0
        while seed < runs or len(decoder):
            while len(decoder) < 6 and seed < runs:
                config = GenerationConfig(max_tokens=12, temperature=1.0, seed=seed)
                tokens[decoder.add(prompt, config)] = []
                seed += 1
            for row, u in decoder.step().items():
                if row not in tokens:
                    continue
                if not tokens[row]:  # the row's first round
                    longest = max(longest, u.round.drafted)
                tokens[row] += u.tokens
                if len(tokens[row]) >= 2:
                    t = tokens.pop(row)
                    counts[t[0], t[1]] += 1
                    if not u.done:
                        decoder.cancel(row)
        return counts, longest

    counts, longest = first_two_in_batch(1500)
    stat, threshold = chi_square(counts, probs)
    print(f"batched suffix: chi-square {stat:.1f} (threshold {threshold:.1f})")
    assert longest > 2 and stat < threshold  # (longer than the batch's k of 2)
    monkeypatch.setattr(mlx_spec.decode.rounds, "verify_stochastic", accept_everything)
    stat, threshold = chi_square(first_two_in_batch(600)[0], probs)
    assert stat > threshold


def test_a_recurrent_batchs_lookups_keep_its_pass_within_bounds(tiny_models):
    """On a recurrent target every row feeds its replay and fillers up to one common width,
    which a window must be able to roll back: a row's lookup is cut so that the widest
    replay plus it stays within RECURRENT_PASS_MAX (a seeded sampled row, which keeps no
    fillers, may replay a whole round's width; on a windowed hybrid a wider pass would be
    refused, failing every row of the batch)."""
    from mlx_spec.decode.batch_draft import RECURRENT_PASS_MAX
    from mlx_spec.decode.generate import make_batch_decoder

    pair = load_pair(target=str(tiny_models.mamba)).configured(drafter="suffix")
    prompts, histories = long_rows(pair)
    decoder = make_batch_decoder(pair, 3)
    decoder.curve.pass_seconds = lambda rows: 0.05 + 0.0002 * rows  # wide passes pay
    config = GenerationConfig(max_tokens=60)
    for p, h in zip(prompts, histories, strict=True):
        decoder.add(p, config, history=h)
    decoder.step()
    requested = [3] * len(decoder.rows)
    wide = decoder._lookups(requested, {}, set())
    assert wide and max(len(g) for _, g in wide.values()) > 3 * K_MAX // 2
    for replay in (40, RECURRENT_PASS_MAX - 2, RECURRENT_PASS_MAX):
        decoder.rows[2].unfed = replay  # (only what `_lookups` reads: no pass runs)
        looked = decoder._lookups(requested, {}, set())
        assert all(replay + len(g) <= RECURRENT_PASS_MAX for _, g in looked.values())
