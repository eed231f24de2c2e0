"""Rounds -> events: each emitted token with its text (streaming detokenizer), its provenance
(accepted / regenerated / target) and live stats; `Result` collects a reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..core.provenance import ACCEPTED, REGENERATED, TARGET, round_kind
from ..core.stats import Stats
from .rounds import Round

# What produced a token (the one vocabulary, with its colours: core/provenance.py): the draft
# (and the target agreed), the target correcting a rejected draft token, or the target on its own
# (a bonus after full acceptance, or nothing drafted).


@dataclass
class Event:
    text: str  # detokenized text this token completes (may be "" while a word is unfinished)
    token: int
    accepted: bool  # True: a draft token the target accepted; False: produced by the target
    round: int  # index of the verify round that emitted it
    stats: Stats = field(repr=False)  # live statistics, updated once per round
    kind: str = ACCEPTED  # ACCEPTED, REGENERATED (a correction) or TARGET (bonus, plain)
    rejected: list[int] = field(default_factory=list)  # REGENERATED: the draft's losing guesses
    logprob: float | None = None  # under the target's distribution, when logprobs were asked for
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first


@dataclass
class RoundRecord:
    """One round as it happened: what the draft proposed and what the target made of it."""

    drafted: list[int]  # the draft's proposal (empty: a plain step, or lookup found nothing)
    accepted: int  # how many of them the target accepted
    token: int | None  # the target's own token: a correction, a bonus or a plain step
    emitted: int  # tokens this round added to the reply (an end-of-sequence token is not one)

    @property
    def kind(self) -> str:
        """provenance.ROUND_KINDS: "bonus", "correction" or "plain"."""
        return round_kind(len(self.drafted), self.accepted)

    def to_json(self) -> dict[str, Any]:
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "token": self.token,
            "kind": self.kind,
            "emitted": self.emitted,
        }


@dataclass
class Result:
    text: str
    tokens: list[int]
    accepted: list[bool]
    stats: Stats
    finish_reason: str  # "stop" (end-of-sequence), "length" (max_tokens or context)
    kinds: list[str] = field(default_factory=list)  # per token: accepted/regenerated/target
    rounds: list[RoundRecord] = field(default_factory=list)

    @classmethod
    def of(cls, events: list[Event], stats: Stats) -> Result:
        """A finished reply's events as one result."""
        return cls(
            text="".join(e.text for e in events),
            tokens=[e.token for e in events],
            accepted=[e.accepted for e in events],
            stats=stats,
            finish_reason=stats.finish_reason,
            kinds=[e.kind for e in events],
            rounds=list(stats.records),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "accepted": self.accepted,
            "kinds": self.kinds,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_json(),
            "rounds": [r.to_json() for r in self.rounds],
        }


def token_kind(r: Round, i: int) -> tuple[str, list[int]]:
    """The i-th token of round r: accepted draft, the target's correction (with the guesses
    it replaced), or the target's own token."""
    if i < r.accepted:
        return ACCEPTED, []
    if i == r.accepted < r.drafted:
        return REGENERATED, r.proposal[r.accepted :]
    return TARGET, []


class EventMaker:
    """Rounds -> batches of events, for one reply: detokenized text, provenance, live stats.
    `feed` one round, `close` at the end; a token whose text the detokenizer still holds is
    kept back until a later one completes it. `stream_rounds` and the server's batched rows
    (one maker a row) share it."""

    def __init__(self, detokenizer, stats: Stats, start: float, max_tokens: int):
        self.detokenizer, self.stats = detokenizer, stats
        self.start, self.max_tokens = start, max_tokens
        self.held: Event | None = None  # an event whose token's text is not complete yet
        self.index = 0  # rounds fed

    def feed(self, r: Round) -> list[Event]:
        stats, detokenizer, index = self.stats, self.detokenizer, self.index
        self.index += 1
        stats.add_round(r, time.perf_counter() - self.start)
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        finished = r.finished
        stats.finish_reason = "stop" if finished else "length"
        stats.records.append(RoundRecord(r.proposal, r.accepted, r.target_token, len(r.tokens)))
        events = []
        for i, token in enumerate(r.tokens):
            detokenizer.add_token(token)
            kind, rejected = token_kind(r, i)
            event = Event(
                detokenizer.last_segment, token, kind == ACCEPTED, index, stats, kind, rejected
            )
            if r.logprobs is not None:
                event.logprob, event.top_logprobs = r.logprobs[i], r.top_logprobs[i]
            events.append(event)
        if finished or stats.generated_tokens >= self.max_tokens:
            detokenizer.finalize()
            tail = detokenizer.last_segment
            if events:
                events[-1].text += tail
            elif self.held is not None:
                self.held.text += tail
        batch = []
        if events and self.held is not None:
            batch.append(self.held)
            self.held = None
        if events and not events[-1].text and not finished:
            self.held = events.pop()
        return batch + events

    def close(self) -> list[Event]:
        """The event held back, with the text the detokenizer still holds: a reply may end
        without a finishing round (a batch row whose grammar failed), and then its last
        token's text is still there (after a finishing round, nothing is)."""
        held, self.held = self.held, None
        self.detokenizer.finalize()
        if held is None:
            return []
        held.text += self.detokenizer.last_segment
        return [held]
