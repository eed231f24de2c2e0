"""probe and bench: the regime classifier on synthetic curves, and the plumbing on tiny models."""

from __future__ import annotations

import json

import pytest

from mlx_spec.bench import format_rows, run_bench, summarise
from mlx_spec.cli import main
from mlx_spec.probe import (
    classify_regime,
    estimate_alpha,
    expected_tokens,
    predict,
    verdict,
)

SIZES = list(range(1, 17))


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
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    # α=0.5, k=2: 1 + 0.5 + 0.25
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


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


def test_bench_picks_built_in_prompts(tiny_models, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.noisy)]
    args = ["--k", "auto", "--temps", "0", "--runs", "1", "--max-tokens", "4", "--json"]
    assert main(["bench", *pair, "--only", "summarisation,code edit", *args]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert {r["prompt"] for r in runs} == {"summarisation", "code edit"}
