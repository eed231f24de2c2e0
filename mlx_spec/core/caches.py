"""KV caches that can roll back exactly, for every layer kind mlx-lm builds.

Speculative decoding feeds the target tokens it may later reject, so every cache must be able
to forget the last few tokens. mlx-lm's caches cannot always:

- `KVCache` trims exactly (offset -= n).
- `RotatingKVCache` (sliding-window layers: Gemma 2/3, GPT-OSS, Cohere 2, Mistral-style configs)
  overwrites its oldest entries once the context reaches the window; after that `trim` is refused
  and `trim_prompt_cache` silently trims nothing. We replace it by `WindowedKVCache`: a linear
  buffer that keeps `window - 1 + margin` past tokens (dropping older ones now and then), so a
  roll-back of up to `margin` tokens always leaves the whole window. The model still applies its
  window through the mask, so attention sees exactly the tokens it would have seen.
- `ArraysCache` (recurrent state: Gated DeltaNet in Qwen3.5 / Qwen3-Next, Mamba) cannot trim at
  all. Its state can be snapshotted and restored: MLX arrays are immutable and the layers assign
  new arrays into the cache's list, so a copy of the list is a snapshot (`c.state` returns that
  very list, so saving it would save nothing).
- `LayerCache` (mlx-lm's `deepseek_v41`: a sliding window, closed compressed groups and their
  index keys, the open group's rows) has no trim. Its layer replaces those arrays, never writes
  into one, so its attributes are a snapshot too (`COMPRESSED_FIELDS`): it is restored and the
  kept tokens replayed, as a recurrent state is.

`rollback` checks that every layer forgot exactly what was asked; a cache that cannot raises
`CacheRollbackError` — never a silently wrong state. `prefill_cache` fills a cache with a
prompt in chunks (the decoders' prefill of the target, a draft model's).

`copy` makes an independent copy of a whole cache (a fork of a decoder): the two may then
continue apart, neither seeing the other's writes.
"""

from __future__ import annotations

import copy as _shallow
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from ..errors import Aborted, SpecError
from .hidden import capturing, is_kv

# Past tokens a sliding-window layer keeps beyond its window: the longest roll-back it allows
# (a verify pass of k+1 tokens, or the end of a previous turn that a chat template re-renders).
WINDOW_MARGIN = 128
# single-token steps a timed prefill ends with (prefill_cache): the first pays one-time costs,
# the median of the others is the step's time
TIMED_STEPS = 4
# Tokens allowed to pile up before the buffer is compacted (one copy per SLACK tokens).
WINDOW_SLACK = 256


# deepseek_v41's LayerCache: every attribute its layer changes (the window, the closed groups
# and their index keys, the open group's rows and gates, the position); its layer assigns new
# arrays to them (concatenations, slices) and never writes into one
COMPRESSED_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate", "offset")


def compressed(c) -> bool:
    """Whether `c` is mlx-lm's deepseek_v41 LayerCache (by exact class, named: the model's
    module is imported only where a model of it is loaded)."""
    kind = type(c)
    return kind.__name__ == "LayerCache" and kind.__module__ == "mlx_lm.models.deepseek_v41"


def restored(c) -> bool:
    """Whether a layer goes back by a snapshot (then a replay), never by a trim: a recurrent
    state (ArraysCache) or a compressed-attention layer (deepseek_v41's LayerCache)."""
    return isinstance(c, ArraysCache) or compressed(c)


class CacheRollbackError(SpecError):
    """A cache was asked to forget more than it can."""


class CacheCopyError(SpecError):
    """A cache kind `copy` does not know: sharing it would let two decoders write one state."""


class WindowedKVCache(KVCache):
    """A sliding-window layer's cache that can roll back.

    Holds the last `stored` tokens in temporal order; `offset` stays the absolute position
    (RoPE reads it). Between compactions up to WINDOW_SLACK more tokens than the minimum pile
    up, so the copy that drops old tokens happens once per WINDOW_SLACK tokens.
    """

    def __init__(self, window: int, margin: int = WINDOW_MARGIN, slack: int = WINDOW_SLACK):
        super().__init__()
        self.window, self.margin, self.slack = window, margin, slack
        self.dropped = 0  # tokens dropped off the front

    @property
    def stored(self) -> int:
        return self.offset - self.dropped

    def update_and_fetch(self, keys, values):
        prev = self.stored
        if self.keys is None or prev + keys.shape[2] > self.keys.shape[2]:
            B, n_kv_heads, S, k_head_dim = keys.shape
            n_steps = (self.step + S - 1) // self.step
            new_k = mx.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), keys.dtype)
            new_v = mx.zeros((B, n_kv_heads, n_steps * self.step, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        stored = prev + keys.shape[2]
        self.keys[..., prev:stored, :] = keys
        self.values[..., prev:stored, :] = values
        self.offset += keys.shape[2]
        fetched = self.keys[..., :stored, :], self.values[..., :stored, :]
        # Compact after fetching: the model built this pass's mask from the length before it.
        if stored > self.window - 1 + self.margin + self.slack:
            drop = stored - (self.window - 1 + self.margin)
            self.keys = self.keys[..., drop:stored, :]
            self.values = self.values[..., drop:stored, :]
            self.dropped += drop
        return fetched

    def keys_and_values(self):
        return self.keys[..., : self.stored, :], self.values[..., : self.stored, :]

    def size(self):
        return self.stored

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        # models that leave the window to the cache (RotatingKVCache's max_size) pass None
        window = window_size or self.window
        if self.stored + N <= window and not return_array:
            return None if N == 1 else "causal"  # the whole buffer is inside the window
        return create_attention_mask(
            N, offset=self.stored, return_array=return_array, window_size=window
        )

    def can_trim(self, n: int) -> bool:
        # after the trim the next token must still see its window-1 predecessors (or all)
        return self.stored - n >= min(self.window - 1, self.offset - n)

    def trim(self, n):
        n = min(self.offset, n)
        if not self.can_trim(n):
            return 0
        self.offset -= n
        return n

    @property
    def state(self):
        return self.keys, self.values

    @state.setter
    def state(self, v):
        raise NotImplementedError("WindowedKVCache cannot be restored from a saved state")


class MarginChunkedKVCache(ChunkedKVCache):
    """mlx-lm's `ChunkedKVCache` (Llama 4's chunked attention) that keeps `margin` tokens more
    than its chunk, so a roll-back of up to `margin` tokens still holds the whole chunk the
    next token attends to. mlx-lm's keeps only the last `chunk_size` tokens before each pass
    (`maybe_trim_front`, which the model calls): a draft model fed one token a step drops the
    front of its chunk step by step, and could not go back over the tokens it drafted. The
    extra tokens change nothing the model computes: its chunk mask, built from
    `start_position`, hides every token of an earlier chunk. Trimmed once per `slack` tokens,
    as WindowedKVCache compacts."""

    def __init__(self, chunk_size: int, margin: int = WINDOW_MARGIN, slack: int = WINDOW_SLACK):
        super().__init__(chunk_size)
        self.margin, self.slack = margin, slack

    def maybe_trim_front(self):
        if self.keys is None:
            return
        valid = self.offset - self.start_position
        keep = self.chunk_size + self.margin
        if valid > keep + self.slack:
            trim = valid - keep
            self.start_position += trim
            self.keys = self.keys[..., trim:valid, :]
            self.values = self.values[..., trim:valid, :]


def _leaves(cache: list) -> list:
    out = []
    for c in cache:
        out.extend(_leaves(c.caches) if isinstance(c, CacheList) else [c])
    return out


def _convert(c):
    if isinstance(c, CacheList):
        return CacheList(*[_convert(x) for x in c.caches])
    if type(c) is RotatingKVCache:
        if c.keep:
            raise SpecError(
                f"a rotating KV cache that keeps {c.keep} attention-sink tokens cannot roll back"
            )
        return WindowedKVCache(c.max_size, WINDOW_MARGIN, WINDOW_SLACK)
    if type(c) is ChunkedKVCache:
        return MarginChunkedKVCache(c.chunk_size, WINDOW_MARGIN, WINDOW_SLACK)
    return c


# Layer caches whose trim is exact (checked by class, not by is_trimmable(), which says only
# whether a trim is possible now). ArraysCache and deepseek_v41's LayerCache (`restored`) are
# snapshotted instead. MarginChunkedKVCache
# (Llama 4's chunked attention) forgets exactly any tokens back to the start of the chunk
# the next token attends to; a roll-back past what it still holds is refused (`_refusal`).
# (not mlx-lm's ChunkedKVCache itself: it may already have dropped the front of that chunk)
# (not mlx-lm's ConcatenateKVCache: its trim lowers the offset but keeps the rows, so the next
# write lands after the forgotten ones; afm7's kv-reuse layer is one)
ROLLBACK_TYPES = (KVCache, QuantizedKVCache, ArraysCache, MarginChunkedKVCache)


def make_cache(model, role: str = "target", strict: bool = True) -> list:
    """The model's prompt cache with every layer able to roll back (or be snapshotted);
    a layer kind that cannot is refused here, before any token is produced. `strict=False`
    (plain decoding, which rolls back only its look-ahead step) accepts any cache: a failed
    roll-back then raises and the caller starts over."""
    cache = [_convert(c) for c in make_prompt_cache(model)]
    if not strict:
        return cache
    unsupported = sorted(
        {
            type(c).__name__
            for c in _leaves(cache)
            if not isinstance(c, ROLLBACK_TYPES) and not compressed(c)
        }
    )
    if unsupported:
        raise SpecError(
            f"the {role} model's KV cache ({', '.join(unsupported)}) cannot be rolled back, "
            "so it cannot be used for speculative decoding"
        )
    return cache


def is_recurrent(cache: list) -> bool:
    """Whether some layer goes back by a snapshot, never trimmed (`restored`): a recurrent
    state, or a compressed-attention layer, which decoding treats alike (restore, replay)."""
    return any(restored(c) for c in _leaves(cache))


# Layer caches that forget any number of the tokens they hold (not a window, a chunk or a
# recurrent state): one kept sequence then serves every prefix of it (server/prompt_cache.py).
FREE_ROLLBACK_TYPES = (KVCache, QuantizedKVCache)


def rolls_back_freely(cache: list) -> bool:
    """Whether every layer can forget any number of the tokens it holds."""
    return all(type(c) in FREE_ROLLBACK_TYPES for c in _leaves(cache))


def _saved(c) -> list:
    if isinstance(c, ArraysCache):
        return list(c.cache)
    return [getattr(c, name) for name in COMPRESSED_FIELDS]


def snapshot(cache: list) -> list:
    """The `restored` layers' state, cheaply: the arrays are immutable, the lists are copied
    (a compressed layer's: its attributes' arrays)."""
    return [_saved(c) for c in _leaves(cache) if restored(c)]


def restore(cache: list, saved: list) -> None:
    layers = [c for c in _leaves(cache) if restored(c)]
    for c, s in zip(layers, saved, strict=True):
        if isinstance(c, ArraysCache):
            c.cache = list(s)
        else:
            for name, value in zip(COMPRESSED_FIELDS, s, strict=True):
                setattr(c, name, value)


def restore_rows(cache: list, saved: list, rows: list[bool]) -> None:
    """Restore the recurrent layers of the batch rows where `rows` is True to `saved` (a
    `snapshot` of the batched cache), the others' states kept. A state the snapshot did not
    hold yet (None: a row that had seen no token) is zeros, as the layers start from."""
    if not any(rows):
        return
    layers = [c for c in _leaves(cache) if restored(c)]
    if any(compressed(c) for c in layers):  # (a batch runs these row by row: RowsCache)
        raise CacheRollbackError("a compressed-attention layer cannot restore single rows")
    if all(rows):
        restore(cache, saved)
        return
    pick = mx.array(rows)
    for c, s in zip(layers, saved, strict=True):
        for e, (old, new) in enumerate(zip(s, c.cache, strict=True)):
            if new is None:
                continue
            old = mx.zeros_like(new) if old is None else old
            c.cache[e] = mx.where(pick.reshape((-1,) + (1,) * (new.ndim - 1)), old, new)


def _refusal(c, n: int) -> str | None:
    """Why layer cache `c` cannot forget its last `n` tokens exactly (None: it can)."""
    if isinstance(c, ArraysCache):
        return "a recurrent layer's state cannot be rolled back"
    if compressed(c):
        return "a compressed-attention layer (LayerCache) cannot be rolled back"
    if isinstance(c, WindowedKVCache) and not c.can_trim(min(n, c.offset)):
        return (
            f"a sliding-window layer cannot forget {n} tokens (it keeps {c.margin} beyond "
            f"its window of {c.window})"
        )
    if isinstance(c, ChunkedKVCache):
        # it keeps the tokens from start_position on; the position after the roll-back
        # attends to its whole chunk, which must not start before them (Llama 4: a branch
        # into a chunk whose front was dropped decoded other tokens than a fresh run)
        end = c.offset - n
        if end < c.start_position or end // c.chunk_size * c.chunk_size < c.start_position:
            return f"a chunked-attention layer no longer holds the chunk of position {end}"
    if not c.is_trimmable():  # e.g. a RotatingKVCache past its window: trim would lie
        return f"a {type(c).__name__} layer cannot forget tokens now"
    if c.offset < n:
        return f"cannot forget {n} tokens of a {c.offset}-token cache"
    return None


def can_rollback(cache: list, n: int) -> bool:
    """Whether `rollback(cache, n)` would succeed (`restored` layers only for n = 0)."""
    return n == 0 or all(_refusal(c, n) is None for c in _leaves(cache))


def rollback(cache: list, n: int, skip_recurrent: bool = False) -> None:
    """Forget the last `n` tokens in every layer, or raise before any layer changed.
    `skip_recurrent`: the caller restores the `restored` layers from a snapshot itself."""
    if n == 0:
        return
    layers = [c for c in _leaves(cache) if not (skip_recurrent and restored(c))]
    for c in layers:
        why = _refusal(c, n)
        if why is not None:
            raise CacheRollbackError(why)
    for c in layers:
        trimmed = c.trim(n)
        if trimmed != n:  # checked above; a cache type we do not know misbehaved
            raise CacheRollbackError(f"{type(c).__name__} trimmed {trimmed} of {n} tokens")


def fresh(x):
    """`x` (an array, None, or a tuple / list of them) as new array objects with the same value
    and memory: no copy, nothing to evaluate. An in-place write to one (`a[i] = y` replaces
    that Python object's value, which is how KV caches write) leaves the other as it was."""
    return tree_map(lambda a: a[...] if isinstance(a, mx.array) else a, x)


def _rows(a, n: int):
    """A KV array's (or a quantized (w, scales, biases) tuple's) first n positions (axis -2):
    new array objects sharing the memory until either side writes (MLX then copies, as the
    buffer is no longer the writer's alone; the copy's first write past its end concatenates
    into a fresh buffer anyway)."""
    return None if a is None else tree_map(lambda x: x[..., :n, :], a)


def _copy_layer(c):
    kind = type(c)  # by exact type: a subclass may keep state this does not know of
    if kind is CacheList:
        twin = _shallow.copy(c)
        twin.caches = type(c.caches)(_copy_layer(x) for x in c.caches)
        return twin
    twin = _shallow.copy(c)  # every attribute: offset, step, window, margin, dropped, bits...
    if kind is ArraysCache:  # the layers assign new arrays into the list, never write into one
        twin.cache = [fresh(a) for a in c.cache]
        twin.left_padding, twin.lengths = fresh(c.left_padding), fresh(c.lengths)
    elif kind is WindowedKVCache:
        twin.keys, twin.values = _rows(c.keys, c.stored), _rows(c.values, c.stored)
    elif kind in (KVCache, QuantizedKVCache, ConcatenateKVCache):
        twin.keys, twin.values = _rows(c.keys, c.offset), _rows(c.values, c.offset)
    elif kind in (ChunkedKVCache, MarginChunkedKVCache):  # (it holds start_position on)
        held = c.offset - c.start_position
        twin.keys, twin.values = _rows(c.keys, held), _rows(c.values, held)
    elif compressed(c):  # its layer replaces these arrays, never writes into them
        for name in COMPRESSED_FIELDS:
            setattr(twin, name, fresh(getattr(c, name)))
    else:
        raise CacheCopyError(f"a {kind.__name__} layer cannot be copied (an unknown cache kind)")
    return twin


def copy(cache: list) -> list:
    """An independent copy of a cache `make_cache` built: every layer of the same kind with
    the same attributes, holding the same tokens in new array objects (two caches must never
    hold one array object: a KV cache writes into its arrays in place). Cheap: the arrays are
    slices that share the original's memory until either side writes. The slices are lazy:
    evaluate them (`eval_state`) before another thread uses the copy. Its `nbytes` counts the
    rows it holds (not the original's spare capacity). A layer kind it does not know raises
    `CacheCopyError` rather than be shared."""
    return [_copy_layer(c) for c in cache]


def copy_snapshot(saved: list) -> list:
    """An independent copy of what `snapshot` returned."""
    return [[fresh(a) for a in layer] for layer in saved]


def nbytes(cache: list) -> int:
    """Bytes the cache's arrays hold."""
    from mlx.utils import tree_flatten

    total = 0
    for c in cache:
        try:
            total += c.nbytes
        except (AttributeError, NotImplementedError):  # a cache kind without nbytes
            total += sum(a.nbytes for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
    return total


def eval_state(cache: list, *also) -> None:
    """Evaluate the cache's state (and `also`, e.g. the logits of the same pass)."""
    mx.eval([c.state for c in _leaves(cache)], *also)


def prefill_cache(
    model,
    cache: list,
    tokens: list[int],
    step: int = 2048,
    timed: bool = False,
    abort=None,
    hidden: dict | None = None,
) -> float | None:
    """Run `tokens` through `model`, filling `cache`, in chunks that bound peak memory.
    `abort()`, asked before each chunk, stops it with `errors.Aborted`. `hidden`: a dict
    {layer: None} whose layers' outputs over the tokens are filled in, (len(tokens), hidden);
    a `hidden.kv_of` name gets the last chunk's (keys, values): the layer's whole cache.

    `timed`: the last TIMED_STEPS tokens (at least two; fewer if the prompt is short) go in one
    at a time, as decoding steps, and the median wall time of all but the first is returned (the
    first pays the one-time costs of that shape: allocation, kernel compilation on Metal; one
    step alone swung by ±25 % on a busy 2-core CPU). None when there are too few tokens."""
    layers = tuple(hidden or ())
    parts: dict[int, list] = {i: [] for i in layers}

    def run(chunk: list[int], step: bool = False) -> None:
        with capturing(model, layers) as got:
            logits = model(mx.array(chunk)[None], cache=cache)
        for i in layers:
            parts[i].append(got[i][0])
        # a chunk's logits are not needed (the head over 2048 rows is not free); a timed
        # step's are, as in decoding
        eval_state(cache, *([logits] if step else []), *(got[i] for i in layers))

    timed = timed and len(tokens) >= 3
    steps = min(TIMED_STEPS, len(tokens) - 1) if timed else 0
    batched = tokens[: len(tokens) - steps]
    for start in range(0, len(batched), step):
        if abort is not None and abort():
            raise Aborted("stopped during the prefill")
        run(batched[start : start + step])
        mx.clear_cache()  # a long prompt's activations would otherwise stay in MLX's pool
    seconds = []
    for token in tokens[len(tokens) - steps :]:
        start = time.perf_counter()
        run([token], step=True)
        seconds.append(time.perf_counter() - start)
    for i in layers:
        if is_kv(i):  # each chunk's keys and values hold the earlier ones
            hidden[i] = parts[i][-1] if parts[i] else None
        else:
            hidden[i] = mx.concatenate(parts[i]) if parts[i] else None
    return statistics.median(seconds[1:]) if timed else None
