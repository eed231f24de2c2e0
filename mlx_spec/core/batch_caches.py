"""How the batch (decode/batch.py) holds each mlx-lm cache class: one home for what is per
class — whether a model's caches can be batched with a roll-back per row (`check_batchable`,
`why_not`), how single-stream layers merge into a batched one (`merge_layer`) and how a row is
taken back out (`extract_layer`), the batched classes of our own (`BatchWindowedKVCache`,
`RowsCache` and the `RowWise` pass over it) and how every row forgets what it rejected
(`rollback_rows`; a recurrent row, or a row of deepseek_v41's compressed layers run row by row,
is restored instead: `snapshot`, `restore_rows`), and what a single-stream layer handed to or
from a row holds (`held`, `keepable`, `fed`). The
single-stream classes they hold are core/caches.py's. A new cache class is one case in each of
these functions; a class none of them names is refused in one line (check_batchable, then
merge_layer)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
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
from .caches import (
    WINDOW_MARGIN,
    WINDOW_SLACK,
    CacheRollbackError,
    WindowedKVCache,
    _leaves,
    _refusal,
    nbytes,
)


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
    # (its LayerCache goes back by a snapshot and a replay, row by row: RowsCache)
    "deepseek_v41": (
        "computes its positions and its sliding window's rows from the first layer's one "
        "offset and window for the whole batch"
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
    single-stream caches, `RowsCache`, which `caches.make_cache` checked)."""
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
    (`apart`: each row's caches kept as they are, `RowsCache`)."""
    merge = RowsCache.merge if apart else merge_layer
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


def settle(cache: list, rows: int) -> None:
    """Between rounds: every batched recurrent layer unmasked (`unmasked`) for `rows` rows."""
    for c in _leaves(cache):
        if isinstance(c, ArraysCache):
            unmasked(c, rows)


def fed(cache: list) -> bool:
    """Whether every batched layer has been fed a token (mlx-lm's extract fails on the empty
    keys of a layer never fed, as a lone 2-token prompt's draft that ends at once leaves it)."""
    return all(getattr(c, "keys", True) is not None for c in _leaves(cache))


def held(c) -> int | None:
    """The tokens a single-stream layer has taken in (a sliding-window, chunked or compressed
    layer: its offset, its oldest entries maybe dropped); None for a recurrent state (no
    length)."""
    if isinstance(c, ArraysCache):
        return None
    if isinstance(c, WindowedKVCache | caches.MarginChunkedKVCache) or caches.compressed(c):
        return c.offset
    return c.size()


def keepable(cache: list, recurrent: bool = False) -> bool:
    """Whether a kept single-stream cache is made of classes a row can start from: plain,
    windowed or chunked KV layers, and (`recurrent`: a batch that restores and replays)
    recurrent states and compressed layers."""
    kinds = (KVCache, WindowedKVCache, caches.MarginChunkedKVCache)
    kinds += (ArraysCache,) if recurrent else ()
    return all(type(c) in kinds or (recurrent and caches.compressed(c)) for c in _leaves(cache))


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


class BatchWindowedKVCache(BatchKVCache):
    """`WindowedKVCache` for a batch (decode/batch.py): mlx-lm's left-padded `BatchKVCache`
    (its extend, filter, trim and per-row roll right all apply) whose rows forget old tokens.

    Each row's tokens are contiguous and end at column `_idx - 1`, so a column distance is a
    distance in time: the mask (`make_mask`) is causal, limited to the window, and hides each
    row's left padding. `offset` (per row) stays absolute, for RoPE. Once the buffer holds
    more than `window - 1 + margin + slack` columns, its front is dropped down to the last
    `window - 1 + margin`, a slice common to all rows: every row then keeps its last
    `window - 1 + margin` tokens (or all it has; a row with fewer loses left padding only),
    so a roll-back of up to `margin` tokens leaves every row its window, as alone."""

    def __init__(self, left_padding, window: int, margin: int = WINDOW_MARGIN,
                 slack: int = WINDOW_SLACK):  # fmt: skip
        super().__init__(left_padding)
        self.window, self.margin, self.slack = window, margin, slack

    def update_and_fetch(self, keys, values):
        fetched = super().update_and_fetch(keys, values)
        # compact after fetching, as WindowedKVCache: this pass's mask counted the columns
        keep = self.window - 1 + self.margin
        if self._idx > keep + self.slack:
            drop = self._idx - keep
            self.keys = self.keys[..., drop : self._idx, :]
            self.values = self.values[..., drop : self._idx, :]
            self._idx = keep
            self.left_padding = mx.maximum(self.left_padding - drop, 0)
        return fetched

    def stored(self) -> list[int]:
        """Each row's tokens held (the rest of its `offset` was dropped)."""
        return (self._idx - self.left_padding).tolist()

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        # models that leave the window to the cache (RotatingKVCache's max_size) pass None
        return create_causal_mask(
            N, offset=self._idx, window_size=window_size or self.window,
            left_padding=self.left_padding,
        )  # fmt: skip

    def refusal(self, rejected: list[int]) -> str | None:
        """Why the rows cannot forget `rejected[i]` tokens each (None: they can): after it a
        row's next token must still see its window - 1 predecessors (or all of them)."""
        offsets = self.offset.tolist()
        for i, (stored, n) in enumerate(zip(self.stored(), rejected, strict=True)):
            if n > stored or stored - n < min(self.window - 1, offsets[i] - n):
                return (
                    f"a sliding-window layer's row {i} cannot forget {n} tokens (it keeps "
                    f"{self.margin} beyond its window of {self.window})"
                )
        return None

    def trim(self, n):
        n = min(self._idx, n)
        if self.refusal([n] * len(self.offset.tolist())) is not None:
            return 0
        return super().trim(n)

    def extract(self, idx) -> WindowedKVCache:
        padding, offset = self.left_padding.tolist()[idx], self.offset.tolist()[idx]
        cache = WindowedKVCache(self.window, self.margin, self.slack)
        if self.keys is not None and self._idx > padding:
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, padding : self._idx])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, padding : self._idx])
        cache.offset = offset
        cache.dropped = offset - (self._idx - padding)
        return cache

    @classmethod
    def merge(cls, caches):
        """Single-row WindowedKVCaches (one window) -> one batch, left-padded."""
        first = caches[0]
        lengths = [c.stored for c in caches]
        longest = max(lengths)
        merged = cls([longest - n for n in lengths], first.window, first.margin, first.slack)
        merged.offset = mx.array([c.offset for c in caches])
        if longest == 0:
            return merged
        some = next(c for c in caches if c.keys is not None)
        _, H, _, Dk = some.keys.shape
        Dv = some.values.shape[3]
        keys = mx.zeros((len(caches), H, longest, Dk), some.keys.dtype)
        values = mx.zeros((len(caches), H, longest, Dv), some.values.dtype)
        for i, (c, n) in enumerate(zip(caches, lengths, strict=True)):
            if n:
                keys[i : i + 1, :, longest - n :] = c.keys[..., :n, :]
                values[i : i + 1, :, longest - n :] = c.values[..., :n, :]
        merged.keys, merged.values, merged._idx = keys, values, longest
        return merged


class RowsCache:
    """One layer of a batch whose rows stay single-stream caches, apart: for a model whose own
    code takes one position for the whole batch (core/batch_caches.py's ONE_OFFSET: gpt_bigcode,
    Llama 4's chunked attention, deepseek_v41's compressed layers, whose rows are restored, not
    trimmed), which the batch then runs row by row (`RowWise`), each row on its own caches,
    exactly as alone. It batches the requests, not the passes: each row's
    pass reads the weights again."""

    def __init__(self, rows: list):
        self.rows = list(rows)

    @classmethod
    def merge(cls, caches: list) -> RowsCache:
        return cls(caches)

    def extract(self, i: int):
        return self.rows[i]

    def filter(self, index) -> None:
        self.rows = [self.rows[i] for i in mx.array(index).tolist()]

    def extend(self, other: RowsCache) -> None:
        self.rows += other.rows

    @property
    def state(self):
        return [r.state for r in self.rows]

    @property
    def nbytes(self) -> int:
        return sum(nbytes([r]) for r in self.rows)

    def refusal(self, rejected: list[int]) -> str | None:
        for i, (r, n) in enumerate(zip(self.rows, rejected, strict=True)):
            why = _refusal(r, n) if n and not caches.restored(r) else None
            if why is not None:
                return f"row {i}: {why}"
        return None

    def rollback(self, rejected: list[int]) -> None:
        """Each row's layer forgets its count; a row's `caches.restored` layer (its state,
        a compressed layer) forgets nothing: the row is restored (`restore_rows`)."""
        for r, n in zip(self.rows, rejected, strict=True):
            if n and not caches.restored(r) and r.trim(n) != n:  # (checked by refusal first)
                raise CacheRollbackError(f"{type(r).__name__} could not forget {n} tokens")


class RowWise:
    """A model run row by row over a batch of `RowsCache` layers: logits (B, L, vocab)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs, cache):
        return mx.concatenate(
            [
                self.model(inputs[b : b + 1], cache=[c.rows[b] for c in cache])
                for b in range(inputs.shape[0])
            ]
        )


def _apart(cache: list) -> bool:
    return bool(cache) and isinstance(cache[0], RowsCache)  # (merge_rows: every layer or none)


def snapshot(cache: list) -> list:
    """A batched cache's `restored` layers (`caches.snapshot`); a batch run row by row
    (`RowsCache`): each row's own."""
    if _apart(cache):
        return [caches.snapshot([c.rows[b] for c in cache]) for b in range(len(cache[0].rows))]
    return caches.snapshot(cache)


def restore_rows(cache: list, saved: list, rows: list[bool]) -> None:
    """The rows where `rows` is True go back to `snapshot`'s state, the others keep theirs
    (`caches.restore_rows`; a batch run row by row: each chosen row's own caches)."""
    if not _apart(cache):
        caches.restore_rows(cache, saved, rows)
        return
    for b, back in enumerate(rows):
        if back:
            caches.restore([c.rows[b] for c in cache], saved[b])


def rollback_rows(cache: list, rejected: list[int]) -> None:
    """Forget the last `rejected[i]` entries of row i in every layer (see decode/batch.py's note),
    or raise CacheRollbackError before any layer changed (a sliding-window row that would
    lose part of its window)."""
    # the windowed layers of one window hold the same rows (one check each: it reads them)
    windows = {c.window: c for c in cache if isinstance(c, BatchWindowedKVCache)}
    apart = [c for c in cache if isinstance(c, RowsCache)]
    for c in [*windows.values(), *apart]:
        why = c.refusal(rejected)
        if why is not None:
            raise CacheRollbackError(why)
    for c in apart:
        c.rollback(rejected)
    low = min(rejected)
    rest = [r - low for r in rejected]
    for c in _leaves(cache):
        if isinstance(c, RowsCache):
            continue  # (rolled back above)
        if isinstance(c, ArraysCache):
            continue  # a recurrent state forgets nothing: its rows are restored (restore_rows)
        if low:
            BatchKVCache.trim(c, low)  # (a windowed layer's own trim would check again)
        if max(rest):
            c.prepare(right_padding=rest)
            c.finalize()
