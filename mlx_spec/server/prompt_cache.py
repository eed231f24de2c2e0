"""The server's prompt cache: kept decoders (target caches and drafter state) in a trie of the
token sequences they hold, so a request prefills only what no earlier request computed.

An agent's requests branch: a sub-task sends the parent's system prompt and tools, then a
conversation of its own, while the parent goes on. Every branch is kept, and a request gets a
*copy* (`Decoder.fork`) of the entry it shares most with, never the entry itself, so the
parent's next turn still finds its own. Entries are saved where a conversation's segments end,
as mlx-lm's server (0.32, `LRUPromptCache`) does:

- "system": the end of the system prompt and tools, the part every branch shares;
- "user": the end of the prompt, before the reply;
- "assistant": the end of the reply (what the next turn continues).

A cache that rolls back any number of tokens (plain KV layers) needs only the last: a branch
copies it and rolls back to where it parts, so a saved sequence makes its kept prefixes
redundant and they are dropped. A recurrent state (Qwen3.5, Mamba) cannot forget anything and
a sliding window only its margin, so for those the request's decoder is copied at the two
marks inside the prompt as it prefills (`marks`), and kept prefixes stay.

The bytes are bounded per server, across partitions (`trim`), evicting in mlx-lm's order:
assistant entries before user ones before system ones, least recently used first within a
kind, unless a later kind holds more entries than the earlier one. Every kept entry is also
written to the disk tier (disk_cache.py) as it is kept; an evicted one is found there again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..core import caches
from ..core.cache_files import model_identity
from ..decode.generate import make_decoder
from ..decode.history import HistoryIndex
from ..errors import SpecError

SEGMENTS = ("assistant", "user", "system")  # eviction order: the first kind goes first


def decoder_bytes(decoder) -> int:
    total = caches.nbytes(decoder.cache)
    return total + (decoder.drafter.cache_bytes() if decoder.drafter is not None else 0)


class _Node:
    __slots__ = ("edges", "value")

    def __init__(self):
        self.edges: dict[int, tuple[tuple, _Node]] = {}  # first token -> (run, child)
        self.value = None


def _shared(run: tuple, tokens: list[int], at: int) -> int:
    """How many of `run`'s tokens `tokens[at:]` starts with."""
    n, end = 0, min(len(run), len(tokens) - at)
    while n < end and run[n] == tokens[at + n]:
        n += 1
    return n


class PromptTrie:
    """Token sequences -> values, as a radix trie: one node where kept sequences part, each
    edge a run of tokens. A search walks the prompt once, whatever the number of entries."""

    def __init__(self):
        self.root = _Node()
        self.size = 0

    def add(self, tokens: list[int], value):
        """Keep `value` for `tokens`; returns the value it replaces (None: a new sequence)."""
        node, i = self.root, 0
        while i < len(tokens):
            edge = node.edges.get(tokens[i])
            if edge is None:
                leaf = _Node()
                node.edges[tokens[i]] = (tuple(tokens[i:]), leaf)
                node, i = leaf, len(tokens)
                break
            run, child = edge
            n = _shared(run, tokens, i)
            if n < len(run):  # the sequences part inside this run: a node there
                middle = _Node()
                middle.edges[run[n]] = (run[n:], child)
                node.edges[tokens[i]] = (run[:n], middle)
                child = middle
            node, i = child, i + n
        previous, node.value = node.value, value
        self.size += previous is None
        return previous

    def pop(self, tokens: list[int]):
        """Forget the value kept for exactly `tokens` (KeyError if none), pruning the trie."""
        path, node, i = [], self.root, 0  # (parent, first token) down to node
        while i < len(tokens):
            edge = node.edges.get(tokens[i])
            if edge is None or _shared(edge[0], tokens, i) < len(edge[0]):
                raise KeyError("no entry for these tokens")
            path.append((node, tokens[i]))
            node, i = edge[1], i + len(edge[0])
        if node.value is None:
            raise KeyError("no entry for these tokens")
        value, node.value = node.value, None
        self.size -= 1
        while path and node.value is None and len(node.edges) <= 1:
            parent, first = path.pop()
            run, _ = parent.edges.pop(first)
            if node.edges:  # one child left: its run joins the parent's edge
                ((child_run, child),) = node.edges.values()
                parent.edges[first] = (run + child_run, child)
            node = parent
        return value

    def search(self, tokens: list[int]) -> tuple[list, int, list]:
        """(the values of kept prefixes of `tokens`, shortest first; how many tokens the trie
        holds a path for; the values kept below that point: sequences that share exactly
        that many tokens with `tokens`, or extend it)."""
        along, node, i = [], self.root, 0
        while True:
            if node.value is not None:
                along.append(node.value)
            edge = node.edges.get(tokens[i]) if i < len(tokens) else None
            if edge is None:
                return along, i, [v for _, child in node.edges.values() for v in _values(child)]
            run, child = edge
            n = _shared(run, tokens, i)
            if n < len(run):
                return along, i + n, _values(child)
            node, i = child, i + n

    def values(self) -> list:
        return _values(self.root)


def _values(node: _Node) -> list:
    out, todo = [], [node]
    while todo:
        node = todo.pop()
        if node.value is not None:
            out.append(node.value)
        todo.extend(child for _, child in node.edges.values())
    return out


@dataclass(eq=False)
class Entry:
    """A kept decoder and what the prompt cache knows of it."""

    decoder: object  # engine.Decoder, never generated from (requests get forks)
    segment: str  # "system", "user" or "assistant": what its sequence ends with
    bytes: int
    last_used: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> list[int]:
        return self.decoder.sequence


class PromptCache:
    """One partition's kept decoders (an API key's, or the default one's)."""

    def __init__(
        self, pair, max_bytes: int, history: HistoryIndex | None, disk=None, partition: str = ""
    ):
        self.pair, self.max_bytes, self.history = pair, max_bytes, history
        self.trie = PromptTrie()
        self.bytes = 0
        # plain KV layers: the reply's entry serves every prefix, no marks (module docstring)
        self.freely = pair is None or caches.rolls_back_freely(
            caches.make_cache(pair.target, strict=False)
        )
        # the disk tier (disk_cache.py): this partition's folder for this pair's entries
        self.disk = disk if pair is not None and pair.target_path is not None else None
        self.folder = None
        self.measured = None  # the last kept decoder's `Decoder.measured()`
        if self.disk is not None:
            model = model_identity(pair)
            self.disk.describe(model, pair)
            self.folder = self.disk.folder(model, partition)

    @property
    def entries(self) -> list[Entry]:
        """The kept entries, least recently used first."""
        return sorted(self.trie.values(), key=lambda e: e.last_used)

    def new(self):
        decoder = make_decoder(self.pair)
        if self.history is not None:
            decoder.drafter.use_history(self.history)
        return decoder

    def fetch(self, tokens: list[int]):
        """A copy of the kept decoder that would reuse the most of `tokens` (None when none
        reuses any): the longest kept prefix of the prompt, or a longer sequence that parts
        from it later and can roll back to there. Ties go to the most recently used."""
        along, _, below = self.trie.search(tokens)
        best, most = None, 0
        for entry in along + below:
            reuse = entry.decoder.reusable(tokens)
            if reuse > most or (
                best is not None and reuse == most and entry.last_used > best.last_used
            ):
                best, most = entry, reuse
        loaded = self._from_disk(tokens, most)
        if loaded is not None:
            best = loaded
        if best is None:
            return None
        best.last_used = time.monotonic()
        try:
            return best.decoder.fork()
        except SpecError:  # a cache or drafter kind that cannot be copied: start afresh
            return None

    def _from_disk(self, tokens: list[int], most: int) -> Entry | None:
        """The disk entry that reuses more of `tokens` than the RAM's best (`most`), loaded
        into a RAM entry, when loading it beats prefilling what it saves; None otherwise."""
        if self.disk is None or not self.disk.enabled:
            return None
        found, reuse = self.disk.best(self.folder, tokens, self.freely)
        if found is None or not self.disk.worth_loading(found, reuse - most):
            if reuse <= most:
                self.disk.metrics.misses += 1
            return None
        decoder = self.disk.load(found, self.new())
        if decoder is None:
            return None
        if self.measured is not None:  # a file keeps no policy: the last one kept here
            decoder.take_measured(self.measured)
        if decoder.reusable(tokens) <= most:  # (the index promised more than the state holds)
            return None
        entry = Entry(decoder, found.segment, decoder_bytes(decoder))
        previous = self.trie.add(decoder.sequence, entry)
        self.bytes += entry.bytes - (previous.bytes if previous is not None else 0)
        return entry

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill's rate, which loading from disk must beat."""
        if self.disk is not None:
            self.disk.note_prefill(tokens, seconds)

    def take(self, tokens: list[int]):
        """The decoder a request generates with: a copy of the best entry, or a new one."""
        return self.fetch(tokens) or self.new()

    def marks(self, tokens: list[int], system_end: int | None) -> tuple[int, ...]:
        """Where, inside `tokens`, a request's decoder is copied as it prefills (see the module
        docstring): none for caches that roll back freely (the reply's entry serves every
        prefix), else the end of the system segment and of the prompt."""
        if self.freely:
            return ()
        ends = [len(tokens) - 1]
        if system_end is not None and 0 < system_end < len(tokens) - 1:
            ends.insert(0, system_end)
        return tuple(ends)

    def save(self, decoder, segment: str) -> None:
        """Keep `decoder` (the caller hands it over: nothing generates with it any more). A
        decoder that may be mid-round or holds nothing is not kept. Caches that roll back
        freely make every kept prefix of its sequence redundant: those are dropped."""
        if decoder.stale or decoder.active or not decoder.sequence:
            return
        decoder.settle()
        # what auto measured, for a decoder loaded from disk (a RAM entry's fork keeps its own)
        self.measured = decoder.measured()
        entry = Entry(decoder, segment, decoder_bytes(decoder))
        previous = self.trie.add(decoder.sequence, entry)
        self.bytes += entry.bytes - (previous.bytes if previous is not None else 0)
        if self.disk is not None:  # written as it is kept: a kill -9 loses nothing kept
            self.disk.write(self.folder, decoder, segment)
        if self.freely:
            along, _, _ = self.trie.search(decoder.sequence)
            for kept in along:
                if kept is not entry:
                    self.drop(kept)

    def keep_copy(self, decoder, segment: str) -> None:
        """Keep a copy of `decoder` as it is now (it goes on generating); nothing when its
        kinds cannot be copied (Decoder.fork refuses them)."""
        try:
            twin = decoder.fork()
        except SpecError:
            return
        self.save(twin, segment)

    def drop(self, entry: Entry) -> None:
        """Forget an entry a longer one made redundant, on disk too."""
        self.evict(entry)
        if self.disk is not None:
            self.disk.forget(self.folder, entry.tokens)

    def evict(self, entry: Entry) -> None:
        """Out of RAM (the byte budget): its file, if any, stays for a later request."""
        self.trie.pop(entry.tokens)
        self.bytes -= entry.bytes

    def trim(self) -> None:
        """Evict until the kept bytes fit in max_bytes."""
        trim([self], self.max_bytes)

    def clear(self) -> None:
        self.trie, self.bytes = PromptTrie(), 0


def trim(prompt_caches: list[PromptCache], max_bytes: int) -> None:
    """Evict entries of all `prompt_caches` together until their bytes fit in `max_bytes`, in
    mlx-lm's order: from the first segment kind in SEGMENTS that holds at least as many
    entries as the next, least recently used first."""
    queues = {kind: [] for kind in SEGMENTS}
    for cache in prompt_caches:
        for entry in cache.trie.values():
            queues[entry.segment].append((entry.last_used, id(entry), entry, cache))
    for queue in queues.values():
        queue.sort(key=lambda t: t[:2], reverse=True)  # least recently used last: pop()
    total = sum(c.bytes for c in prompt_caches)
    while total > max_bytes:
        kind = next(
            (
                a
                for a, b in zip(SEGMENTS, SEGMENTS[1:], strict=False)
                if queues[a] and len(queues[a]) >= len(queues[b])
            ),
            next((k for k in reversed(SEGMENTS) if queues[k]), None),
        )
        if kind is None:
            break
        _, _, entry, cache = queues[kind].pop()
        cache.evict(entry)
        total -= entry.bytes
