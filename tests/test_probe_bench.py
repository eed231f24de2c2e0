"""probe and bench: the regime classifier on synthetic curves, and the plumbing on tiny models."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import pytest
import tiny
from conftest import VOCAB
from mlx_lm.models.cache import ArraysCache

from mlx_spec.cli import main
from mlx_spec.commands.probe import MIN_SAMPLE_ROUNDS, SAMPLE_PROMPT, run_probe
from mlx_spec.core import caches
from mlx_spec.core.payoff import estimate_alpha, expected_tokens
from mlx_spec.measure.benchmark import format_rows, run_bench, summarise
from mlx_spec.measure.verify_cost import (
    MAX_REPS,
    MIN_REPS,
    PREFIX,
    PassTimer,
    classify_regime,
    fill_curve,
    plan_passes,
    predict,
    time_passes,
    verdict,
)

SIZES = list(range(1, 17))
PROBE_SIZES = [*range(1, 12), 16]  # what `probe` times: k+1 for k = 1..10, and 16
FLOOR = [1, 2, 16]  # the sizes timed however slow the machine


class Counting:
    """A real model, with a log of how many tokens each call fed it."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls.append(inputs.shape[1])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize(
    ("curve", "regime"),
    [
        ([1 + 0.02 * (n - 1) for n in SIZES], "memory-bound"),  # float32 + OpenBLAS-like
        (
            [1.0, 1.1, 1.1, 1.2, 1.3, 1.3, 1.4, 1.5, 1.5, 1.6, 1.7, 1.7, 1.8, 1.8, 1.9, 2.0],
            "memory-bound",
        ),
        ([float(n) for n in SIZES], "compute-bound"),  # 8 rows cost 8x one row
        ([1 + 0.8 * (n - 1) for n in SIZES], "compute-bound"),
        ([1 + 0.3 * (n - 1) for n in SIZES], "in between"),
    ],
)
def test_regime_classifier(curve, regime):
    assert classify_regime(SIZES, curve) == regime


def test_expected_tokens_matches_the_formula_and_limits():
    assert expected_tokens([0.0] * 5) == 1.0
    assert expected_tokens([1.0] * 5) == 6.0
    # α=0.5, k=2: 1 + 0.5 + 0.25
    assert expected_tokens([0.5] * 2) == pytest.approx(1.75)
    # the closed form (1 - α^(k+1)) / (1 - α), and per-position rates with a reach
    for alpha, k in [(0.3, 4), (0.8, 7)]:
        assert expected_tokens([alpha] * k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert expected_tokens([0.5, 0.4], [1.0, 0.5]) == pytest.approx(1 + 0.5 + 0.5 * 0.2)


def test_estimate_alpha_is_the_geometric_mle():
    # 10 rounds of k=4: 3 fully accepted (12 tokens), 7 rejected after 1 token each (7 tokens)
    assert estimate_alpha(accepted=19, drafted=40, full_rounds=3, rounds=10) == pytest.approx(
        19 / 26
    )
    assert estimate_alpha(0, 0, 0, 0) == 0.0


def test_predictions_prefer_short_drafts_when_the_verify_pass_is_linear():
    flat = {n: 1.0 for n in range(1, 17)}
    linear = {n: float(n) for n in range(1, 17)}
    fast_flat = predict(0.8, 0.05, flat, 0.01, range(1, 11))
    best = max(fast_flat, key=lambda p: p.tokens_per_second)
    assert best.k > 3 and best.speedup > 2
    slow = predict(0.8, 0.05, linear, 0.01, range(1, 11))
    assert max(p.speedup for p in slow) < 1
    assert "does not pay" in verdict("compute-bound", 0.05, 0.8, max(slow, key=lambda p: p.speedup))
    assert "pays" in verdict("memory-bound", 0.05, 0.8, best)


def test_bench_rows_and_same_output(pair):
    prompts = {"chat": "Hello there", "code": "def f(x):"}
    results = run_bench(pair, prompts, temps=[0.0, 1.0], ks=[2], runs=1, max_tokens=12)
    rows = {(r.temperature, r.config, r.k): r for r in summarise(results)}
    assert set(rows) == {
        (t, c, k)
        for t in (0.0, 1.0)
        for c, k in [("mlx-lm", 0), ("mlx-spec", 0), ("mlx-lm speculative", 2), ("mlx-spec", 2)]
    }
    assert rows[(0.0, "mlx-lm", 0)].speedup == 1.0
    # greedy output is identical across all four engines on every prompt
    assert all(r.same_output for (t, c, _), r in rows.items() if t == 0 and c != "mlx-lm")
    assert rows[(0.0, "mlx-spec", 2)].acceptance_rate is not None
    assert rows[(1.0, "mlx-spec", 0)].tokens_per_target_pass == 1.0
    # per prompt: each prompt's speedups are over its own mlx-lm plain runs
    per_prompt = summarise(results, by_prompt=True)
    assert [r.prompt for r in per_prompt][:: len(per_prompt) // 2] == ["chat", "code"]
    for r in per_prompt:
        run = next(
            x
            for x in results
            if (x.prompt, x.temperature, x.config, x.k) == (r.prompt, r.temperature, r.config, r.k)
        )
        base = next(
            x
            for x in results
            if (x.prompt, x.temperature, x.config) == (r.prompt, r.temperature, "mlx-lm")
        )
        assert r.median_tokens_per_second == run.tokens_per_second  # one run: its own value
        assert r.speedup == pytest.approx(run.tokens_per_second / base.tokens_per_second)
    table = format_rows(per_prompt)
    assert table.count("\ncode ") == 8 and table.count("\nchat ") == 8


def test_probe_and_bench_commands_json_and_plot(tiny_models, tmp_path, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.noisy)]
    plot = tmp_path / "probe.png"
    assert (
        main(
            [
                "probe",
                *pair,
                "--context",
                "64",
                "--sample-tokens",
                "16",
                "--json",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["regime"] in ("memory-bound", "compute-bound", "in between")
    assert len(out["verify_cost_curve"]) == 12 and out["verify_cost_curve"]["1"] == 1.0
    assert len(out["predictions"]) == 10 and 0 <= out["alpha"] <= 1
    assert plot.stat().st_size > 1000
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nTell me a story\n")
    plot = tmp_path / "bench.png"
    args = ["bench", *pair, "--prompts", str(prompts), "--k", "2", "--temps", "0", "--runs", "1"]
    assert main([*args, "--max-tokens", "8", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["config"] for r in out["rows"]} == {"mlx-lm", "mlx-spec", "mlx-lm speculative"}
    assert len(out["runs"]) == len(out["rows_by_prompt"]) == 2 * 4  # two prompts, 4 configs
    assert plot.stat().st_size > 1000


def test_bench_bad_input(tiny_models, tmp_path, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.noisy)]
    assert main(["bench", *pair, "--k", "0"]) == 2
    assert main(["bench", *pair, "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert main(["bench", *pair, "--only", "chat,poems"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 3 and "draft lengths" in err and "cannot read prompts file" in err
    assert "unknown built-in prompt 'poems'; known: chat, code" in err
    # a plot into a folder that does not exist, or onto a folder: said before any work (it
    # was a traceback and exit 1 once the whole run was done)
    for command in ("bench", "probe"):
        for plot in (tmp_path / "nowhere" / "b.png", tmp_path):
            assert main([command, *pair, "--plot", str(plot)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "--plot" in err, err


def test_bench_picks_built_in_prompts(tiny_models, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.noisy)]
    args = ["--k", "auto", "--temps", "0", "--runs", "1", "--max-tokens", "4", "--json"]
    assert main(["bench", *pair, "--only", "summarisation,code edit", *args]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert {r["prompt"] for r in runs} == {"summarisation", "code edit"}


# ------------------------------------------------------------------ probe's time bound


def test_the_plan_scales_repetitions_and_sizes_to_the_budget():
    """Passes are planned from the measured step: a fast machine times every size at up to
    MAX_REPS, a slow one fewer sizes (never fewer than the floor) at MIN_REPS; the planned
    cost stays within the budget whenever more than the floor is timed."""

    def planned(chosen, reps, step):
        return (reps + 1) * sum(step(n) for n in chosen)

    fast = lambda n: 0.001 * (1 + 0.05 * n)  # noqa: E731  memory-bound, 1 ms a step
    assert plan_passes(fast, PROBE_SIZES, 40.0) == (PROBE_SIZES, MAX_REPS)
    linear = lambda n: 0.4 * n  # noqa: E731  the reference BLAS: compute-bound, 0.4 s a step
    chosen, reps = plan_passes(linear, PROBE_SIZES, 40.0)
    assert reps == MIN_REPS and set(FLOOR) <= set(chosen) and len(chosen) < len(PROBE_SIZES)
    assert planned(chosen, reps, linear) <= 40.0
    assert plan_passes(linear, PROBE_SIZES, 0.0) == (FLOOR, MIN_REPS)  # the floor
    slower = plan_passes(lambda n: 0.8 * n, PROBE_SIZES, 40.0)[0]
    assert set(slower) < set(chosen) or slower == FLOOR  # a slower step: fewer sizes
    # 0.82 s a round over all 12 sizes: 5 rounds (a warm-up and 4 timed) fit in 4.5 s
    assert plan_passes(lambda n: 0.01 * n, PROBE_SIZES, 4.5) == (PROBE_SIZES, 4)


def test_untimed_sizes_are_interpolated_between_timed_ones():
    seconds = {1: 1.0, 2: 1.5, 4: 2.5, 8: 3.0, 16: 7.0}
    filled = fill_curve(PROBE_SIZES, seconds)
    by_n = dict(zip(PROBE_SIZES, filled, strict=True))
    assert [by_n[n] for n in seconds] == list(seconds.values())  # timed: as measured
    assert by_n[3] == pytest.approx(2.0) and by_n[6] == pytest.approx(2.75)
    assert by_n[11] == pytest.approx(3.0 + 3 * 4.0 / 8)


@pytest.mark.parametrize("budget", [0.0, 1e9])
def test_the_context_is_built_once_and_passes_are_bounded(tiny_models, budget):
    """The model prefills PREFIX tokens once for the whole curve (it used to prefill the whole
    context once per size); then a warm-up pass and `reps` timed passes per timed size, no
    more: budget 0 times the floor at MIN_REPS, an unbounded one every size at MAX_REPS."""
    from mlx_spec import load_pair

    target = Counting(load_pair(target=str(tiny_models.target)).target)
    timer = PassTimer(target, 40, 16)
    assert target.calls == [PREFIX] and timer.prefilled == PREFIX
    assert {c.offset for c in caches._leaves(timer.cache)} == {40}  # the context, all there
    seconds, reps = time_passes(timer, PROBE_SIZES, budget)
    expected = (FLOOR, MIN_REPS) if budget == 0 else (PROBE_SIZES, MAX_REPS)
    assert (sorted(seconds), reps) == expected
    assert len(target.calls) == 1 + (reps + 1) * len(seconds) == 1 + timer.passes
    assert max(target.calls[1:]) == 16 and all(t > 0 for t in seconds.values())


@pytest.mark.parametrize("model", ["target", "mamba", "gemma3_text"])
def test_every_timed_pass_starts_from_the_same_context(tiny_models, tmp_path, model):
    """After many timed passes (attention layers trimmed, a recurrent state restored from
    its snapshot) a pass sees exactly the context it started from: its logits equal a fresh
    timer's first pass. The repeated context holds `context` positions in every attention
    layer (a sliding-window layer: its window and margin), as a full prefill does."""
    from mlx_spec import load_pair

    if model == "gemma3_text":  # sliding-window layers, past their window and compaction
        cfg = tiny.family_configs(VOCAB)[model]
        path = tiny.write_model(tmp_path, cfg, tiny.family_weights(cfg, 0), tiny_models.tokenizer)
    else:
        path = getattr(tiny_models, model)
    m = load_pair(target=str(path)).target
    context = 600
    timer = PassTimer(m, context, 16)
    time_passes(timer, PROBE_SIZES, 0.0)
    again = timer.model(timer.tokens[None, context : context + 4], cache=timer.cache)
    fresh, full = PassTimer(m, context, 16), PassTimer(m, context, 16, full=True)
    assert full.prefilled == context and fresh.prefilled == PREFIX
    layers = [caches._leaves(t.cache) for t in (fresh, full)]
    for a, b in zip(*layers, strict=True):
        assert type(a) is type(b)
        if not isinstance(a, ArraysCache):
            assert a.offset == b.offset == context and a.size() == b.size()
            assert a.keys_and_values()[0].shape == b.keys_and_values()[0].shape
    first = fresh.model(fresh.tokens[None, context : context + 4], cache=fresh.cache)
    assert mx.array_equal(again, first).item() and not mx.isnan(first).any().item()


def test_probe_within_a_tiny_budget_runs_the_floor_only(tiny_models):
    """`probe` with a budget it cannot meet: each model's context prefilled once, the target
    timed at the floor sizes, the draft's step at MIN_REPS, and the sample for α stops after
    MIN_SAMPLE_ROUNDS rounds — a bound counted in forward passes, whatever the clock says."""
    from mlx_spec import load_pair

    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    pair.target, pair.draft = Counting(pair.target), Counting(pair.draft)
    context = 96
    prompt = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": SAMPLE_PROMPT}], add_generation_prompt=True
    )
    assert len(prompt) - 1 != PREFIX  # the sample's prefill is told apart by its length
    r = run_probe(pair, context, 0.0, 200, progress=lambda _: None, budget=1e-6)
    for model in (pair.target, pair.draft):
        assert model.calls.count(PREFIX) == 1  # the context, built once
    assert (r.timed_sizes, r.repetitions) == (FLOOR, MIN_REPS)
    assert r.passes == (MIN_REPS + 1) * (len(FLOOR) + 1)  # target floor + the draft's step
    assert r.sample_rounds == MIN_SAMPLE_ROUNDS and r.sample_tokens < 200
    assert len(r.curve) == len(r.sizes) == 12 and r.curve[0] == 1.0
    out = r.to_json()
    assert out["timed_sizes"] == FLOOR and out["sample"]["rounds"] == MIN_SAMPLE_ROUNDS


def test_probe_budget_flag_is_checked(tiny_models, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.noisy)]
    for bad in ("0", "-3", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as exit_info:
            main(["probe", *pair, "--budget", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "argument --budget" in err


# ------------------------------------------------------ the real demo pair (SmolLM2 GGUF)


@pytest.fixture(scope="module")
def demo_pairs(tmp_path_factory):
    """The demo target with its shipped head (demo) and with its 4-bit self-draft (self),
    converted into a private cache (the user's is left alone)."""
    import os

    from mlx_spec import load_pair

    old = os.environ.get("MLX_SPEC_CACHE")
    os.environ["MLX_SPEC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield {"demo": load_pair("smollm2-demo"), "self": load_pair("smollm2-self")}
    finally:
        if old is None:
            del os.environ["MLX_SPEC_CACHE"]
        else:
            os.environ["MLX_SPEC_CACHE"] = old


@pytest.mark.real_model
def test_probe_on_the_self_draft_pair_is_bounded_in_passes(demo_pairs):
    """The demo pair with a budget it cannot meet: each model fed the PREFIX once to build
    its context, the floor of passes, and a sample cut at MIN_SAMPLE_ROUNDS rounds of the 48
    tokens asked for. Only the sample's prompt (once per model) is a call over 16 tokens."""
    import copy

    own = demo_pairs["self"]
    pair = copy.copy(own)
    pair.target, pair.draft = Counting(own.target), Counting(own.draft)
    r = run_probe(pair, 64, 0.0, 48, progress=lambda _: None, budget=1e-6)
    for model in (pair.target, pair.draft):
        assert model.calls[0] == PREFIX and len([n for n in model.calls if n > 16]) == 1
    assert (r.timed_sizes, r.repetitions, r.passes) == (FLOOR, MIN_REPS, 16)
    assert r.sample_rounds == MIN_SAMPLE_ROUNDS and r.sample_tokens < 48
    assert r.regime in ("memory-bound", "compute-bound", "in between") and 0 <= r.alpha <= 1


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["demo", "self"])
def test_the_demo_stats_line_quotes_no_unmeasured_acceptance(demo_pairs, name):
    """The demo's `auto` decides from timings, so what it does varies by machine; whatever it
    did, a reply with nothing drafted shows no acceptance figure — neither `acceptance N%`
    nor the controller's prior in the paused reason."""
    import re

    from mlx_spec import generate

    res = generate(
        demo_pairs[name], [{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, num_draft_tokens="auto",  # (the demo pair's own k is 1)
    )  # fmt: skip
    line, state = res.stats.summary(), res.stats.controller["state"]
    if res.stats.drafted == 0:
        assert (
            "acceptance –" in line
            and "acceptance not measured yet" in state
            or ("draft costs" in state and "acceptance" not in state)
        )
        assert not re.search(r"acceptance \d+%", line)
    else:
        assert f"acceptance {res.stats.acceptance_rate:.0%}" in line


def test_the_sample_for_alpha_goes_on_to_the_next_prompt(tiny_models, monkeypatch):
    """A reply that ends before --sample-tokens hands the sample to the next prompt (bench's
    built-in ones, in turn): the demo answered the sample prompt in 47 tokens whatever was
    asked, and its α was that one reply's."""
    from mlx_spec import load_pair
    from mlx_spec.commands.probe import sample_acceptance
    from mlx_spec.decode import generate
    from mlx_spec.measure.benchmark import PROMPTS

    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    real, asked, longest = generate.stream_rounds, [], [5]

    def short_replies(pair, prompt, config, **kwargs):  # every reply ends after 5 tokens
        asked.append(prompt[0]["content"])
        config = config.replace(max_tokens=min(config.max_tokens, longest[0]))
        return real(pair, prompt, config, **kwargs)

    monkeypatch.setattr(generate, "stream_rounds", short_replies)
    stats = sample_acceptance(pair, 0.0, 12, float("inf"), time.perf_counter, k=2)
    assert asked == [SAMPLE_PROMPT, PROMPTS["chat"], PROMPTS["code"]]
    assert stats.generated_tokens == 12 and stats.drafted > 0
    asked.clear()  # past the deadline, once it ran the rounds it must: no other prompt
    longest[0] = 100
    stats = sample_acceptance(pair, 0.0, 100, float("-inf"), time.perf_counter, k=2)
    assert asked == [SAMPLE_PROMPT] and stats.target_passes == MIN_SAMPLE_ROUNDS
