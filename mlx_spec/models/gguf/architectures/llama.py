"""Llama (1-3, SmolLM, TinyLlama, Mistral-style): the base layout, with the Q/K rows that
llama.cpp's converter permutes, and Llama 3.1+'s rope_freqs."""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

from .base import Architecture


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders the rows of llama's Q and K projections so each head's
    rotary pairs are adjacent (ggml's "normal" rope rotates pairs (2i, 2i+1)); this undoes it,
    giving the Hugging Face layout that mlx-lm's (non-traditional) rope expects:
    original row r = stored row index[r]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


class Llama(Architecture):
    name = model_type = "llama"
    optional = Architecture.optional | {"rope_freqs.weight"}

    def sanitize(self, gguf_name: str, arrays: list[mx.array]) -> list[mx.array]:
        if not re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", gguf_name):
            return arrays
        heads = self["attention.head_count"]
        if ".attn_k." in gguf_name:
            heads = self.get("attention.head_count_kv", heads)
        rows = mx.array(unpermute_rows(arrays[0].shape[0], heads))
        return [a[rows] for a in arrays]
