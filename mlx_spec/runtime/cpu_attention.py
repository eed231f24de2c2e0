"""Attention on MLX's CPU backend with NumPy's softmax.

MLX's CPU backend has no fused attention: `mx.fast.scaled_dot_product_attention` falls back to
matmuls and a softmax whose `exp` is scalar, ~14 ns an element on this project's x86-64 CPU
against NumPy's vectorised 2.6 ns (2026-12-07). At a few thousand tokens of context the softmax
is most of a forward pass: a 256-token prefill chunk of the demo target (SmolLM2-135M, 9 query /
3 KV heads) at 4,096 tokens of context spent 191 ms a layer in attention, where its MLP's matmuls
run at 120-170 GFLOP/s; a 17-token verify pass at 4,800 tokens 14.7 ms a layer against one
token's 2.3 ms, which made long drafts dear at agent-sized contexts on this CPU and on no Mac.

Here the scores (q @ k^T, grouped-query heads as one matmul per KV head) are evaluated, the
mask and the exponentials are applied over their buffer in place by NumPy, and MLX takes the
product with the values and the normalisation: 2-3.7x faster at those sizes (benchmarks in
docs/performance.md).
It is installed only where MLX has no GPU (`install`, called by `load_pair`): on Metal and CUDA
the fused kernel is used as before. `MLX_SPEC_CPU_ATTENTION=0` leaves MLX's own path in place
(for comparisons). Calls too small to gain (fewer than MIN_SCORES scores, or MIN_LONG_SCORES
over MIN_KEYS keys or more: the extra sync costs ~130 us), with attention sinks, other dtypes
or options keep MLX's path.

Lossless: both paths compute the same float32 attention, max-subtracted exponentials (here
normalised after the product with the values rather than before), within MLX's own differences
between shapes (~3e-7 here); masked scores get float32's lowest value as in MLX, so a row
masked everywhere averages the values (a batch's padding) rather than turning to NaN. Inside
`mx.compile` or `mx.vmap`, where nothing can be evaluated, MLX's path is taken.
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

# scores (batch * heads * queries * keys) below which MLX's own path is kept: the NumPy path
# pays one evaluation (~130 us) and stops MLX from building the next layer while this one runs.
# At 8k scores tiny models' batches (4 heads of 16, short contexts) took 15 % longer over whole
# tests (2026-12-07); from 64k the demo's prefill chunks and verify passes of 17 tokens past
# ~430 keys take it. Over a long context (MIN_KEYS) from MIN_LONG_SCORES: a one-token step of
# the demo target (9 heads), whole forward passes measured interleaved on a quiet CPU, MLX's
# path against NumPy's: 1,000 keys 90.7 / 86.7 ms, 2,000 108.9 / 92.8, 4,000 136.8 / 104.0,
# 5,700 200.5 / 146.4; at 500 keys alike (73 ms)
MIN_SCORES = 65536
MIN_KEYS = 1024
MIN_LONG_SCORES = 8192

_mlx_attention = mx.fast.scaled_dot_product_attention
_LOWEST = np.finfo(np.float32).min


def _mask_shape(mask, kv_heads: int, groups: int) -> tuple | None:
    """The shape that lays a (.., L, S) mask out as the scores are, (B, KV heads, groups, L, S);
    None where MLX's path should take it (another shape, or a dtype NumPy has no view of)."""
    if mask.dtype not in (mx.bool_, mx.float32, mx.float16):
        return None
    if mask.ndim == 2:
        return mask.shape
    if mask.ndim == 4:
        heads = mask.shape[1]
        if heads == 1:
            return (mask.shape[0], 1, 1, *mask.shape[2:])
        if heads == kv_heads * groups:
            return (mask.shape[0], kv_heads, groups, *mask.shape[2:])
    return None


def _softmax_in_place(a: np.ndarray, mask, layout: tuple | None) -> None:
    """Mask, then exponentiate `a` (B, KH, G, L, S) less each row's maximum, in place."""
    queries, keys = a.shape[-2:]
    if isinstance(mask, str):  # "causal", aligned to the last keys as MLX aligns it
        if queries > 1:
            later = np.triu(np.ones((queries, queries), dtype=bool), 1)
            np.copyto(a[..., keys - queries :], _LOWEST, where=later)
    elif mask is not None:
        m = np.asarray(mask).reshape(layout)  # a view where the mask is contiguous
        if m.dtype == np.bool_:
            np.copyto(a, _LOWEST, where=~m)
        else:
            a += m
    with np.errstate(invalid="ignore", over="ignore"):  # a row of -inf is NaN, as in MLX
        a -= a.max(-1, keepdims=True)
        np.exp(a, out=a)


def _worth_it(scores: int, keys: int) -> bool:
    """Whether a call is large enough for NumPy's path to gain (see MIN_SCORES)."""
    return scores >= MIN_SCORES or (keys >= MIN_KEYS and scores >= MIN_LONG_SCORES)


def attention(q, k, v, *, scale, mask=None, sinks=None, **options):
    """`mx.fast.scaled_dot_product_attention` with the softmax in NumPy (see the module)."""
    batch, heads, queries, dim = q.shape  # (B, H, L, D)
    kv_heads, keys = k.shape[1], k.shape[2]  # (B, KH, S, D)
    groups = heads // kv_heads if kv_heads else 0
    layout = None
    if mask is not None and not isinstance(mask, str):
        layout = _mask_shape(mask, kv_heads, groups)
    mlx_own = (
        sinks is not None
        or options
        or q.dtype != mx.float32
        or k.dtype != mx.float32
        or not groups
        or heads % kv_heads
        or k.shape[0] != batch
        or queries > keys
        or not _worth_it(batch * heads * queries * keys, keys)
        or (isinstance(mask, str) and mask != "causal")
        or (mask is not None and not isinstance(mask, str) and layout is None)
    )
    if mlx_own:
        return _mlx_attention(q, k, v, scale=scale, mask=mask, sinks=sinks, **options)
    scores = (q * scale).reshape(batch, kv_heads, groups * queries, dim) @ k.swapaxes(-1, -2)
    try:
        mx.eval(scores)  # (B, KH, G*L, S)
    except ValueError:  # inside mx.compile or mx.vmap: nothing can be evaluated there
        return _mlx_attention(q, k, v, scale=scale, mask=mask)
    # the exponentials are written over the scores' own buffer (a fresh matmul's, no one
    # else's), which then serves as the weights: no second copy of a (B, H, L, S) array
    _softmax_in_place(
        np.array(scores, copy=False).reshape(batch, kv_heads, groups, queries, keys), mask, layout
    )
    # normalised after the product with the values (L x D divisions, not L x S), and summed
    # by MLX: it adds a row in order, so a batch row's left padding (exact zeros) leaves the
    # sum as it is alone, where NumPy's pairwise sum regroups it (1 ulp apart)
    out = (scores @ v) / scores.sum(-1, keepdims=True)  # (B, KH, G*L, Dv)
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
