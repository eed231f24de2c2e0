"""The `auto` draft-length controller: k from measured round times and acceptance, k = 0
(plain decoding) when no k pays. It reads only the past, so the output stays the target's:
greedy equality and the distribution are tested with it, on scripted and on live choices."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import SamplingParams, generate, load_pair, make_decoder
from mlx_spec.drafters import LookupThenModel, ModelDrafter, NGramDrafter
from mlx_spec.policies import PROBE_MAX_INTERVAL, Auto, Controller, Fixed, draft_length

# ------------------------------------------------------------- the controller on its own


def simulate(
    controller, round_time, plain_time, accept, tokens=600, reach=1.0, seed=0, draft_step=0.0
):
    """Drive a controller with a synthetic machine: round_time(k) seconds per round (of which
    draft_step per draft token), a plain token in plain_time, each draft position accepted
    with probability accept(position)."""
    rng = random.Random(seed)
    chosen, emitted = [], 0
    controller.plain_tokens = 0
    while emitted < tokens:
        k = controller.next()
        chosen.append(k)
        if k == 0:
            n = controller.plain_burst()
            controller.update_plain(n, n * plain_time)
            emitted += n
            controller.plain_tokens += n
            continue
        drafted = k if rng.random() < reach else 0
        verified = 0
        while verified < drafted and rng.random() < accept(verified):
            verified += 1
        split = None
        if controller.wants_split():
            drafting = draft_step * drafted
            split = (drafting, drafted, round_time(k) - drafting, drafted + 1)
        controller.update(k, drafted, verified, round_time(k), split)
        emitted += verified + 1
    return chosen


def test_a_draft_dearer_than_the_target_is_paused_for_good():
    """The demo pair on this CPU: a draft step costs 1.46 target steps. Even a draft that
    is always right cannot pay, so after the warm-up it decodes plainly and probes rarely."""
    c = Controller()
    chosen = simulate(c, lambda k: 1 + 1.46 * k + 0.1 * k, 1.0, lambda i: 0.7, draft_step=1.46)
    assert chosen[:3] == [1, 1, 0]  # warm-up: two short drafts, then plain steps
    assert c.best()[0] == 0 and c.best(optimistic=True)[0] == 0
    assert c.probe_interval() == PROBE_MAX_INTERVAL
    assert sum(k > 0 for k in chosen) <= 1 + 600 // PROBE_MAX_INTERVAL + 1
    assert c.view()["state"] == "drafting paused: draft costs 1.46 steps"
    assert abs(c.round_time(0) - 1.0) < 1e-9


def test_a_cheap_agreeing_draft_climbs_to_a_long_draft():
    c = Controller()
    chosen = simulate(c, lambda k: 1 + 0.05 * k + 0.05 * k, 1.0, lambda i: 0.9)
    late = chosen[len(chosen) // 2 :]
    assert min(late) >= 4 and 0 not in late
    assert c.predicted_speedup(c.chosen) > 2


def test_prompt_lookup_that_rarely_matches_decodes_plainly_and_probes_often():
    """Lookup drafts are free, but when it finds nothing a round is an unpipelined step:
    slower than plain decoding. Probes stay cheap, so they come often."""
    c = Controller()
    chosen = simulate(c, lambda k: 1.15 + 0.02 * k, 1.0, lambda i: 0.9, reach=0.05)
    assert c.plain_tokens > 0.8 * 600
    assert 8 <= c.probe_interval() < 64
    assert len(chosen) > 600 / 64  # probes keep coming


def test_acceptance_that_collapses_stops_drafting():
    c = Controller()
    simulate(c, lambda k: 1 + 0.1 * k + 0.1 * k, 1.0, lambda i: 0.95, tokens=300)
    assert c.best()[0] >= 3
    simulate(c, lambda k: 1 + 0.1 * k + 0.1 * k, 1.0, lambda i: 0.02, tokens=300, seed=1)
    assert c.best()[0] == 0


def test_round_time_interpolates_and_extrapolates():
    c = Controller()
    c.plan.clear()
    c.update_plain(4, 4.0)
    c.update(2, 2, 1, 3.0)
    assert c.round_time(1) == pytest.approx(2.0)  # between plain (1.0) and k=2 (3.0)
    assert c.round_time(4) == pytest.approx(5.0)  # along the same line
    c.update(4, 4, 4, 9.0)  # a first timing is provisional (one-time costs): replaced
    c.update(4, 4, 4, 4.0)
    assert c.round_time(3) == pytest.approx(3.5)
    assert c.round_time(6) == pytest.approx(5.0)


def test_draft_lengths_from_every_entry_point():
    assert draft_length("auto") == Auto() and draft_length(3) == Fixed(3)
    assert draft_length("5") == Fixed(5) and draft_length(Fixed(2)) == Fixed(2)
    for bad in (0, -1, True, "x", 1.5):
        with pytest.raises(Exception, match="num-draft-tokens"):
            draft_length(bad)


# --------------------------------------------------------- lossless with the controller


@dataclass(frozen=True)
class Scripted(Auto):
    """`auto` whose first choices are scripted (plain bursts between drafts of every
    length), then the live controller: every engine path runs, whatever this machine's
    timings say."""

    script: tuple = (3, 0, 1, 0, 6, 2, 0, 8, 4, 0)

    def policy(self, stop_below=None):
        controller = super().policy(stop_below)
        controller.plan = list(self.script)
        return controller


@pytest.mark.parametrize("draft", ["draft", "noisy", "copy"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_auto_equals_the_target_alone(tiny_models, draft, prompt):
    pair = load_pair(target=str(tiny_models.target), draft=str(getattr(tiny_models, draft)))
    ref = reference(pair, prompt, 60)
    for length in ("auto", Scripted()):
        res = generate(pair, prompt, max_tokens=60, num_draft_tokens=length)
        assert res.tokens == ref
        assert res.stats.adaptive and res.stats.controller is not None
    stats = res.stats  # the scripted run: plain bursts and drafts of 1..8 all happened
    assert stats.plain_tokens >= 4 and sum(stats.chosen_lengths[1:]) >= 6
    assert {1, 2, 3, 4, 6, 8} <= {k for k, n in enumerate(stats.chosen_lengths) if n}
    assert stats.target_passes == sum(stats.chosen_lengths)


@pytest.mark.parametrize("drafter", ["ngram", "ngram+model"])
def test_greedy_with_auto_for_lookup_drafters(tiny_models, drafter):
    draft = str(tiny_models.noisy) if drafter == "ngram+model" else None
    pair = load_pair(target=str(tiny_models.target), draft=draft, drafter=drafter)
    assert pair.num_draft_tokens == Auto()  # lookup pairs default to the controller too
    prompt = "Paris is the capital of France. Paris is the capital of"
    ref = reference(pair, prompt, 60)
    for length in ("auto", Scripted()):
        assert generate(pair, prompt, max_tokens=60, num_draft_tokens=length).tokens == ref


def test_a_kept_decoder_keeps_what_the_controller_learned(pair):
    decoder = make_decoder(pair)
    first = generate(pair, PROMPTS[0], max_tokens=30, decoder=decoder)
    controller = first.stats.policy
    seen = dict(controller.cost)
    again = generate(pair, PROMPTS[0] + " again", max_tokens=30, decoder=decoder)
    assert again.stats.policy is controller and set(seen) <= set(controller.cost)
    assert not controller.plan  # no second warm-up


def test_controller_distribution_is_the_target(tiny_models):
    """One controller across 2500 seeded runs: k (and plain bursts) vary with history."""
    pair = load_pair(target=str(tiny_models.small_target), draft=str(tiny_models.small_draft))
    params = SamplingParams(temperature=1.0)
    controller = Controller(k_max=4)
    controller.plan = [2, 0, 1, 3, 0, 4] * 60  # varied early; the live controller after
    drafted = []
    counts = first_two(pair, params, 2500, controller, drafted=drafted, max_tokens=6)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert len(set(drafted)) >= 3
    assert stat < threshold, (stat, threshold)


def test_drafters_are_fed_the_plain_tokens(tiny_models):
    """Tokens decoded plainly while speculating reach the drafter: the model draft catches
    up on them in one pass, the lookup index learns them."""
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    decoder = make_decoder(pair)
    res = generate(pair, PROMPTS[1], max_tokens=40, num_draft_tokens=Scripted(), decoder=decoder)
    drafter = decoder.drafter
    assert isinstance(drafter, ModelDrafter)
    assert drafter.cached + drafter.pending == decoder.sequence
    lookup_pair = load_pair(target=str(tiny_models.target), drafter="ngram")
    decoder = make_decoder(lookup_pair)
    generate(lookup_pair, PROMPTS[1], max_tokens=40, num_draft_tokens=Scripted(), decoder=decoder)
    assert isinstance(decoder.drafter, NGramDrafter)
    assert decoder.drafter.tokens == decoder.sequence
    assert not isinstance(decoder.drafter, LookupThenModel) and res.tokens
