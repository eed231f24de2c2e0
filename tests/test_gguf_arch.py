"""GGUF files as people have them (issue 17): llama / qwen2 / qwen3 / gemma3, float, legacy and
K-quant tensors, written in code with the `gguf` package and compared with the same weights
loaded the mlx-lm way (tests/gguf_tiny.py builds both sides)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from gguf_tiny import random_k_blocks, write_tiny
from mlx_lm.utils import load_model

import mlx_spec.models.gguf as mg
from mlx_spec import generate, load_pair
from mlx_spec.cli import main
from mlx_spec.errors import SpecError
from mlx_spec.models.gguf import quants as gq
from mlx_spec.models.gguf.architectures import architecture, llama

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 101, 32,
          113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110]  # fmt: skip
# largest |logit| difference allowed against the reference, per tensor type: exact formats
# differ by float rounding only; kept-quantized ones by their float16 scales and biases;
# Q6_K / Q3_K / Q2_K are re-quantized to MLX groups of 32 (8 / 5 / 4 bits)
TOLERANCE = {"F32": 1e-4, "F16": 1e-3, "BF16": 1e-3, "Q8_0": 2e-2, "Q4_0": 2e-2, "Q4_1": 2e-2,
             "Q5_0": 2e-2, "Q5_1": 2e-2, "Q4_K": 2e-2, "Q5_K": 2e-2, "Q6_K": 0.1,
             "Q4_K_M": 0.15, "Q5_K_M": 0.15, "Q3_K": 0.6, "Q2_K": 0.6}  # fmt: skip
MEASURED: dict[str, tuple] = {}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))


# --- the block decoders against the gguf package's independent numpy dequantization ---------


@pytest.mark.parametrize(
    "name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
)
def test_decoder_equals_gguf_dequantize(name):
    rng = np.random.default_rng(1)
    qt = T[name]
    rows, cols = 8, 512
    if name.endswith("_K"):
        data = random_k_blocks(qt, rows, cols, rng)
    else:
        data = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt)
    expected = dequantize(data, qt).reshape(rows, cols)
    affine = gq.decode(name, data.reshape(-1), (rows, cols))
    assert affine.bits == {"Q8_0": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q3_K": 3,
                           "Q2_K": 2}.get(name, 4)  # fmt: skip
    assert affine.q.max() < 2**affine.bits
    got = affine.dequantize()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    ggml = gq.BY_NAME[name]  # the one block table: the gguf package's ids and sizes
    assert GGML_QUANT_SIZES[qt] == (ggml.block, ggml.nbytes) and gq.GGML_TYPES[qt.value] == ggml


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlx_affine_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, (4, 256), dtype=np.uint8)
    packed = mx.array(gq.pack(q, bits))
    ones = mx.ones((4, 256 // 32), mx.float32)
    got = mx.dequantize(packed, ones, mx.zeros_like(ones), group_size=32, bits=bits)
    assert np.array_equal(np.array(got), q.astype(np.float32))


# --- whole models against mlx-lm loading the same weights ------------------------------------


def logits(model, ids) -> np.ndarray:
    return np.array(model(mx.array(ids)[None]).astype(mx.float32))[0]


def greedy(model, ids, n=10) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(np.argmax(logits(model, ids)[-1])))
        ids.append(out[-1])
    return out


def convert(tiny, tmp_path, dtype=None):
    lines = []
    out = mg.convert(tiny.gguf, tmp_path / f"out-{tiny.gguf.stem}-{dtype}", dtype, lines.append)
    assert len(lines) == 1
    return out, lines[0]


CASES = [(a, q) for a in ("llama", "qwen2", "qwen3", "gemma3")
         for q in ("F32", "F16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")]  # fmt: skip
CASES += [("llama", q) for q in ("BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                                  "Q5_K_M")]  # fmt: skip


@pytest.mark.parametrize("arch,qtype", CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_converted_model_equals_mlx_lm_reference(tmp_path, arch, qtype):
    tiny = write_tiny(tmp_path, arch, qtype)
    out, line = convert(tiny, tmp_path)
    model, config = load_model(out)
    ref, _ = load_model(tiny.ref)
    assert type(model) is type(ref) and config["model_type"] == ref.model_type
    expected = logits(ref, PROMPT)
    diff = np.abs(logits(model, PROMPT) - expected).max()
    print(f"[logit std {expected.std():.2f} max {np.abs(expected).max():.1f}]", end=" ")
    weights = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    ratio = weights / tiny.gguf.stat().st_size
    MEASURED[f"{arch}-{qtype}"] = (diff, ratio, line)
    print(f"{arch} {qtype}: max |logit diff| {diff:.2e}; {ratio:.2f}x the file; {line}")
    assert diff <= TOLERANCE[qtype]
    if TOLERANCE[qtype] <= 2e-2:  # close enough that the greedy choices cannot differ here
        assert greedy(model, PROMPT) == greedy(ref, PROMPT)
    quant = config.get("quantization")
    if qtype in ("F32", "F16", "BF16"):
        assert quant is None
    else:  # kept compact: never a float16 blow-up
        requantized = qtype in ("Q6_K", "Q3_K", "Q2_K") or qtype.endswith("_K_M")
        assert quant is not None and ratio < (2.0 if requantized else 1.15)
        expect = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5,
                  "Q6_K": 8, "Q3_K": 5, "Q2_K": 4, "Q4_K_M": 4, "Q5_K_M": 5}[qtype]  # fmt: skip
        q_proj = "model.layers.0.self_attn.q_proj"
        assert quant[q_proj] == {"group_size": 32, "bits": expect}
        if qtype.endswith("_K_M"):  # the Q6_K tensors of the mix: 8 bits
            assert quant["model.layers.0.self_attn.v_proj"]["bits"] == 8


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_dtype_dequantizes_exactly(tmp_path, qtype):
    tiny = write_tiny(tmp_path, "qwen3", qtype)
    out, line = convert(tiny, tmp_path, "float32")
    model, config = load_model(out)
    ref, _ = load_model(tiny.ref)
    assert "quantization" not in config and "float32" in line
    assert np.abs(logits(model, PROMPT) - logits(ref, PROMPT)).max() < 1e-4


def test_report_line_names_each_format_and_the_memory(tmp_path):
    tiny = write_tiny(tmp_path, "llama", "Q4_K_M")
    _, line = convert(tiny, tmp_path)
    assert "Q4_K -> 4-bit group 32" in line and "Q6_K -> 8-bit group 32 (re-quantized)" in line
    assert "F32 -> float32" in line and "MB in memory" in line and "file" in line


def test_convert_command_prints_the_format_once(tmp_path, capsys):
    tiny = write_tiny(tmp_path, "qwen2", "Q5_K")
    assert main(["convert", str(tiny.gguf), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("MB in memory") == 1 and "Q5_K -> 5-bit group 32" in printed


def test_rotary_layout_is_checked(tmp_path, monkeypatch):
    """The test above can fail: leaving llama's Q/K rows as the file stores them (or treating a
    NEOX family as permuted) changes the logits far beyond the tolerance."""
    tiny = write_tiny(tmp_path, "llama", "F32")
    ref, _ = load_model(tiny.ref)
    monkeypatch.setattr(llama, "unpermute_rows", lambda rows, heads: np.arange(rows))
    model, _ = load_model(convert(tiny, tmp_path)[0])
    assert np.abs(logits(model, PROMPT) - logits(ref, PROMPT)).max() > 1e-2


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize(
    "scaling,expect",
    [
        (LLAMA3, "llama3"),
        ({**LLAMA3, "factor": 32.0}, "llama3"),
        ({**LLAMA3, "original_max_position_embeddings": 64}, "longrope"),
    ],  # fmt: skip
)
def test_llama3_rope_freqs(tmp_path, scaling, expect):
    """Llama 3.1+ files carry their rope scaling as the rope_freqs tensor (llama.cpp's
    generate_extra_tensors); the converted model must rotate exactly as the original."""
    tiny = write_tiny(tmp_path, "llama", "Q8_0", rope_scaling=scaling)
    out, _ = convert(tiny, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == expect
    model, _ = load_model(out)
    ref, _ = load_model(tiny.ref)
    long = PROMPT * 4
    assert np.abs(logits(model, long) - logits(ref, long)).max() < TOLERANCE["Q8_0"]


@pytest.mark.parametrize(
    "arch,scaling",
    [
        ("gemma3", {"type": "linear", "factor": 8.0}),  # Gemma 3 4B and up
        ("qwen2", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ],
)
def test_rope_scaling_metadata(tmp_path, arch, scaling):
    tiny = write_tiny(tmp_path, arch, "F16", rope_scaling=scaling)
    out, _ = convert(tiny, tmp_path)
    model, _ = load_model(out)
    ref, _ = load_model(tiny.ref)
    long = PROMPT * 4  # past the original context of the yarn case
    assert np.abs(logits(model, long) - logits(ref, long)).max() < TOLERANCE["F16"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embeddings(tmp_path, arch):
    """SmolLM, Llama 3.2 1B/3B and small Qwen 2.5 files have no output.weight."""
    tiny = write_tiny(tmp_path, arch, "Q8_0", tied=True)
    out, _ = convert(tiny, tmp_path)
    model, config = load_model(out)
    ref, _ = load_model(tiny.ref)
    assert config["tie_word_embeddings"] and "lm_head" not in dict(model.named_modules())
    assert np.abs(logits(model, PROMPT) - logits(ref, PROMPT)).max() < TOLERANCE["Q8_0"]


def test_gemma3_27b_query_scale():
    """llama.cpp scales Gemma 3 27B's queries by hidden/heads (168), the others by head size."""
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 5376,
            "gemma3.attention.head_count": 32, "gemma3.block_count": 62,
            "gemma3.feed_forward_length": 21504, "gemma3.context_length": 131072,
            "gemma3.attention.key_length": 128, "gemma3.attention.sliding_window": 1024,
            "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.token_type": [1]}  # fmt: skip
    gemma3 = architecture(meta, "x")
    assert gemma3.config(None, tied=True)["query_pre_attn_scalar"] == 168
    meta["gemma3.block_count"] = 34  # 4B: head size
    assert gemma3.config(None, tied=True)["query_pre_attn_scalar"] == 128


# --- through load_pair and the engine: plain, self-draft, prompt lookup -----------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_speculation_on_a_k_quant_gguf_is_lossless(tmp_path, arch):
    tiny = write_tiny(tmp_path, arch, "Q4_K_M")
    ref, _ = load_model(tiny.ref)
    plain = load_pair(target=str(tiny.gguf))
    expected = generate(plain, PROMPT, max_tokens=12).tokens
    # the converted model decodes as the mlx-lm reference does
    assert expected == greedy(ref, PROMPT, len(expected))
    for kwargs in ({"draft_bits": 4}, {"drafter": "ngram"}):
        pair = load_pair(target=str(tiny.gguf), **kwargs)
        for k in (1, 3):
            res = generate(pair, PROMPT, max_tokens=12, num_draft_tokens=k)
            assert res.tokens == expected, (kwargs, k)


def test_sentencepiece_llama_generates_text(tmp_path):
    """A Llama 2 / TinyLlama-style file: llama architecture, SentencePiece vocabulary."""
    tiny = write_tiny(tmp_path, "llama", "Q4_K", spm=True)
    pair = load_pair(target=str(tiny.gguf), drafter="ngram")
    assert pair.tokenizer.encode("the cat")[0] == 2  # add_bos_token: <bos> first
    res = generate(pair, "the cat", max_tokens=8, num_draft_tokens=2)
    plain = generate(load_pair(target=str(tiny.gguf)), "the cat", max_tokens=8)
    assert res.tokens == plain.tokens and len(res.tokens) >= 1


def test_cli_generate_with_draft_bits(tmp_path, capsys):
    tiny = write_tiny(tmp_path, "qwen3", "Q6_K")
    argv = ["generate", "--target", str(tiny.gguf), "--draft-bits", "4", "--raw",
            "--max-tokens", "4", "--json", "hi"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert json.loads(captured.out)["stats"]["generated_tokens"] >= 1
    assert captured.err.count("MB in memory") == 1  # converted once, said once


# --- what the validator refuses ---------------------------------------------------------------


def test_unknown_pre_tokenizer_is_one_line(tmp_path, capsys):
    tiny = write_tiny(tmp_path, "qwen2", "F16", pre="made-up")
    assert main(["generate", "--target", str(tiny.gguf), "hi"]) == 2
    err = capsys.readouterr().err
    assert "unsupported pre-tokenizer" in err and "made-up" in err and err.count("\n") == 1


def test_qwen3_without_qk_norm_is_refused(tmp_path, capsys):
    import gguf

    tiny = write_tiny(tmp_path, "qwen3", "F16")
    reader = gguf.GGUFReader(str(tiny.gguf))
    names = [t.name for t in reader.tensors]
    assert "blk.1.attn_k_norm.weight" in names
    info = mg.read_gguf_info(tiny.gguf)
    del info.tensors["blk.1.attn_k_norm.weight"]
    with pytest.raises(SpecError, match="attn_k_norm.weight is missing"):
        mg.check_model_metadata(info, "x")
    info.meta["general.architecture"] = "llama"
    for key in [k for k in info.meta if k.startswith("qwen3.")]:
        info.meta["llama." + key.removeprefix("qwen3.")] = info.meta.pop(key)
    with pytest.raises(SpecError, match="unsupported GGUF tensor"):
        mg.check_model_metadata(info, "x")


def test_bad_rope_freqs_is_one_line(tmp_path, monkeypatch, capsys):
    import gguf_tiny

    monkeypatch.setattr(gguf_tiny, "llama3_factors", lambda *a: np.zeros(32, np.float32))
    tiny = write_tiny(tmp_path, "llama", "F16", rope_scaling=LLAMA3)
    assert main(["convert", str(tiny.gguf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rope_freqs" in err and str(tiny.gguf) in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
