"""Gemma 3 (text): four norms per layer stored as 1 + w, Q/K norms, sliding-window layers."""

from __future__ import annotations

import mlx.core as mx

from .base import LINEAR, QK_NORM, Architecture


class Gemma3(Architecture):
    name = "gemma3"
    model_type = "gemma3_text"
    blocks = (
        LINEAR
        | QK_NORM
        | {
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        }
    )
    required = ("attention.sliding_window",)

    def sanitize(self, gguf_name: str, arrays: list[mx.array]) -> list[mx.array]:
        if gguf_name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norm weights as 1 + w; mlx-lm's norm adds the 1
            return [arrays[0].astype(mx.float32) - 1]
        return arrays

    def config(self, rope_freqs, tied: bool) -> dict:
        config = super().config(rope_freqs, tied)
        hidden, heads = self["embedding_length"], self["attention.head_count"]
        # llama.cpp: the 27B model (62 layers) scales queries by hidden/heads, the others by
        # the head size; every sixth layer is global, the others slide with base 10000
        scalar = hidden // heads if self["block_count"] == 62 else config["head_dim"]
        return config | {
            "query_pre_attn_scalar": scalar,
            "sliding_window": self["attention.sliding_window"],
            "sliding_window_pattern": self.get("attention.sliding_window_pattern", 6),
            "rope_local_base_freq": 10000.0,
            "rope_theta": self.get("rope.freq_base", 1_000_000.0),
        }
