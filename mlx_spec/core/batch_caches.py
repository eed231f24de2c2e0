"""How the batch (decode/batch.py) holds each mlx-lm cache class: one home for what is per
class — whether a model's caches can be batched with a roll-back per row (`check_batchable`,
`why_not`), how single-stream layers merge into a batched one (`merge_layer`) and how a row is
taken back out (`extract_layer`). Rolling rows back and restoring them is `caches.rollback_rows`
/ `caches.restore_rows`, beside the batched classes themselves (`BatchWindowedKVCache`,
`RowsCache`) in core/caches.py. A new cache class is one case in each of these functions; a
class none of them names is refused in one line (check_batchable, then merge_layer)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from ..errors import SpecError
from . import caches
from .caches import BatchWindowedKVCache, WindowedKVCache


def why_not(c, windows: bool = True) -> str:
    if isinstance(c, ArraysCache):
        return (
            "keeps a recurrent state (ArraysCache: Qwen3.5, Mamba), which a batch cannot "
            "roll back per row"
        )
    if isinstance(c, RotatingKVCache) and c.keep:
        return (
            f"has sliding-window layers that keep {c.keep} attention-sink tokens "
            "(RotatingKVCache keep > 0), which cannot roll back"
        )
    if isinstance(c, RotatingKVCache):
        return "has sliding-window layers (RotatingKVCache), which this batch holds unwindowed"
    if isinstance(c, ChunkedKVCache):
        return "uses chunked attention (ChunkedKVCache), which mlx-lm cannot batch"
    return f"uses {type(c).__name__} layers, which cannot be batched with a roll-back per row"


# mlx-lm models whose forward reads the cache's offset as one number (a batch holds one per
# row): refused before anything runs, where they would fail in the first pass
ONE_OFFSET = {
    "gpt_bigcode": "computes its positions from one offset for the whole batch (np.arange)",
    # (its ChunkedKVCache rolls back: caches.MarginChunkedKVCache)
    "llama4": (
        "computes its chunked attention mask and its no-RoPE layers' attention temperature "
        "from one offset for the whole batch (mx.arange)"
    ),
}


def check_batchable(
    model,
    role: str = "target",
    windows: bool = True,
    recurrent: bool = False,
    apart: bool = False,
) -> None:
    """Refuse a model whose cache the batch cannot roll back per row: plain KVCache layers
    merge into a BatchKVCache, sliding-window layers (RotatingKVCache without attention
    sinks, `caches.make_cache`'s WindowedKVCache) into a BatchWindowedKVCache, both forget
    per row. `windows=False`: plain KVCache layers only (a caller that batches with
    BatchKVCache alone, as eagle_head's replies). `recurrent=True`: recurrent layers
    (ArraysCache) too, which a BatchDecoder's target restores per row and replays.
    A model whose own code cannot take one position per row (`ONE_OFFSET`) is refused too,
    unless `apart` (a BatchDecoder: it runs such a model row by row, each row on its own
    single-stream caches, `caches.RowsCache`, which `caches.make_cache` checked)."""
    kind = getattr(model, "model_type", None)
    if kind in ONE_OFFSET and apart:
        return
    if kind in ONE_OFFSET:
        raise SpecError(
            f"the {role} model ({kind}) {ONE_OFFSET[kind]}, so its rows cannot be batched; "
            "decode it one request at a time (generate)"
        )
    for c in caches._leaves(make_prompt_cache(model)):
        window = windows and type(c) is RotatingKVCache and not c.keep
        state = recurrent and type(c) is ArraysCache
        if type(c) is not KVCache and not window and not state:
            raise SpecError(
                f"the {role} model {why_not(c, windows)}; decode it one request at a time "
                "(generate)"
            )


def merge_rows(row_caches: list[list], apart: bool = False) -> list:
    """Single-row caches (one list per row) -> one batched cache per layer, left-padded
    (`apart`: each row's caches kept as they are, `caches.RowsCache`)."""
    merge = caches.RowsCache.merge if apart else merge_layer
    return [merge([c[i] for c in row_caches]) for i in range(len(row_caches[0]))]


def merge_layer(layer: list):
    """One layer's single-row caches -> its batched form: KVCache -> BatchKVCache,
    WindowedKVCache -> BatchWindowedKVCache, ArraysCache -> one state per row (no padding),
    a CacheList (falcon_h1, baichuan_m1, longcat_flash, DeepSeek-V3.2's indexer beside its
    attention) -> a CacheList of its parts' batched forms, part by part."""
    first = layer[0]
    if isinstance(first, CacheList):
        parts = zip(*(c.caches for c in layer), strict=True)
        return CacheList(*(merge_layer(list(part)) for part in parts))
    if isinstance(first, ArraysCache):
        return unmasked(ArraysCache.merge(layer), len(layer))
    if isinstance(first, WindowedKVCache):
        return BatchWindowedKVCache.merge(layer)
    if type(first) is KVCache:
        return BatchKVCache.merge(layer)
    # (check_batchable refuses such a model before any row; never merged as the wrong kind)
    raise SpecError(f"a {type(first).__name__} layer cannot be batched")


def unmasked(c: ArraysCache, rows: int) -> ArraysCache:
    """A batched recurrent layer with no mask: every row's state has taken in all its tokens
    (no left padding: a row's prompt is prefilled alone). Until every state exists (a row of
    a one-token prompt has seen nothing yet: None, zeros when merged), `left_padding` holds
    zeros, only so the layer knows its batch size; it masks nothing (positions >= 0)."""
    c.lengths = None
    c.left_padding = None if all(a is not None for a in c.cache) else mx.zeros((rows,), mx.int32)
    return c


def extract_layer(c, i: int):
    """Row i of a batched layer as a single stream's (a recurrent state not taken in yet:
    None, as a fresh cache holds it; a CacheList part by part)."""
    if isinstance(c, CacheList):
        return CacheList(*(extract_layer(part, i) for part in c.caches))
    if isinstance(c, ArraysCache):
        one = ArraysCache(len(c.cache))
        one.cache = [a[i : i + 1] if a is not None else None for a in c.cache]
        return one
    return c.extract(i)
