"""Small files for the hostile-input tests: a tiny valid llama GGUF written by hand (F32 tensors,
a byte-level vocabulary), so tests can break it in every way without the 93 MB demo file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 32, 2, 1, 64, 1


def byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes: a complete byte-level vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    table = dict(zip(keep, chars, strict=True))
    return [chr(table[b]) for b in range(256)]


def tiny_metadata(**overrides) -> dict:
    tokens = byte_tokens() + ["<|endoftext|>"]
    meta = {
        "general.architecture": ("str", "llama"),
        "llama.block_count": ("u32", LAYERS),
        "llama.context_length": ("u32", 256),
        "llama.embedding_length": ("u32", HIDDEN),
        "llama.feed_forward_length": ("u32", FF),
        "llama.attention.head_count": ("u32", HEADS),
        "llama.attention.head_count_kv": ("u32", KV_HEADS),
        "llama.rope.freq_base": ("f32", 10000.0),
        "llama.attention.layer_norm_rms_epsilon": ("f32", 1e-5),
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.tokens": ("strs", tokens),
        "tokenizer.ggml.token_type": ("i32s", [1] * 256 + [3]),
        "tokenizer.ggml.merges": ("strs", []),
        "tokenizer.ggml.eos_token_id": ("u32", 256),
    }
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return meta


def tiny_tensors(vocab: int = 257, layers: int = LAYERS, seed: int = 0) -> dict[str, np.ndarray]:
    """numpy shapes as mlx sees them: (out, in)."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
            f"blk.{i}.ffn_gate.weight": (FF, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FF, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FF),
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
        }
    return {k: (rng.standard_normal(s) * 0.1).astype(np.float32) for k, s in shapes.items()}


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(kind: str, value) -> bytes:
    if kind == "str":
        return struct.pack("<I", 8) + _string(value)
    if kind == "u32":
        return struct.pack("<II", 4, value)
    if kind == "f32":
        return struct.pack("<If", 6, value)
    if kind == "strs":
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
    if kind == "i32s":
        return struct.pack("<IIQ", 9, 5, len(value)) + struct.pack(f"<{len(value)}i", *value)
    raise ValueError(kind)


def write_gguf(path: Path, meta: dict | None = None, tensors: dict | None = None) -> Path:
    """A GGUF v3 file: header, metadata, tensor table, 32-byte aligned F32 data."""
    meta = tiny_metadata() if meta is None else meta
    tensors = tiny_tensors() if tensors is None else tensors
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
    for key, (kind, value) in meta.items():
        out += _string(key) + _value(kind, value)
    offset, blobs = 0, []
    for name, array in tensors.items():
        dims = tuple(reversed(array.shape))  # GGUF lists the fastest dimension first
        out += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, 0, offset)
        blob = array.astype(np.float32).tobytes()
        blob += b"\0" * (-len(blob) % 32)
        blobs.append(blob)
        offset += len(blob)
    out += b"\0" * (-len(out) % 32)
    path.write_bytes(bytes(out) + b"".join(blobs))
    return path
