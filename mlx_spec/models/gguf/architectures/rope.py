"""Rope scaling: mlx-lm's `rope_scaling` from what the file stores."""

from __future__ import annotations

import math

import numpy as np

from ....errors import SpecError

SCALING_TYPES = ("none", "linear", "yarn")  # <arch>.rope.scaling.type


def rope_scaling(meta: dict, arch: str, rope_freqs: np.ndarray | None, head_dim: int):
    """mlx-lm's rope_scaling for the file: llama.cpp stores Llama 3.1+'s "llama3" scaling as
    per-dimension factors (`rope_freqs`), others as rope.scaling.* metadata."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", 1.0)
    if rope_freqs is not None:
        factors = rope_freqs.astype(np.float64)
        if not np.all(np.isfinite(factors)) or factors.min() <= 0:
            raise SpecError("rope_freqs holds factors that are not positive numbers")
        if np.all(factors == 1.0):
            return None
        return _llama3_scaling(meta, arch, factors, head_dim)
    if kind == "linear" and factor != 1.0:
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        scaling = {"type": "yarn", "factor": float(factor)}
        if isinstance(original, int) and original > 0:
            scaling["original_max_position_embeddings"] = original
        return scaling
    return None


def _llama3_scaling(meta: dict, arch: str, factors: np.ndarray, head_dim: int) -> dict:
    """Llama 3.1-3.3 all use factor f, low/high frequency factors 1 and 4 and an original
    context of 8192; when the stored factors are exactly those, say so ("llama3"); otherwise
    carry the factors themselves (mlx-lm's per-dimension factor rope, at scale 1)."""
    base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    factor = float(factors.max())
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    low, high, old = 1.0, 4.0, 8192
    smooth = (old / wavelen - low) / (high - low)
    expect = np.where(
        wavelen < old / high,
        1.0,
        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if np.allclose(expect, factors, rtol=1e-5, atol=0):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": old}  # fmt: skip
    context = meta[f"{arch}.context_length"]
    return {"rope_type": "longrope", "long_factor": factors.tolist(),
            "short_factor": factors.tolist(),
            "original_max_position_embeddings": context}  # fmt: skip
