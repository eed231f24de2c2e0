"""One verdict, computed one way (issue 47): `probe`, the `generate` hint, the chat's verdict
line and the `auto` controller all judge a draft by payoff.predicted_speedup, so they agree on
a pair whose draft pays (an identical copy: always accepted) and one whose draft does not (a
deranged draft: never accepted), given the same measured costs."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mlx_spec import GenerationConfig, Stats, generate, load_pair, stream_rounds
from mlx_spec.commands.generate import hint
from mlx_spec.commands.probe import own_ks, run_probe
from mlx_spec.core import caches
from mlx_spec.core.payoff import PAYS, Payoff, expected_tokens, judge, predicted_speedup
from mlx_spec.core.policies import Auto, Controller, Fixed, FixedK
from mlx_spec.measure.verify_cost import predict, verdict
from tui.widgets import StatsPanel

K = 2
DRAFT_STEP = 0.25  # a draft step, in plain steps: a round of 2 drafts costs 2 * 0.25 + 1 = 1.5
ROUND_COST = K * DRAFT_STEP + 1.0  # the verify pass over k+1 tokens costs one step (flat)


def test_the_speedup_is_expected_tokens_over_the_round_cost():
    assert predicted_speedup(0.5, 1, 1.0) == pytest.approx(1.5)
    assert predicted_speedup(0.5, 2, 1.75) == pytest.approx(1.0)
    assert predicted_speedup([0.8, 0.5], 2, 2.0) == pytest.approx((1 + 0.8 + 0.4) / 2)
    assert predicted_speedup(0.9, 3, 0.0) == 0.0
    assert predicted_speedup(0.7, 4, 1.3) == pytest.approx(expected_tokens([0.7] * 4) / 1.3)
    assert [judge(s) for s in (PAYS, 1.01, 0.99)] == ["pays", "even", "loses"]


def run(tiny_models, draft: str):
    """A real greedy run of the tiny target with `draft` at k = 2; the run's own policy."""
    pair = load_pair(
        target=str(tiny_models.target), draft=str(getattr(tiny_models, draft)), num_draft_tokens=K
    )
    result = generate(pair, "Hello there, how are you", GenerationConfig(24, seed=0))
    return pair, result.stats


def with_costs(stats: Stats) -> Stats:
    """The run's policy with these costs as if measured: a plain step of 1 s, each round
    ROUND_COST s (the tiny CPU models' real timings are noise)."""
    policy = stats.policy
    assert isinstance(policy, FixedK) and policy.plain_step is not None  # prefill timed a step
    assert policy.first_round is not None and policy.timed_rounds > 0  # the rounds were timed
    policy.plain_step, policy.first_round = 1.0, ROUND_COST
    policy.round_seconds = ROUND_COST * policy.timed_rounds
    policy.held_seconds = 0.0  # the caller's share of a round: far under a step
    return stats


@pytest.mark.parametrize(("draft", "pays"), [("copy", True), ("deranged", False)])
def test_probe_hint_chat_and_controller_agree(tiny_models, draft, pays):
    pair, stats = run(tiny_models, draft)
    stats = with_costs(stats)
    payoff = stats.payoff
    alpha = payoff.acceptance
    assert alpha == (1.0 if pays else 0.0)  # copy: always accepted; deranged: never
    assert payoff.round_cost == pytest.approx(ROUND_COST)

    # the hint on `generate`
    line = hint(stats)
    assert ("speculation pays" in line) == pays
    assert ("does not pay" in line) == (not pays)
    assert line.startswith("hint: ") == (not pays)

    # probe: the same figures through its prediction (a flat verify curve: T(3) = T(1))
    flat = {n: 1.0 for n in range(1, 17)}
    prediction = predict(alpha, DRAFT_STEP, flat, 0.01, [K])[0]
    assert prediction.speedup == pytest.approx(payoff.speedup)
    words = verdict("memory-bound", DRAFT_STEP, alpha, prediction)
    assert words.startswith(payoff.sentence())

    # the chat's verdict line, from the reply's stats as the app receives them
    chat = StatsPanel.verdict_lines(stats.to_json())
    assert chat == [f"verdict      {Payoff.from_json(stats.to_json()['payoff']).short()}"]
    assert chat[0].split()[1].startswith("pays" if pays else "does")

    # the controller, given the same costs and this run's rounds, drafts exactly when it pays
    controller = Controller(K)
    controller.calibrate(1.0, DRAFT_STEP)
    for _ in range(3):
        for r in stats.records:
            if r.drafted:
                controller.update(K, len(r.drafted), r.accepted, ROUND_COST)
    assert (controller.next() > 0) == pays
    assert controller.payoff().pays == pays
    assert (controller.predicted_speedup(K) >= PAYS) == pays


def test_nothing_measured_no_verdict():
    """No policy (plain decoding, or a run too short to time): no hint and no verdict line."""
    assert hint(Stats()) is None
    assert StatsPanel.verdict_lines(Stats(num_draft_tokens=2).to_json()) == [
        "verdict      not measured yet"
    ]
    assert FixedK(2).payoff() is None


def test_probe_measures_at_the_pairs_own_k(tiny_models):
    """A pair fixed at k = 2 is sampled and judged at k = 2 (it sampled at 4 and judged the
    best of 1..10 before); `auto` is judged over the controller's range."""
    assert own_ks(Fixed(1)) == (1, [1])
    assert own_ks(Auto()) == (4, list(range(1, 9)))
    assert own_ks(Auto(3)) == (3, [1, 2, 3])
    pair = load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.draft), num_draft_tokens=K
    )
    said = []
    r = run_probe(pair, 32, 0.0, 16, progress=said.append, budget=1e-6)
    assert any(f"at k={K} " in line for line in said)
    assert r.verdict_k == K and r.k_policy == str(K)
    own = next(p for p in r.predictions if p.k == K)
    assert r.judgement == judge(own.speedup)
    assert verdict(r.regime, r.draft_cost, r.alpha, own) in r.verdict
    assert r.to_json()["verdict_k"] == K


def test_auto_that_never_drafted_still_says_why():
    """`auto` that paused before drafting anything (the draft step as dear as a target step):
    no acceptance was measured, but even a draft that is always right loses at the measured
    costs, and the verdict says so as a bound, quoting no acceptance it did not measure."""
    controller = Controller(4)
    controller.calibrate(1.0, 1.4)  # a plain step 1 s, a draft step 1.4 s: nothing can pay
    assert controller.next() == 0 and controller.drafted_total == 0
    payoff = controller.payoff()
    assert payoff is not None and payoff.bound and not payoff.pays
    assert payoff.speedup < 1.0
    assert "even a perfect draft" in payoff.sentence() and "at most" in payoff.short()
    assert "%" not in payoff.figures()  # no acceptance quoted
    back = Payoff.from_json(payoff.to_json())  # (the chat reads it back from the stats)
    assert back.bound and back.k == payoff.k and back.short() == payoff.short()
    # a draft that costs little and is not yet measured: no verdict rather than a guess
    cheap = Controller(4)
    cheap.calibrate(1.0, 0.05)
    assert cheap.payoff() is None


def test_a_fixed_k_plain_token_is_a_step_or_the_callers_share():
    """A plain token costs the step timed in prefill, or the caller's share of a round when
    that is longer (plain decoding queues the next step before handing a token over)."""
    fixed = FixedK(2)
    fixed.calibrate(0.05, None)
    for seconds in (0.3, 0.2, 0.2, 0.2):  # the first round pays one-time costs: left out
        fixed.update(2, 2, 2, seconds)
        fixed.consumed(0.01)
    assert fixed.plain_token() == 0.05  # a caller quicker than a step: hidden under it
    assert fixed.payoff().round_cost == pytest.approx(4.0)
    for _ in range(4):
        fixed.consumed(0.19)  # now 0.1 s a round on average
    assert fixed.plain_token() == pytest.approx(0.1)
    assert fixed.payoff().round_cost == pytest.approx(2.0)
    assert fixed.payoff().speedup == pytest.approx(3 / 2.0)  # E(2) = 3 at acceptance 1


def test_the_fixed_k_verdict_agrees_with_the_clock_under_a_slow_caller(tiny_models):
    """`generate`'s hint and the chat's verdict (FixedK.payoff) against what the clock says
    about the same run and a plain one, for a caller that takes 30 ms a round (a slow client,
    a program doing work per token). The verdict compared the rounds, which hold the caller's
    time, with a bare step timed in prefill: about 0.1x, "does not pay", where speculation
    ran 2-3x faster than plain decoding."""
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.copy))
    prompt = "Hello there, how are you"

    def run(use_draft: bool) -> Stats:
        stats = Stats()
        config = GenerationConfig(36, seed=0, num_draft_tokens=K, use_draft=use_draft)
        for _ in stream_rounds(pair, prompt, config, stats=stats):
            time.sleep(0.03)
        return stats

    spec, plain = run(True), run(False)
    measured = spec.tokens_per_second / plain.tokens_per_second
    predicted = spec.payoff.speedup
    assert spec.acceptance_rate == 1.0 and measured > 1.5
    assert judge(predicted) == judge(measured) == "pays"
    assert 0.7 < predicted / measured < 1.4, (predicted, measured)


def test_a_timed_prefill_is_the_median_of_its_steps(tiny_models, monkeypatch):
    """The plain step every verdict divides by is the median of the last single-token steps
    of a timed prefill, the first left out (one step alone swung by ±25 % on a busy CPU): a
    step stalled by a neighbour does not make the draft look free."""
    pair = load_pair(target=str(tiny_models.target))
    durations = iter([9.0, 5.0, 1.0, 1.2])  # one-time costs, then a stalled step, two others
    clock = {"now": 0.0, "start": True}

    def perf_counter():  # a step starts, then ends the next duration later
        if not clock["start"]:
            clock["now"] += next(durations)
        clock["start"] = not clock["start"]
        return clock["now"]

    monkeypatch.setattr(caches, "time", SimpleNamespace(perf_counter=perf_counter))
    tokens = pair.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    cache = caches.make_cache(pair.target, "target")
    assert caches.prefill_cache(pair.target, cache, tokens, timed=True) == pytest.approx(1.2)
    assert cache[0].offset == len(tokens)
    assert caches.prefill_cache(pair.target, caches.make_cache(pair.target), tokens[:2]) is None


def test_a_retimed_fixed_k_divides_by_plain_steps_timed_in_the_loop():
    """`Fixed(k, retime=n)` (the chat's): after every n k-rounds one plain step, timed as a
    round is; the verdict divides by their median, not by the step timed in prefill (which
    the chat's drawing does not slow: 0.58-0.77x said where its race measured 1.04-1.70x)."""
    fixed = Fixed(2, retime=3).policy()
    fixed.calibrate(0.05, None)  # a quiet prefill
    asked = []
    for seconds in (0.3, 0.3, 0.3):
        asked.append(fixed.next())
        fixed.update(2, 2, 2, seconds)
    asked.append(fixed.next())
    fixed.update_plain(1, 0.2)  # the plain step it asked for, under the caller's load
    asked.append(fixed.next())
    assert asked == [2, 2, 2, 0, 2]
    fixed.update_plain(1, 9.0)  # the reply's last token, not asked for: not a timing
    assert fixed.loop_plain == [0.2] and fixed.plain_token() == 0.2
    assert fixed.payoff().round_cost == pytest.approx(0.3 / 0.2)
    assert FixedK(2).next() == 2 and Fixed(2).policy().retime == 0  # not asked: every round


def test_a_retimed_run_stays_the_targets_with_a_plain_step_every_n_rounds(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    prompt = "Hello there, how are you"
    alone = generate(pair, prompt, max_tokens=48, use_draft=False)
    stats = Stats()
    config = GenerationConfig(48, num_draft_tokens=Fixed(2, retime=3))
    text = "".join(e.text for r in stream_rounds(pair, prompt, config, stats=stats) for e in r)
    assert text == alone.text
    drafted = [len(r.drafted) for r in stats.records]
    assert drafted[:8] == [2, 2, 2, 0, 2, 2, 2, 0]
    assert stats.payoff is not None and stats.policy.loop_plain
