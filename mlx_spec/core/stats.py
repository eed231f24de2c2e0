"""Acceptance and speed statistics, accumulated once per verify round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def count(histogram: list[int], index: int, amount: int = 1) -> None:
    """histogram[index] += amount, growing the list as needed."""
    if index >= len(histogram):
        histogram += [0] * (index + 1 - len(histogram))
    histogram[index] += amount


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0  # served from a KV cache kept across calls
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0  # accepted draft tokens among the emitted ones
    target_passes: int = 0  # verify rounds (prefill not counted)
    draft_steps: int = 0  # draft-model forward passes (prompt lookup: none)
    replayed_tokens: int = 0  # recurrent targets: tokens re-fed after a restored state
    plain_tokens: int = 0  # decoded plainly while speculating (`auto` chose k = 0)
    # structured output (grammar.py): forced tokens drafted by the grammar, and accepted
    constrained: str | None = None  # "json_schema", "lark" or "regex"
    forced_drafted: int = 0
    forced_tokens: int = 0
    mask_seconds: float = 0.0  # computing the grammar's allowed sets
    masks: int = 0
    # chosen-k histogram: rounds for which the policy asked k drafts (plain tokens at 0)
    chosen_lengths: list[int] = field(default_factory=list)
    policy: object = field(default=None, repr=False, compare=False)  # the k policy (its view)
    records: list = field(default_factory=list, repr=False)  # events.RoundRecord per round
    num_draft_tokens: int = 0  # k (the largest k when adaptive); 0 for plain decoding
    adaptive: bool = False  # k chosen per round
    # draft-length histogram: rounds that drafted exactly k tokens
    draft_lengths: list[int] = field(default_factory=list)
    # position i: how often the i-th draft token was proposed / accepted
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # accepted-length histogram: rounds in which exactly n draft tokens were accepted
    accepted_lengths: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    generation_seconds: float = 0.0
    peak_memory_gb: float = 0.0
    finish_reason: str = "length"
    # a target sharded over a group (distributed.Link): its collectives while generating
    group_size: int = 1
    collectives: int = 0
    collective_seconds: float = 0.0  # estimated: count x the latency calibrated at load
    link: object = field(default=None, repr=False, compare=False)
    _link_start: tuple = field(default=(0, 0.0), repr=False, compare=False)

    def watch(self, link) -> None:
        """Count `link`'s collectives from now on (after the prefill)."""
        self.link = link
        if link is not None:
            self.group_size = link.size
            self._link_start = (link.collectives, link.seconds)

    def add_round(self, r, elapsed: float) -> None:
        self.target_passes += 1
        self.generated_tokens += len(r.tokens)
        self.drafted += r.drafted
        self.draft_steps += r.draft_steps
        self.replayed_tokens += r.replayed
        self.accepted += r.accepted_emitted
        self.generation_seconds = elapsed
        if self.link is not None:
            self.collectives = self.link.collectives - self._link_start[0]
            self.collective_seconds = self.link.seconds - self._link_start[1]
        count(self.draft_lengths, r.drafted)
        count(self.chosen_lengths, r.requested)
        if r.plain:
            self.plain_tokens += len(r.tokens)
        if getattr(r, "forced", False):
            self.forced_drafted += r.drafted
            self.forced_tokens += r.accepted_emitted
        if r.drafted:
            for i in range(r.drafted):
                count(self.drafted_at, i)
                count(self.accepted_at, i, i < r.accepted)
            count(self.accepted_lengths, r.accepted)

    @property
    def controller(self) -> dict | None:
        """The auto controller's view: state, k, draft cost c, round costs and verify curve
        in plain steps, acceptance per position (None with a fixed k)."""
        view = self.policy.view() if self.policy is not None else {}
        return view or None

    @property
    def payoff(self):
        """Whether drafting paid by what this run measured (payoff.Payoff: the k, its speed-up
        over plain decoding, the figures), from the draft-length policy; None before a plain
        step and a round were timed, or without a draft."""
        get = getattr(self.policy, "payoff", None)
        return get() if get is not None else None

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        if not self.generation_seconds:
            return 0.0
        return self.generated_tokens / self.generation_seconds

    @property
    def prompt_tokens_per_second(self) -> float:
        computed = self.prompt_tokens - self.prompt_tokens_reused
        return computed / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def collectives_per_token(self) -> float:
        return self.collectives / self.generated_tokens if self.generated_tokens else 0.0

    @property
    def collective_share(self) -> float:
        """Share of the generation time spent in collectives (estimated)."""
        if not self.generation_seconds:
            return 0.0
        return min(1.0, self.collective_seconds / self.generation_seconds)

    @property
    def mean_draft_length(self) -> float:
        return self.drafted / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    def read_grammar(self, grammar) -> None:
        """A stream's grammar's figures so far (a grammar.GrammarProcessor; None: none)."""
        if grammar is not None:
            self.constrained = grammar.constraint.kind
            self.mask_seconds, self.masks = grammar.mask_seconds, grammar.masks

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "generated_tokens": self.generated_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_target_pass": round(self.tokens_per_target_pass, 4),
            "target_passes": self.target_passes,
            "draft_steps": self.draft_steps,
            "replayed_tokens": self.replayed_tokens,
            "plain_tokens": self.plain_tokens,
            "constrained": self.constrained,
            "forced_drafted": self.forced_drafted,
            "forced_tokens": self.forced_tokens,
            "mask_seconds": round(self.mask_seconds, 5),
            "masks": self.masks,
            "chosen_k_histogram": self.chosen_lengths,
            "controller": self.controller,
            "payoff": payoff.to_json() if (payoff := self.payoff) is not None else None,
            "num_draft_tokens": self.num_draft_tokens,
            "adaptive": self.adaptive,
            "mean_draft_length": round(self.mean_draft_length, 3),
            "draft_length_histogram": self.draft_lengths,
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "accepted_length_histogram": self.accepted_lengths,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 2),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "generation_seconds": round(self.generation_seconds, 4),
            "peak_memory_gb": round(self.peak_memory_gb, 3),
            "finish_reason": self.finish_reason,
            "group_size": self.group_size,
            "collectives": self.collectives,
            "collectives_per_token": round(self.collectives_per_token, 3),
            "collective_seconds": round(self.collective_seconds, 4),
        }

    def _auto_summary(self) -> str:
        plain = self.plain_tokens / self.generated_tokens if self.generated_tokens else 0.0
        line = f" (k auto, mean {self.mean_draft_length:.1f}, {plain:.0%} plain)"
        view = self.controller or {}
        if view.get("state", "").startswith("drafting paused"):
            line += f" · {view['state']}"
        return line

    def summary(self) -> str:
        line = f"{self.generated_tokens} tokens · {self.tokens_per_second:.1f} tok/s"
        if self.num_draft_tokens:
            accepted = f"{self.acceptance_rate:.0%}" if self.drafted else "–"  # none drafted
            line += f" · acceptance {accepted} · {self.tokens_per_target_pass:.2f} tokens/pass" + (
                self._auto_summary() if self.adaptive else f" (k={self.num_draft_tokens})"
            )
        else:
            line += " · no draft"
        if self.constrained:
            line += f" · {self.constrained}"
            if self.forced_drafted:
                line += f", {self.forced_tokens} forced token{'s' * (self.forced_tokens != 1)}"
        if self.group_size > 1:
            line += (
                f" · {self.group_size} ranks: {self.collectives_per_token:.1f} collectives/token"
                f" (~{self.collective_share:.0%} of the time)"
            )
        return line
