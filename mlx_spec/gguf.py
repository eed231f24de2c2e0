"""GGUF files as a model source: convert once into the mlx-lm layout, then reuse.

MLX reads GGUF itself (`mx.load(path, return_metadata=True)`); Q4_0, Q4_1 and Q8_0 tensors
arrive as MLX-quantized arrays (weight, scales, biases; blocks of 32). This module renames
tensors to mlx-lm's llama layout, writes config.json with the quantization of each tensor,
and builds a Hugging Face tokenizer from the `tokenizer.ggml.*` metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from .errors import SpecError

GGUF_BLOCK = 32  # Q4_0 / Q4_1 / Q8_0 quantize blocks of 32 weights
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
SUPPORTED_ARCHITECTURES = ("llama",)


def cache_root() -> Path:
    env = os.environ.get("MLX_SPEC_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base if env else base / "mlx-spec") / "gguf"


def default_dtype() -> str:
    """Float precision for a dequantized model: float16 on Metal; float32 on the CPU backend,
    where float16 matmuls are slow and compute-bound."""
    return "float16" if mx.metal.is_available() else "float32"


def file_digest(path: Path) -> str:
    """sha256 of the file, remembered per (path, size, mtime) so big files hash once."""
    stat = path.stat()
    index_path = cache_root() / "digests.json"
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key not in index:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        index[key] = h.hexdigest()
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        tmp.replace(index_path)
    return index[key]


def converted_path(gguf: Path, dtype: str | None = None) -> Path:
    """The mlx-lm directory for `gguf` (quantized as in the file, or dequantized to `dtype`),
    converting on first use."""
    out = cache_root() / f"{file_digest(gguf)[:16]}-{dtype or 'q'}"
    if not (out / "config.json").is_file():
        convert(gguf, out, dtype)
    return out


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _mlx_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / scales / biases / bias
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{suffix}"
    if stem in TENSOR_NAMES:
        return f"{TENSOR_NAMES[stem]}.{suffix}"
    raise SpecError(f"unsupported GGUF tensor {gguf_name!r}")


def _quant_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per weight from packed shapes: weight (out, in*bits/32) uint32, scales (out, in/32)."""
    bits, rem = divmod(weight.shape[-1], scales.shape[-1])
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise SpecError(f"unsupported GGUF quantization (shapes {weight.shape}, {scales.shape})")
    return bits


def _config(meta: dict, weights: dict, quantization: dict | None) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise SpecError(f"unsupported GGUF architecture {arch!r} (supported: {supported})")
    hidden = _scalar(meta, f"{arch}.embedding_length")
    heads = _scalar(meta, f"{arch}.attention.head_count")
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(meta, f"{arch}.block_count"),
        "intermediate_size": _scalar(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _scalar(meta, f"{arch}.rope.dimension_count", hidden // heads),
        "rms_norm_eps": _scalar(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _scalar(meta, f"{arch}.rope.freq_base", 10000.0),
        # llama.cpp stores Q/K for the interleaved ("traditional") rotary layout
        "rope_traditional": True,
        "max_position_embeddings": _scalar(meta, f"{arch}.context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    if quantization:
        config["quantization"] = quantization
    return config


def _weights(tensors: dict, dtype: str | None) -> tuple[dict, dict | None]:
    """Renamed weights, and the per-layer quantization table (None when dequantized)."""
    renamed = {_mlx_name(k): v for k, v in tensors.items()}
    layers = {}
    for name in [n for n in renamed if n.endswith(".scales")]:
        module = name.removesuffix(".scales")
        weight, scales = renamed[f"{module}.weight"], renamed[name]
        if f"{module}.biases" not in renamed:
            raise SpecError(f"unsupported GGUF quantization of {module} (no biases)")
        layers[module] = {"group_size": GGUF_BLOCK, "bits": _quant_bits(weight, scales)}
    if dtype is None:
        if not layers:
            return renamed, None
        common = max(layers.values(), key=list(layers.values()).count)
        return renamed, {**common, **layers}
    target = DTYPES[dtype]
    out = {}
    for name, value in renamed.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("scales", "biases"):
            continue
        if module in layers:
            q = layers[module]
            value = mx.dequantize(
                value,
                renamed[f"{module}.scales"],
                renamed[f"{module}.biases"],
                q["group_size"],
                q["bits"],
            )
        out[name] = value.astype(target)
    return out, None


def write_tokenizer(meta: dict, out: Path) -> None:
    """A Hugging Face fast tokenizer from `tokenizer.ggml.*` (byte-level BPE with merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecError(f"unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # GPT-2's pre-tokenizer; SmolLM's "pre" splits digits one by one first
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "qwen2", "llama-bpe"):
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]  # 3: control token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        i = _scalar(meta, key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
    )
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        fast.chat_template = template
    fast.save_pretrained(str(out))


def convert(gguf: Path, out: Path, dtype: str | None = None) -> Path:
    """Write the mlx-lm layout of `gguf` to `out`, atomically: all of it or nothing."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise SpecError(f"GGUF file does not exist: {gguf}")
    if dtype is not None and dtype not in DTYPES:
        raise SpecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError) as err:
        raise SpecError(f"cannot read GGUF file {gguf}: {err}") from err
    weights, quantization = _weights(tensors, dtype)
    config = _config(meta, weights, quantization)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        write_tokenizer(meta, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
