"""/metrics behind the API keys (issue 45): each key sees the figures of its own requests;
the whole server's (queue, batches, caches, every key's totals) only an admin key sees.

Once /metrics told key B what key A did: A's exact prompt length, reply length, history
tokens, cache entries and bytes. A key's view now holds only counters of its own requests,
kept on the HTTP side from what its responses carried (usage, speculation, status), and its
own queue. Cache sizes are left out of it: the caches share one byte budget, so a key's
shrinking cache would tell it that another key is busy.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field


@dataclass
class KeyFigures:
    """Totals of one partition's requests since start."""

    requests: dict = field(default_factory=dict)  # (endpoint, status) -> count
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    target_passes: int = 0
    cancelled: int = 0
    timeouts: int = 0

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def add(self, usage: dict, spec: dict) -> None:
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        self.prompt_tokens_cached += details.get("cached_tokens", 0)
        self.generated_tokens += usage.get("completion_tokens", 0)
        self.drafted += spec.get("drafted", 0)
        self.accepted += spec.get("accepted", 0)
        self.target_passes += spec.get("target_passes", 0)


class KeyMetrics:
    """Figures by partition, and who may see what."""

    def __init__(self, admin_keys: list[str]):
        self.admin_keys = [k for k in admin_keys if k]
        self.figures: dict[str, KeyFigures] = {}

    def of(self, partition: str) -> KeyFigures:
        if partition not in self.figures:
            if len(self.figures) > 4096:  # partitions are API keys: few; never unbounded
                self.figures.clear()
            self.figures[partition] = KeyFigures()
        return self.figures[partition]

    def is_admin(self, authorization: str) -> bool:
        scheme, _, token = authorization.partition(" ")
        token_bytes = token.strip().encode()
        match = False
        for key in self.admin_keys:  # every key compared: the time does not tell which
            match |= hmac.compare_digest(token_bytes, key.encode())
        return match and scheme.lower() == "bearer"


class Exposition:
    """Prometheus' text format, one family at a time: the writer the whole server's /metrics
    and a key's own view share (their names are the same)."""

    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, samples) -> None:
        self.lines.append(f"# HELP mlx_spec_{name} {help_text}")
        self.lines.append(f"# TYPE mlx_spec_{name} {kind}")
        for labels, value in samples:
            self.lines.append(f"mlx_spec_{name}{labels} {value}")

    def each(self, kind: str, rows) -> None:
        """(name, help, value) rows of unlabelled samples of one kind."""
        for name, help_text, value in rows:
            self.metric(name, kind, help_text, [("", value)])

    def requests(self, counts: dict, help_text: str) -> None:
        samples = [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(counts.items())]
        self.metric("requests_total", "counter", help_text, samples)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def key_metrics_text(figures: KeyFigures, waiting: int) -> str:
    """The Prometheus text of one key's own figures (the names of the global view)."""
    out, f = Exposition(), figures
    out.requests(f.requests, "This key's requests, by endpoint and status.")
    counters = [
        ("prompt_tokens_total", "Prompt tokens of this key's requests.", f.prompt_tokens),
        ("prompt_tokens_cached_total", "Of them, reused from a kept KV cache.",
         f.prompt_tokens_cached),
        ("generated_tokens_total", "Tokens generated for this key.", f.generated_tokens),
        ("drafted_tokens_total", "Draft tokens proposed for this key.", f.drafted),
        ("accepted_tokens_total", "Of them, accepted by the target.", f.accepted),
        ("target_passes_total", "Target passes of this key's requests.", f.target_passes),
        ("cancelled_total", "This key's requests stopped because their client left.",
         f.cancelled),
        ("timeouts_total", "This key's requests stopped by the request timeout.", f.timeouts),
    ]  # fmt: skip
    out.each("counter", counters)
    rate = f.accepted / f.drafted if f.drafted else 0.0
    out.each(
        "gauge",
        [
            ("acceptance_rate", "Accepted / drafted for this key.", round(rate, 4)),
            ("queue_waiting", "This key's requests waiting for the engine.", waiting),
        ],
    )
    return out.text()
