"""The resident pair: loaded (and swapped) on the engine thread, with what belongs to it.

One pair is resident at a time. With it live its partitions' prompt caches and history
indexes (a swap drops them: their caches hold the old pair's states) and, with --max-batch N,
the `batch.BatchDecoder` the runner steps (drafting with a draft model, lookup, an EAGLE-3
head, the target's MTP layer or a DFlash head, beside any target a batch takes). A pair whose
drafter a batch cannot take (a kind that does not say how) batches plainly;
`batch_refusal` says why a pair does not batch, or does not draft in a batch.

Only the engine thread changes it; the HTTP side reads `pair` and `name` to tokenise a
request's prompt ahead (prompts.prepare) and the figures for /metrics.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import mlx.core as mx

from ..decode.generate import make_batch_decoder
from ..decode.history import HistoryIndex
from ..errors import SpecError
from .prompt_cache import PromptCache, trim
from .protocol import ApiError, GenRequest


class Resident:
    """The pair requests run on, its prompt caches and history per partition, its batch."""

    def __init__(
        self,
        loader: Callable[[str], object],
        models: list[str],
        *,
        prompt_cache_bytes: int = 2 << 30,
        history_tokens: int = 0,
        max_batch: int = 1,
        disk=None,
    ):
        self.loader, self.models = loader, models
        self.disk = disk  # disk_cache.DiskStore, or None (--no-disk-cache)
        self.prompt_cache_bytes = prompt_cache_bytes
        self.history_tokens = history_tokens  # 0: no history lookup
        self.max_batch = max_batch  # 1: one stream at a time
        self.batch_refusal = "--max-batch 1"  # why the pair is not batched (or not drafted)
        self.partitions: dict[str, tuple] = {}  # key -> (PromptCache, HistoryIndex | None)
        self.install(None, "")

    def install(self, pair, name: str) -> None:
        self.pair, self.name = pair, name
        self.history = self._new_history()
        self.cache = PromptCache(pair, self.prompt_cache_bytes, self.history, self.disk)
        self.batch, self.batch_plain = None, False  # a BatchDecoder, when the pair batches
        if pair is not None and self.max_batch > 1:
            self.batch = self.new_batch()
        # a lone request runs as a single stream where a batch row does worse alone: a plain
        # batch (it would not draft), a head's (the demo pair's EAGLE-3 head at k = 1: a batch
        # of one at 0.68x the single stream, 2026-12-03, serve_batch.py), and a recurrent
        # target's (a single stream keeps checkpoints of its state at the end of the system
        # part and of the prompt as it prefills; a batch row only at the first, and none with
        # a head). Such a stream moves into the batch when another request comes.
        self.lone_alone = self.batch is not None and (
            self.batch_plain or self.batch.heads is not None or self.batch.recurrent
        )

    def new_batch(self):
        """A fresh BatchDecoder for the pair (None, with `batch_refusal` saying why, when it
        cannot batch); `batch_plain` when it batches without drafts."""
        pair, self.batch_plain = self.pair, False
        try:  # checked once: the caches' kinds and the drafter's (batch_drafting)
            return make_batch_decoder(pair)
        except SpecError as err:
            self.batch_refusal = str(err)
        drafting = pair.config.kind.batch_drafting(pair) if pair.speculative else {}
        if pair.speculative:
            # a drafter a batch cannot take (a kind that does not say how): the target may
            # still batch plainly, and a lone request drafts as a single stream
            try:
                batch, self.batch_plain = make_batch_decoder(pair, plain=True), True
                if drafting is None:
                    self.batch_refusal = f"the {pair.config.drafter} drafter is not batched yet"
                return batch
            except SpecError as err:
                self.batch_refusal = str(err)
        return None

    def _new_history(self) -> HistoryIndex | None:
        """A history for lookup across requests, when the drafter kind uses one."""
        kind = self.pair.config.kind if self.pair is not None else None
        uses = kind is not None and kind.uses_history
        if not (uses and self.history_tokens):
            return None
        index = kind.history_index(self.history_tokens)
        return index if index is not None else HistoryIndex(self.history_tokens)

    @property
    def drafter(self) -> str:
        if self.pair is None or not self.pair.speculative:
            return "none"
        return self.pair.config.drafter

    def partition(self, key: str) -> tuple:
        """The prompt cache and history of one partition (the default one is `cache` and
        `history`, made by `install`); made again after a swap."""
        if key == "":
            return self.cache, self.history
        entry = self.partitions.get(key)
        if entry is None or entry[0].pair is not self.pair:
            history = self._new_history()
            cache = PromptCache(self.pair, self.prompt_cache_bytes, history, self.disk, key)
            entry = (cache, history)
            self.partitions[key] = entry
        return entry

    def all_caches(self) -> list:
        caches = [self.cache]
        caches += [c for c, _ in self.partitions.values() if c.pair is self.pair]
        return caches

    def history_size(self) -> int:
        histories = [self.history] + [h for c, h in self.partitions.values() if c.pair is self.pair]
        return sum(len(h) for h in histories if h is not None)

    def trim_caches(self) -> None:
        """Keep all partitions' kept caches within --prompt-cache together, in mlx-lm's
        eviction order (prompt_cache.trim; a partition's size says how much was kept, never
        what)."""
        trim(self.all_caches(), self.prompt_cache_bytes)

    def pair_for(self, model: str):
        """The pair for a request's `model`: the resident one, or that one loaded in its
        place (a 404 for a name the server does not know or a pair that cannot load)."""
        if model == self.name and self.pair is not None:
            return self.pair
        if model not in self.models:
            message = f"The model {model!r} does not exist; see /v1/models"
            raise ApiError(404, message, "model", "model_not_found")
        # one pair resident: free the old one before loading the next
        self.install(None, "")
        gc.collect()
        mx.clear_cache()
        try:
            pair = self.loader(model)
        except SpecError as err:
            raise ApiError(404, f"the pair {model!r} cannot be loaded: {err}", "model") from None
        except Exception as err:  # a broken file, out of memory, ...: the next request retries
            message = f"the pair {model!r} failed to load: {type(err).__name__}: {err}"
            raise ApiError(503, message, "model") from None
        self.install(pair, model)
        return pair

    def batchable(self, req: GenRequest) -> bool:
        """Whether this request may join the batch: the resident pair batches and it needs
        no swap (a row takes processors, logprobs and grammars as a single stream does). In a
        plain batch (a head pair) a seeded sampled request is not batched: alone it drafts,
        and its samples are the ones it gets every time only if it always runs alone."""
        if self.batch is None or req.model != self.name:
            return False
        config = req.generation
        return not (self.batch_plain and config.seed is not None and not config.sampling.greedy)
