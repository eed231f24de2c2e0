"""Chunked, interleaved prefill: a long prompt is prefilled a chunk at a time between the
batch's decode rounds and the chunks of other pending prefills, so one client's cold prompt
does not hold everyone's first token (issue 57: a Claude Code turn with 4,510 of its tokens
cached waited 228 s behind another client's cold 4,575-token prefill).

A request joining the batch is a `Prefill` until its prompt is prefilled but for its last
chunk: its caches live outside the batch in a standalone `engine.Decoder` (the prompt cache's
copy, or a new one), which `Decoder.prefill` extends a chunk at a time (each call reuses what
the last one filled, as a conversation's next turn does). No decode round ever touches a row
mid-prefill, whatever its caches' kinds (plain KV, windows, recurrent states, CacheLists).
The last part, at most one chunk, is prefilled by `BatchDecoder.add(kept=decoder)` as the
row joins: its timing, marks and draft catch-up stay the batch's own.

Each turn of the engine's loop spends at most one chunk of prompt tokens (`plan`), the
pending prefills taken round robin, partitions (API keys) first (`order`): prompts whose
rest fits what is left of the budget join the batch (a cached turn needs a few tokens);
else the first in turn takes a whole chunk. Nothing here touches MLX.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens one turn of the engine prefills at most. The demo target (SmolLM2-135M,
# float32, OpenBLAS) took 3.3-4.9 s for 256 tokens at 0-2k tokens of context on the shared
# 2-core CPU at load ~3, and 3.1-9.1 s for 512 at 0-3.5k (2026-12-05); a cached turn sent into
# a cold prefill got its first token 0.0-3.4 s later than alone with 256, at most one chunk
# (benchmarks/interleaved_prefill.py). A running reply waits at most one chunk between rounds.
DEFAULT_CHUNK = 256


@dataclass(eq=False)
class Prefill:
    """A request taken for the batch whose prompt is being prefilled outside it."""

    job: object  # jobs.Job
    config: object  # its GenerationConfig
    tokens: list[int]
    max_tokens: int
    stats: object  # its Stats
    kept: object | None  # the decoder its caches grow in (None: none yet, nothing reused)
    use_draft: bool  # whether the chunks feed its drafter (a head's batch needs its features)
    marks: tuple[int, ...] = ()  # prompt_cache.marks: where copies are kept as it prefills
    reused: int = 0  # prompt tokens its caches held when it was taken
    seconds: float = 0.0  # spent prefilling it so far (its wait between chunks is not)
    served: int = -1  # the turn that last gave it a chunk (-1: none yet)
    started: float = 0.0  # time.monotonic() when it was taken

    @property
    def partition(self) -> str:
        return self.job.request.partition

    def held(self) -> int:
        """Prompt tokens its caches hold (and keep for this prompt)."""
        return self.kept.reusable(self.tokens, self.use_draft) if self.kept is not None else 0

    def left(self) -> int:
        """Prompt tokens still to prefill: the caches hold all but the last token when done."""
        return len(self.tokens) - 1 - self.held()


def order(prefills: list[Prefill], partition_served: dict[str, int]) -> list[Prefill]:
    """The pending prefills in turn: the partition served longest ago first (one never served
    before all), then within it the prefill served longest ago (a new one first), then the
    one taken first."""
    return sorted(
        prefills,
        key=lambda p: (partition_served.get(p.partition, -1), p.served, p.started),
    )


def plan(lefts: list[int], chunk: int) -> list[tuple[int, bool]]:
    """One turn's prefill work over prompts in turn with `lefts` tokens still to prefill:
    (index, joins) pairs. A prompt whose rest fits what is left of the `chunk` budget joins
    the batch (its rest prefilled as it joins); the first that does not fit takes one whole
    chunk when nothing else was spent this turn; then the turn ends."""
    budget, work = chunk, []
    for i, left in enumerate(lefts):
        if left <= budget:
            work.append((i, True))
            budget -= max(left, 1)
        elif budget == chunk:
            work.append((i, False))
            budget = 0
        if budget <= 0:
            break
    return work


def shared_length(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` start with alike."""
    n, end = 0, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


def reuse_point(q: Prefill, tokens: list[int], freely: bool) -> int:
    """How much of `tokens` a copy of `q`'s caches could give once `q` is prefilled that far:
    the prefix they share where caches roll back freely, else the last of `q`'s marks inside
    it (a recurrent state or a window is kept only there, prompt_cache.py; not the prompt's
    end, which is kept once it is prefilled whole)."""
    shared = shared_length(q.tokens, tokens)
    if freely:
        return shared
    return max((m for m in q.marks if m <= shared and m < len(q.tokens) - 1), default=0)


def waits_for(p: Prefill, prefills: list[Prefill], share_min: int, freely: bool) -> Prefill | None:
    """The pending prefill of `p`'s key that `p` waits for: one ahead of it (more of the
    prompt held, or as much and taken first) that has not yet prefilled the part of `p`'s
    prompt a copy of its caches could give (`reuse_point`), when that is at least `share_min`
    more tokens than `p` holds. `p` then starts from that copy rather than prefilling the part
    too (an agent's sub-tasks, sent together with one long system prompt)."""
    mine = p.held()
    for q in prefills:
        if q is p or q.partition != p.partition:
            continue
        point, theirs = reuse_point(q, p.tokens, freely), q.held()
        ahead = theirs > mine or (theirs == mine and q.started < p.started)
        if ahead and theirs < point and point >= mine + share_min:
            return q
    return None


def chunk_end(held: int, length: int, chunk: int) -> int:
    """The prompt position a chunk from `held` prefills to (exclusive): `chunk` tokens on,
    leaving at least one token (the last, fed by the first decode round)."""
    return min(held + chunk, length - 1)
