"""ggml tensor data -> MLX arrays, without a float16 detour for quantized tensors.

Every ggml block format is decoded here (numpy, from the bytes) into its exact affine form:
unsigned integer codes `q`, and one float32 `scale` and `bias` per group, such that
`weight = scale * q + bias` reproduces llama.cpp's dequantization. Where the groups fit MLX's
affine quantization (group size 32, 64 or 128; 2-8 bits) the codes are packed as MLX packs them
and the tensor stays quantized; ggml's 16-weight sub-blocks (Q6_K, Q3_K, Q2_K) do not fit, and
those tensors are re-quantized to MLX groups of 32 with two more bits than the file
(Q6_K -> 8-bit, Q3_K -> 5-bit, Q2_K -> 4-bit) so the added error stays a fraction of the file's
own quantization step.

Layouts follow ggml's `dequantize_row_*` (ggml-quants.c); the tests compare every type against
the `gguf` package's independent numpy implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

QK_K = 256  # weights in a K-quant super-block
MLX_GROUP = 32  # the group size of every tensor kept quantized
REQUANT_BITS = {"Q6_K": 8, "Q3_K": 5, "Q2_K": 4}


@dataclass
class Affine:
    """Exact affine form of a ggml tensor: weight[r, g*G + i] = scale[r, g] * q[r, g*G + i]
    + bias[r, g] (float32 arithmetic, as ggml does)."""

    q: np.ndarray  # uint8 (rows, cols)
    scale: np.ndarray  # float32 (rows, cols // group)
    bias: np.ndarray  # float32 (rows, cols // group)
    group: int
    bits: int

    def dequantize(self) -> np.ndarray:
        rows, cols = self.q.shape
        n = cols // self.group
        w = self.q.reshape(rows, n, self.group).astype(np.float32)
        w = w * self.scale[..., None] + self.bias[..., None]
        return w.reshape(rows, cols)


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 fields (2 bytes each, little-endian) of an (n, 2) uint8 array -> float32 (n, 1)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b & 0x0F, b >> 4


def _crumbs(b: np.ndarray) -> np.ndarray:
    """(n, h, 32) bytes -> (n, h, 4, 32): bits 2k..2k+1 of each byte at index k."""
    return (b[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3


def _q8_0(blocks):
    d = _f16(blocks[:, 0:2])
    q = blocks[:, 2:34].view(np.int8).astype(np.int16) + 128
    return q.astype(np.uint8), d, -128 * d, 32, 8


def _q4_0(blocks):
    d = _f16(blocks[:, 0:2])
    lo, hi = _nibbles(blocks[:, 2:18])
    return np.concatenate([lo, hi], axis=1), d, -8 * d, 32, 4


def _q4_1(blocks):
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    lo, hi = _nibbles(blocks[:, 4:20])
    return np.concatenate([lo, hi], axis=1), d, m, 32, 4


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of a little-endian uint32 per block, j = 0..count-1 -> (n, count) uint8."""
    word = np.ascontiguousarray(qh).view("<u4")  # (n, 1)
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(blocks):
    d = _f16(blocks[:, 0:2])
    hi_bit = _high_bits(blocks[:, 2:6], 32)
    lo, hi = _nibbles(blocks[:, 6:22])
    q = np.concatenate([lo, hi], axis=1) | (hi_bit << 4)
    return q, d, -16 * d, 32, 5


def _q5_1(blocks):
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    hi_bit = _high_bits(blocks[:, 4:8], 32)
    lo, hi = _nibbles(blocks[:, 8:24])
    q = np.concatenate([lo, hi], axis=1) | (hi_bit << 4)
    return q, d, m, 32, 5


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K): get_scale_min_k4."""
    sc = np.empty((len(s), 8), np.uint8)
    mn = np.empty((len(s), 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(blocks):
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    qs = blocks[:, 16:144].reshape(-1, 4, 32)  # 4 chunks of 32 bytes: 2 sub-blocks each
    lo, hi = _nibbles(qs)
    q = np.stack([lo, hi], axis=2).reshape(-1, QK_K)  # sub-block 2c: low nibbles, 2c+1: high
    return q, d * sc, -(dmin * mn), 32, 4


def _q5_k(blocks):
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48]  # bit j of qh[l]: the fifth bit of weight l of sub-block j
    lo, hi = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32))
    q = np.stack([lo, hi], axis=2).reshape(-1, 8, 32)
    top = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (q | (top << 4)).reshape(-1, QK_K)
    return q, d * sc, -(dmin * mn), 32, 5


def _q6_k(blocks):
    ql = blocks[:, 0:128].reshape(-1, 2, 64)  # two halves of 128 weights
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    lo, hi = _nibbles(ql)
    # within a half, weight k*32 + l: k=0 ql[l] low, 1 ql[l+32] low, 2 ql[l] high, 3 ql[l+32] high
    low4 = np.stack([lo[..., :32], lo[..., 32:], hi[..., :32], hi[..., 32:]], axis=2)
    top = _crumbs(qh)
    q = (low4 | (top << 4)).reshape(-1, QK_K)  # 0..63, weight = d * sc * (q - 32)
    scale = d * sc
    return q, scale, -32 * scale, 16, 6


def _q3_k(blocks):
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96].reshape(-1, 2, 32)
    s = blocks[:, 96:108]
    d = _f16(blocks[:, 108:110])
    low = s[:, 0:8]
    high = s[:, 8:12]
    sc = np.empty((len(blocks), 16), np.int16)
    sc[:, 0:8] = low & 0x0F
    sc[:, 8:16] = low >> 4
    # two high bits of scale j: bits 2*(j // 4) of high[j % 4]
    j = np.arange(16)
    sc |= ((high[:, j % 4] >> (2 * (j // 4)).astype(np.uint8)) & 3).astype(np.int16) << 4
    sc = (sc - 32).astype(np.float32)
    # weight 128*h + 32*k + l: bits 2k of qs[h, l]; its third bit from hmask[l] bit 4h + k
    two = _crumbs(qs)
    shift = (4 * np.arange(2)[:, None] + np.arange(4)[None, :]).astype(np.uint8)  # (2, 4)
    third = (hmask[:, None, None, :] >> shift[None, :, :, None]) & 1
    q = (two | (third << 2)).reshape(-1, QK_K)  # 0..7, weight = d * sc * (q - 4)
    scale = d * sc
    return q, scale, -4 * scale, 16, 3


def _q2_k(blocks):
    s = blocks[:, 0:16]
    qs = blocks[:, 16:80].reshape(-1, 2, 32)
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    # weight 128*h + 32*k + l: bits 2k of qs[h, l]
    q = _crumbs(qs)
    q = q.reshape(-1, QK_K)
    return q, d * (s & 0x0F).astype(np.float32), -(dmin * (s >> 4).astype(np.float32)), 16, 2


class GGMLType(NamedTuple):
    name: str
    block: int  # weights per block
    nbytes: int  # bytes per block
    decoder: Callable | None = None  # None: a float type, read as it is


# the ggml tensor types read here, by the type id a GGUF tensor table gives
GGML_TYPES = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18, _q4_0),
    3: GGMLType("Q4_1", 32, 20, _q4_1),
    6: GGMLType("Q5_0", 32, 22, _q5_0),
    7: GGMLType("Q5_1", 32, 24, _q5_1),
    8: GGMLType("Q8_0", 32, 34, _q8_0),
    10: GGMLType("Q2_K", QK_K, 84, _q2_k),
    11: GGMLType("Q3_K", QK_K, 110, _q3_k),
    12: GGMLType("Q4_K", QK_K, 144, _q4_k),
    13: GGMLType("Q5_K", QK_K, 176, _q5_k),
    14: GGMLType("Q6_K", QK_K, 210, _q6_k),
    30: GGMLType("BF16", 1, 2),
}
BY_NAME = {t.name: t for t in GGML_TYPES.values()}
FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def decode(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> Affine:
    """The exact affine form of a quantized tensor: `data` is its raw bytes (uint8), `shape`
    as MLX sees it (rows..., cols), cols a multiple of the block size."""
    _, block, nbytes, fn = BY_NAME[type_name]
    cols = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    blocks = np.ascontiguousarray(data).reshape(-1, nbytes)
    q, scale, bias, group, bits = fn(blocks)
    per_row = cols // group
    return Affine(
        q.reshape(rows, cols),
        np.broadcast_to(scale, (len(blocks), block // group)).reshape(rows, per_row),
        np.broadcast_to(bias, (len(blocks), block // group)).reshape(rows, per_row),
        group,
        bits,
    )


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: the codes of a row as one little-endian bit stream (value i in
    bits [i*bits, (i+1)*bits)), read as uint32 words."""
    rows, cols = q.shape
    if bits in (2, 4, 8):  # whole values per byte
        per = 8 // bits
        v = q.reshape(rows, cols // per, per)
        packed = v[..., 0].copy()
        for i in range(1, per):
            packed |= v[..., i] << np.uint8(bits * i)
        return packed.view("<u4").reshape(rows, cols * bits // 32)
    # 3, 5, 6 bits: eight values fill `bits` bytes exactly; build them in a little-endian
    # uint64 and keep its low `bits` bytes
    v = q.reshape(rows, cols // 8, 8)
    word = v[..., 0].astype("<u8")
    for i in range(1, 8):
        word |= v[..., i].astype("<u8") << np.uint64(bits * i)
    packed = word[..., None].view(np.uint8)[..., :bits]
    return np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")


def float_array(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """F32 / F16 as numpy arrays; BF16 as its uint16 bit patterns (numpy has no bfloat16)."""
    return np.ascontiguousarray(data).view(FLOATS[type_name]).reshape(shape)


def dequantize(type_name: str, raw: np.ndarray, shape) -> np.ndarray:
    """Any tensor type as float32 numpy."""
    if type_name == "BF16":
        bits = float_array(type_name, raw, shape).astype(np.uint32) << 16
        return bits.view(np.float32)
    if type_name in FLOATS:
        return float_array(type_name, raw, shape).astype(np.float32)
    return decode(type_name, raw, shape).dequantize().reshape(shape)


def mlx_float(type_name: str, raw: np.ndarray, shape) -> mx.array:
    """A tensor as an MLX float array: float types in their own precision, the others
    dequantized to float32."""
    if type_name not in FLOATS:
        return mx.array(dequantize(type_name, raw, shape))
    value = mx.array(float_array(type_name, raw, shape))
    return value.view(mx.bfloat16) if type_name == "BF16" else value


class MLXQuantized(NamedTuple):
    arrays: tuple[mx.array, mx.array, mx.array]  # packed uint32 codes, float16 scales, biases
    group: int
    bits: int
    what: str  # for the conversion's one line: "4-bit group 32", "(re-quantized)"


def mlx_quantized(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> MLXQuantized:
    """A quantized matrix in MLX's affine format (packed uint32 codes, float16 scales and
    biases), decoded a few million weights at a time so the temporaries stay small."""
    rows, cols = shape
    ggml = BY_NAME[type_name]
    row_bytes = cols // ggml.block * ggml.nbytes
    step = max(1, (1 << 22) // cols)
    parts = []
    for r in range(0, rows, step):
        n = min(step, rows - r)
        affine = decode(type_name, raw[r * row_bytes : (r + n) * row_bytes], (n, cols))
        if affine.group in (32, 64, 128):
            group, bits = affine.group, affine.bits
            packed = pack(affine.q, bits)
            scales, biases = affine.scale.astype(np.float16), affine.bias.astype(np.float16)
        else:  # 16-weight sub-blocks: re-quantize to groups of 32, with more bits
            group, bits = MLX_GROUP, REQUANT_BITS[type_name]
            w, s, b = mx.quantize(mx.array(affine.dequantize()), group_size=group, bits=bits)
            packed = np.array(w)
            scales = np.array(s.astype(mx.float16))
            biases = np.array(b.astype(mx.float16))
        parts.append((packed, scales, biases))
    arrays = tuple(mx.array(np.concatenate(p)) for p in zip(*parts, strict=True))
    exact = type_name not in REQUANT_BITS
    what = f"{bits}-bit group {group}" + ("" if exact else " (re-quantized)")
    return MLXQuantized(arrays, group, bits, what)
