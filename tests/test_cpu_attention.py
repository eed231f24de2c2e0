"""Attention with NumPy's softmax on MLX's CPU backend (runtime/cpu_attention.py): the same
numbers as MLX's own path for every mask mlx-lm and the batch caches pass, MLX's path where it
does not apply, and lossless decoding through it on every family and in a batch."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import pytest
import tiny
from test_batch import TEXTS
from test_families import FAMILIES, family_dirs, pairs, prompt_ids, reference  # noqa: F401

from mlx_spec import batch_generate, generate, load_pair
from mlx_spec.runtime import cpu_attention

MLX = cpu_attention._mlx_attention


@pytest.fixture
def every_call(monkeypatch):
    """The NumPy path for every call, however small (tiny models' contexts are short)."""
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", cpu_attention.attention)


def masks(batch: int, heads: int, queries: int, keys: int) -> dict:
    mx.random.seed(1)
    rows = mx.random.uniform(shape=(batch, 1, queries, keys)) > 0.3
    # a row masked everywhere: a batch's left padding (MLX averages the values there)
    rows = mx.concatenate([mx.zeros((batch, 1, 1, keys), mx.bool_), rows[:, :, 1:]], axis=2)
    return {
        "none": None,
        "causal": "causal",
        "rows (B, 1, L, S)": rows,
        "heads (B, H, L, S)": mx.random.uniform(shape=(batch, heads, queries, keys)) > 0.5,
        "additive": mx.where(rows, 0.0, -1e9),
        "(L, S)": mx.random.uniform(shape=(queries, keys)) > 0.2,
    }


@pytest.mark.parametrize(
    "shape",  # batch, query heads, KV heads, queries, keys, the values' width
    [
        (1, 9, 3, 256, 300, 16),
        (2, 4, 2, 17, 100, 16),
        (1, 4, 4, 1, 50, 16),
        (3, 8, 2, 5, 5, 16),
        (1, 4, 4, 9, 40, 8),
    ],  # fmt: skip  (the last: MLA's values narrower than its keys)
)
def test_same_numbers_as_mlx_for_every_mask(every_call, shape):
    batch, heads, kv_heads, queries, keys, width = shape
    mx.random.seed(0)
    q = mx.random.normal((batch, heads, queries, 16))
    k = mx.random.normal((batch, kv_heads, keys + 7, 16))[..., :keys, :]  # a cache's view
    v = mx.random.normal((batch, kv_heads, keys, width))
    for name, mask in masks(batch, heads, queries, keys).items():
        ours = cpu_attention.attention(q, k, v, scale=0.25, mask=mask)
        theirs = MLX(q, k, v, scale=0.25, mask=mask)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert mx.allclose(ours, theirs, atol=2e-6, rtol=1e-5).item(), name
        assert mx.all(mx.isfinite(ours)).item(), name


def test_mlx_own_path_where_numpy_does_not_apply(every_call):
    q = mx.random.normal((1, 4, 3, 8))
    k = mx.random.normal((1, 2, 6, 8))
    v = mx.random.normal((1, 2, 6, 8))
    half = [a.astype(mx.float16) for a in (q, k, v)]
    sinks = mx.zeros((4,))
    cases = [
        ((*half,), {"mask": "causal"}),  # not float32
        ((q, k, v), {"mask": None, "sinks": sinks}),  # attention sinks
        ((mx.random.normal((1, 4, 8, 8)), k, v), {"mask": "causal"}),  # more queries than keys
        ((q, k, v), {"mask": mx.ones((1, 3, 6), mx.bool_)}),  # a 3-d mask
    ]
    for args, kwargs in cases:
        assert mx.array_equal(
            cpu_attention.attention(*args, scale=0.3, **kwargs), MLX(*args, scale=0.3, **kwargs)
        ).item()


def test_small_calls_keep_mlx_path_and_large_ones_take_numpys(monkeypatch):
    """The thresholds as documented: below MIN_SCORES scores MLX's own path (bit for bit),
    from it NumPy's; over MIN_KEYS keys or more NumPy's from MIN_LONG_SCORES."""
    taken = []
    softmax = cpu_attention._softmax_in_place
    monkeypatch.setattr(
        cpu_attention, "_softmax_in_place", lambda *a: taken.append(1) or softmax(*a)
    )
    width, long_keys = 8, cpu_attention.MIN_KEYS
    long_heads = cpu_attention.MIN_LONG_SCORES // long_keys
    assert long_heads * long_keys == cpu_attention.MIN_LONG_SCORES
    short = long_keys - 1  # keys below MIN_KEYS: MIN_SCORES decides, reached with queries
    queries = -(-cpu_attention.MIN_SCORES // (4 * short))  # the fewest that reach it
    for heads, rows, keys, numpy in (
        (4, 1, short, False),
        (4, queries - 1, short, False),
        (4, queries, short, True),
        (long_heads - 1, 1, long_keys, False),  # long keys, too few scores
        (long_heads, 1, long_keys, True),
        (long_heads, 1, long_keys - 1, False),
    ):
        taken.clear()
        q = mx.random.normal((1, heads, rows, width))
        k, v = mx.random.normal((2, 1, 1, keys, width))
        ours = cpu_attention.attention(q, k, v, scale=0.3)
        assert bool(taken) == numpy, (heads, rows, keys)
        assert mx.allclose(ours, MLX(q, k, v, scale=0.3), atol=2e-6).item()
        if not numpy:
            assert mx.array_equal(ours, MLX(q, k, v, scale=0.3)).item()


def test_under_compile_a_bfloat16_mask_or_another_mask_name_as_mlx(every_call):
    q = mx.random.normal((1, 4, 3, 8))
    k = mx.random.normal((1, 2, 6, 8))
    v = mx.random.normal((1, 2, 6, 8))
    compiled = mx.compile(
        lambda q, k, v: cpu_attention.attention(q, k, v, scale=0.3, mask="causal")
    )
    assert mx.allclose(compiled(q, k, v), MLX(q, k, v, scale=0.3, mask="causal"), atol=2e-6).item()
    half = mx.where(mx.random.uniform(shape=(3, 6)) > 0.3, 0.0, -1e4).astype(mx.bfloat16)
    ours = cpu_attention.attention(q, k, v, scale=0.3, mask=half)
    assert mx.allclose(ours, MLX(q, k, v, scale=0.3, mask=half), atol=2e-6).item()
    with pytest.raises(ValueError):  # what MLX says of a mask name it does not know
        cpu_attention.attention(q, k, v, scale=0.3, mask="sliding")


def test_installed_by_load_pair_on_the_cpu_and_turned_off_by_the_environment(tiny_models):
    load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    assert mx.fast.scaled_dot_product_attention is cpu_attention.attention  # no GPU here
    assert cpu_attention.install()  # idempotent
    script = (
        "import mlx_spec, mlx.core as mx\n"
        "from mlx_spec.runtime import cpu_attention\n"
        f"mlx_spec.load_pair(target={str(tiny_models.target)!r})\n"
        "print(mx.fast.scaled_dot_product_attention is cpu_attention.attention)\n"
    )
    env = {**os.environ, "MLX_SPEC_CPU_ATTENTION": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_greedy_through_numpy_equals_mlx_alone(pairs, monkeypatch, family):  # noqa: F811
    """mlx-lm's greedy run of the target on MLX's own attention; the speculative run with
    every attention call (sliding windows' masks, the verify passes) through NumPy."""
    pair = pairs(family)
    prompt = prompt_ids(pair)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", MLX)
    expected = reference(pair, prompt, 5 * tiny.WINDOW)
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", cpu_attention.attention)
    res = generate(pair, prompt, max_tokens=5 * tiny.WINDOW, num_draft_tokens=3)
    assert res.tokens == expected
    assert res.stats.accepted > 0


def test_a_batch_through_numpy_equals_each_prompt_alone_on_mlx(pair, monkeypatch):
    """The batch's rows (left padding: rows masked everywhere, boolean masks) through the
    NumPy path; each prompt alone, without drafts, on MLX's."""
    prompts = TEXTS[:3] + [[7], TEXTS[4]]
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", MLX)
    expected = [generate(pair, p, max_tokens=24, use_draft=False).tokens for p in prompts]
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", cpu_attention.attention)
    results = batch_generate(pair, prompts, max_tokens=24, num_draft_tokens=3, max_batch=2)
    assert [r.tokens for r in results] == expected
    assert sum(r.stats.accepted for r in results) > 0
