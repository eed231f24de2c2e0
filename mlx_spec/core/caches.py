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

`rollback` checks that every layer forgot exactly what was asked; a cache that cannot raises
`CacheRollbackError` — never a silently wrong state. `prefill_cache` fills a cache with a
prompt in chunks (the decoders' prefill of the target, a draft model's).
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_attention_mask,
    make_prompt_cache,
)

from ..errors import Aborted, SpecError
from .hidden import capturing

# Past tokens a sliding-window layer keeps beyond its window: the longest roll-back it allows
# (a verify pass of k+1 tokens, or the end of a previous turn that a chat template re-renders).
WINDOW_MARGIN = 128
# single-token steps a timed prefill ends with (prefill_cache): the first pays one-time costs,
# the median of the others is the step's time
TIMED_STEPS = 4
# Tokens allowed to pile up before the buffer is compacted (one copy per SLACK tokens).
WINDOW_SLACK = 256


class CacheRollbackError(SpecError):
    """A cache was asked to forget more than it can."""


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
    return c


# Layer caches whose trim is exact at any length (checked by class, not by is_trimmable(),
# which says only whether a trim is possible now). ArraysCache is snapshotted instead.
ROLLBACK_TYPES = (KVCache, QuantizedKVCache, ConcatenateKVCache, ArraysCache)


def make_cache(model, role: str = "target", strict: bool = True) -> list:
    """The model's prompt cache with every layer able to roll back (or be snapshotted);
    a layer kind that cannot is refused here, before any token is produced. `strict=False`
    (plain decoding, which rolls back only its look-ahead step) accepts any cache: a failed
    roll-back then raises and the caller starts over."""
    cache = [_convert(c) for c in make_prompt_cache(model)]
    if not strict:
        return cache
    unsupported = sorted(
        {type(c).__name__ for c in _leaves(cache) if not isinstance(c, ROLLBACK_TYPES)}
    )
    if unsupported:
        raise SpecError(
            f"the {role} model's KV cache ({', '.join(unsupported)}) cannot be rolled back, "
            "so it cannot be used for speculative decoding"
        )
    return cache


def is_recurrent(cache: list) -> bool:
    """Whether some layer keeps a recurrent state (restored from snapshots, never trimmed)."""
    return any(isinstance(c, ArraysCache) for c in _leaves(cache))


def snapshot(cache: list) -> list:
    """The recurrent layers' state, cheaply: the arrays are immutable, the lists are copied."""
    return [list(c.cache) for c in _leaves(cache) if isinstance(c, ArraysCache)]


def restore(cache: list, saved: list) -> None:
    layers = [c for c in _leaves(cache) if isinstance(c, ArraysCache)]
    for c, s in zip(layers, saved, strict=True):
        c.cache = list(s)


def can_rollback(cache: list, n: int) -> bool:
    """Whether `rollback(cache, n)` would succeed (recurrent layers only for n = 0)."""
    if n == 0:
        return True
    for c in _leaves(cache):
        if isinstance(c, ArraysCache):
            return False
        if isinstance(c, WindowedKVCache) and not c.can_trim(min(n, c.offset)):
            return False
        if not c.is_trimmable() or c.offset < n:
            return False
    return True


def rollback(cache: list, n: int, skip_recurrent: bool = False) -> None:
    """Forget the last `n` tokens in every layer, or raise. `skip_recurrent`: the caller
    restores the recurrent layers from a snapshot itself."""
    if n == 0:
        return
    layers = [c for c in _leaves(cache) if not (skip_recurrent and isinstance(c, ArraysCache))]
    for c in layers:
        if isinstance(c, ArraysCache):
            raise CacheRollbackError("a recurrent layer's state cannot be rolled back")
        if isinstance(c, WindowedKVCache) and not c.can_trim(n):
            raise CacheRollbackError(
                f"a sliding-window layer cannot forget {n} tokens (it keeps {c.margin} beyond "
                f"its window of {c.window})"
            )
        if not c.is_trimmable():  # e.g. a RotatingKVCache past its window: trim would lie
            raise CacheRollbackError(f"a {type(c).__name__} layer cannot forget tokens now")
        if c.offset < n:
            raise CacheRollbackError(f"cannot forget {n} tokens of a {c.offset}-token cache")
    for c in layers:
        trimmed = c.trim(n)
        if trimmed != n:  # checked above; a cache type we do not know misbehaved
            raise CacheRollbackError(f"{type(c).__name__} trimmed {trimmed} of {n} tokens")


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
    {layer: None} whose layers' outputs over the tokens are filled in, (len(tokens), hidden).

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
        hidden[i] = mx.concatenate(parts[i]) if parts[i] else None
    return statistics.median(seconds[1:]) if timed else None
