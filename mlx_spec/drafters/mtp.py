"""The MTP drafter: the target's own multi-token-prediction layer (mtp_head.py) drafting k
tokens a round from the target's hidden states. Its kind (`--drafter mtp`, kinds.py) finds a
head directory or extracts one from the original checkpoint (mtp_source.py, mtp_extract.py).
"""

from __future__ import annotations

import copy
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.utils import common_prefix_len

from ..core import caches
from ..core.cache_files import arrays_layer, check_kv, check_rows, head_figures, head_layers
from ..core.hidden import FINAL_NORM, decoder_stack
from ..core.processors import apply as apply_processors
from ..core.sampling import draw
from ..errors import SpecError
from .base import Drafter
from .mtp_head import MTPHead

# ------------------------------------------------------------------------------- the drafter


def target_parts(target):
    """The target's token embedding and its output head (the tied embedding if it has none)."""
    embed = decoder_stack(target).get("embed_tokens")
    if embed is None:
        raise SpecError(f"cannot find the embedding of this {type(target).__name__}")
    owner = target.get("language_model", target)
    lm_head = owner.get("lm_head") if isinstance(owner, nn.Module) else None
    return embed, (lm_head if lm_head is not None else embed.as_linear)


class MTPDrafter(Drafter):
    """State between rounds: `tokens` is the sequence; the head's cache holds the pairs
    (h[t], s[t+1]) for positions up to `end` (exclusive), and `rows` the target's hidden
    states at positions end .. known-1 not yet fed (at least the last one, so a proposal
    always starts from the target's own state). `target_at` is the position of the first row
    the target's next pass hands over (its cache's length)."""

    hidden_layers = (FINAL_NORM,)

    def __init__(self, head: MTPHead, target, vocab: int | None = None):
        self.head = head
        self.embed, self.lm_head = target_parts(target)
        self.vocab = vocab
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        self.cache = [KVCache()]
        self.tokens: list[int] = []
        self.end = 0
        self.rows: mx.array | None = None
        self.target_at: int | None = 0
        self.spec = 0  # cache entries the last proposal added beyond the target's pairs
        self.ran = False

    def fork(self) -> MTPDrafter:
        twin = copy.copy(self)  # head, embedding, lm_head shared; end, target_at, spec: ints
        twin.cache = caches.copy(self.cache)
        twin.tokens, twin.rows = list(self.tokens), caches.fresh(self.rows)
        return twin

    # -------------------------------------------------------------------------- helpers

    def _known(self) -> int:
        return self.end + (0 if self.rows is None else self.rows.shape[0])

    def _forget(self, n: int) -> None:
        if n:
            caches.rollback(self.cache, n)

    def _run(self, ids, hidden: mx.array, at: int | None = None) -> mx.array:
        """The head over pairs (hidden (L, H), token ids (L,)) -> outputs (L, H); `at`: the
        position t of the first pair (h[t], s[t+1]), None past the target's states."""
        ids = ids if isinstance(ids, mx.array) else mx.array(ids, mx.uint32)
        embeddings = self.embed(ids)  # (L, H)
        if at == 0 and self.head.zero_first:
            embeddings = embeddings * (mx.arange(embeddings.shape[0]) > 0)[:, None]
        return self.head(embeddings[None], hidden[None], self.cache)[0]

    def _logits(self, g: mx.array) -> mx.array:
        logits = self.lm_head(self.head.final(g[None]))[0]
        if self.vocab is not None and logits.shape[-1] > self.vocab:
            logits = logits[: self.vocab]
        return logits

    # ------------------------------------------------------------------------ protocol

    def prefill(self, tokens, timed=False, output=None):
        new = output.hidden.get(FINAL_NORM) if output is not None else None
        fed = output.fed if output is not None else 0
        first = len(tokens) - 1 - fed  # the position of the output's first row
        common = common_prefix_len(self.tokens, tokens)
        # a pair (h[t], s[t+1]) still holds while s[0..t+1] are unchanged
        keep = min(self.end, max(common - 1, 0))
        start = self.end - self.cache[0].offset
        valid_old = min(self._known(), common)  # old rows stay right up to here
        if first <= keep:
            rows = new[keep - first :] if new is not None else None
        elif keep == self.end and valid_old >= first:
            old = self.rows[: first - self.end] if self.rows is not None else None
            parts = [a for a in (old, new) if a is not None and a.shape[0]]
            rows = mx.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else None)
        else:  # the hidden states between are gone: the head's cache starts again at `first`
            keep, rows, start = first, new, first + 1
        if keep < start:  # nothing of the cache is before `keep`
            self.cache = [KVCache()]
        else:
            self._forget(self.end - keep)
        self.end, self.rows = keep, rows
        self.tokens = list(tokens)
        self.target_at = len(tokens) - 1
        self.spec, self.ran = 0, False
        seconds = 0.0
        if timed:
            seconds = self._time_step()
        return seconds

    def _time_step(self) -> float | None:
        """One head step's seconds (the second of two: the first pays one-time costs)."""
        if self.rows is None or not self.rows.shape[0]:
            return None
        known = self._known()
        row, token = self.rows[-1:], self.tokens[known]
        seconds = None
        for _ in range(2):
            start = time.perf_counter()
            mx.eval(self._logits(self._run([token], row, known - 1)[-1]))
            seconds = time.perf_counter() - start
        self._forget(2)
        return seconds

    def catch_up(self) -> None:
        """Feed the rows gathered during a plain stretch, all but the last, in one pass."""
        if self.rows is None or self.rows.shape[0] < 2:
            return
        m = self.rows.shape[0] - 1
        self._run(self.tokens[self.end + 1 : self.end + m + 1], self.rows[:m], self.end)
        caches.eval_state(self.cache)
        self.end += m
        self.rows = self.rows[m:]

    def propose(self, k, params, key, *, processors=()):
        self.steps, self.spec, self.ran = 0, 0, False
        if k == 0 or self.rows is None or not self.rows.shape[0]:
            return mx.zeros((0,), mx.uint32), None
        known, n = self._known(), len(self.tokens)
        # the target's pairs not yet in the cache, in one pass; its last output is at `known`
        g = self._run(self.tokens[self.end + 1 : known + 1], self.rows, self.end)[-1]
        self.ran, self.steps = True, 1
        for pos in range(known + 1, n):  # tokens the target has not handed states for yet
            g = self._run(self.tokens[pos : pos + 1], g[None])[-1]
            self.spec += 1
            self.steps += 1
        keys = None if params.greedy else mx.random.split(key, k)
        drafted, qs = [], []
        for i in range(k):
            logits = self._logits(g)
            if processors:  # after the sequence + x1..xi, as the target's row i
                so_far = mx.concatenate(drafted) if drafted else []
                logits = apply_processors(processors, self.tokens, so_far, logits)
            y, q = draw(logits, params, None if keys is None else keys[i])
            if q is not None:
                qs.append(q)
            drafted.append(y)
            if i < k - 1:
                g = self._run(y, g[None])[-1]
                self.spec += 1
                self.steps += 1
            mx.async_eval(y)  # the device starts while Python builds the next step
        return mx.concatenate(drafted), (mx.stack(qs) if qs else None)

    def commit(self, kept, output=None):
        before = len(self.tokens)
        if self.ran:  # keep the target's pairs but the last (its row stays pending)
            fed = self.rows.shape[0]
            self._forget(self.spec + 1)
            self.end += fed - 1
            self.rows = self.rows[-1:]
        self.ran, self.spec = False, 0
        self.tokens += kept
        if output is None or self.target_at is None:
            self.target_at = None  # unknown until the next prefill
            return
        first = self.target_at
        # rows of tokens now in the sequence: the unfed ones and the accepted drafts. A
        # recurrent target that went back (output.kept = 0) computed them right all the same
        valid = before - first + len(kept) - 1
        have = self._known() - first
        hidden = output.hidden.get(FINAL_NORM)
        if hidden is not None and valid > have >= 0:
            new = hidden[have:valid]
            self.rows = new if self.rows is None else mx.concatenate([self.rows, new])
        self.target_at = first + output.kept

    def disk_state(self) -> tuple[list, dict]:
        """The head's KV cache (the pairs before `end`), then one ArraysCache of the target's
        final-norm rows not yet fed (`rows`); the tokens, `end`, `target_at` as figures."""
        figures = {"kind": type(self).__name__, "tokens": self.tokens, "end": self.end,
                   "target_at": self.target_at, "spec": self.spec, "ran": self.ran}  # fmt: skip
        rows = self.rows if self.rows is not None and self.rows.shape[0] else None  # (alike)
        return [*self.cache, arrays_layer([rows])], figures

    def restore_disk_state(self, layers: list, figures: dict, target: list) -> None:
        kind = type(self).__name__
        tokens, end, at, spec, ran = head_figures(
            figures, kind, "tokens", "end", "target_at", "spec", "ran"
        )
        head_layers(layers, [KVCache] * len(self.cache) + [ArraysCache], kind)
        *cache, extra = layers
        for c in cache:
            check_kv(c, None, None, kind)
        if len(extra.cache) != 1:
            raise SpecError(f"the stored {kind} rows are {len(extra.cache)} arrays, not 1")
        (rows,) = extra.cache
        check_rows(rows, self.head.hidden_size, kind, "hidden rows")
        end = int(end)
        if any(c.offset > end + int(spec) for c in cache):
            raise SpecError(f"the stored {kind} cache holds more pairs than its {end}")
        self.cache, self.rows, self.end = cache, rows, end
        self.tokens = [int(t) for t in tokens]
        self.target_at = None if at is None else int(at)
        self.spec, self.ran = int(spec), bool(ran)

    def settle(self) -> None:
        caches.eval_state(self.cache, *([self.rows] if self.rows is not None else []))

    def cache_bytes(self) -> int:
        rows = self.rows.nbytes if self.rows is not None else 0
        return caches.nbytes(self.cache) + rows
