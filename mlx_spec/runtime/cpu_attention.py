"""Attention on MLX's CPU backend with NumPy's softmax.

MLX's CPU backend has no fused attention: `mx.fast.scaled_dot_product_attention` falls back to
matmuls and a softmax whose `exp` is scalar, ~14 ns an element on this project's x86-64 CPU
against NumPy's vectorised 2.6 ns (2026-12-07). At a few thousand tokens of context the softmax
is most of a forward pass: a 256-token prefill chunk of the demo target (SmolLM2-135M, 9 query /
3 KV heads) at 4,096 tokens of context spent 191 ms a layer in attention, where its MLP's matmuls
run at 120-170 GFLOP/s; a 17-token verify pass at 4,800 tokens 14.7 ms a layer against one
token's 2.3 ms, which made long drafts dear at agent-sized contexts on this CPU and on no Mac.

Here the scores (q @ k^T, grouped-query heads as one matmul per KV head) are evaluated, the
mask and the softmax are applied in place in NumPy, and the probabilities go back to MLX for the
product with the values: 2-3.7x faster at those sizes (benchmarks in docs/performance.md).
It is installed only where MLX has no GPU (`install`, called by `load_pair`): on Metal and CUDA
the fused kernel is used as before. `MLX_SPEC_CPU_ATTENTION=0` leaves MLX's own path in place
(for comparisons). Calls too small to gain (fewer than MIN_SCORES scores: the extra sync costs
~130 us), with attention sinks, other dtypes or options keep MLX's path.

Lossless: both paths compute the same float32 softmax (max-subtracted, then normalised), within
MLX's own differences between shapes (~3e-7 here); a boolean mask fills with float32's lowest
value as MLX does, so a row masked everywhere averages the values (a batch's padding) rather
than turning to NaN.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

# scores (batch * heads * queries * keys) below which MLX's own path is as fast: the NumPy path
# pays one evaluation (~130 us); measured 2026-12-07, 1.2x faster from ~8k scores (9 heads, one
# query, 1,024 keys: 1.8x; 17 queries, 2,048 keys: 3.5x), 0.3-1.0x below
MIN_SCORES = 8192

_mlx_attention = mx.fast.scaled_dot_product_attention
_LOWEST = np.finfo(np.float32).min


def _mask_shape(mask: np.ndarray, kv_heads: int, groups: int) -> np.ndarray | None:
    """A (.., L, S) mask laid out as the scores are, (B, KV heads, groups, L, S); None if its
    shape is not one this knows."""
    if mask.ndim == 2:
        return mask
    if mask.ndim == 4:
        heads = mask.shape[1]
        if heads == 1:
            return mask[:, :, None]
        if heads == kv_heads * groups:
            return mask.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:])
    return None


def attention(q, k, v, *, scale, mask=None, sinks=None, **options):
    """`mx.fast.scaled_dot_product_attention` with the softmax in NumPy (see the module)."""
    batch, heads, queries, dim = q.shape  # (B, H, L, D)
    kv_heads, keys = k.shape[1], k.shape[2]  # (B, KH, S, D)
    mlx_own = (
        sinks is not None
        or options
        or q.dtype != mx.float32
        or k.dtype != mx.float32
        or heads % kv_heads
        or queries > keys
        or batch * heads * queries * keys < MIN_SCORES
        or (mask is not None and not isinstance(mask, str) and mask.ndim not in (2, 4))
    )
    if mlx_own:
        return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, **options)
    groups = heads // kv_heads
    scores = (q * scale).reshape(batch, kv_heads, groups * queries, dim) @ k.swapaxes(-1, -2)
    mx.eval(scores)  # (B, KH, G*L, S)
    a = np.array(scores, copy=False).reshape(batch, kv_heads, groups, queries, keys)
    if isinstance(mask, str):  # "causal", aligned to the last keys as MLX aligns it
        if queries > 1:
            later = np.triu(np.ones((queries, queries), dtype=bool), 1)
            np.copyto(a[..., keys - queries :], -np.inf, where=later)
    elif mask is not None:
        m = _mask_shape(np.array(mask), kv_heads, groups)
        if m is None:
            return _mlx_attention(q, k, v, scale=scale, mask=mask)
        if m.dtype == np.bool_:
            np.copyto(a, _LOWEST, where=~m)
        else:
            a += m.astype(np.float32, copy=False)
    a -= a.max(-1, keepdims=True)
    np.exp(a, out=a)
    weights = mx.array(a.reshape(batch, kv_heads, groups * queries, keys))  # (B, KH, G*L, S)
    # summed by MLX, not NumPy: MLX adds a row in order, so a batch row's left padding (exact
    # zeros) leaves the sum as it is alone; NumPy's pairwise sum regroups it (1 ulp apart)
    out = (weights @ v) / weights.sum(-1, keepdims=True)  # (B, KH, G*L, D)
    # the values' width, not the queries': MLA (DeepSeek) attends with wider queries and keys
    return out.reshape(batch, heads, queries, v.shape[-1]).astype(q.dtype)


def wanted() -> bool:
    """Whether this process should use the NumPy softmax: MLX without a GPU, not turned off."""
    if os.environ.get("MLX_SPEC_CPU_ATTENTION", "1") == "0":
        return False
    return not (mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()))


def install() -> bool:
    """Route `mx.fast.scaled_dot_product_attention` (which mlx-lm's models call) through
    `attention` where `wanted`; idempotent. Returns whether it is in place."""
    if mx.fast.scaled_dot_product_attention is attention:
        return True
    if not wanted():
        return False
    mx.fast.scaled_dot_product_attention = attention
    return True
