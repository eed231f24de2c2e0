"""/metrics behind the API keys (issue 45): each key sees the figures of its own requests;
the whole server's (queue, batches, caches, every key's totals) only an admin key sees.

Once /metrics told key B what key A did: A's exact prompt length, reply length, history
tokens, cache entries and bytes. A key's view now holds only counters of its own requests,
kept on the HTTP side from what its responses carried (usage, speculation, status), and its
own queue. Cache sizes are left out of it: the caches share one byte budget, so a key's
shrinking cache would tell it that another key is busy.

`Metrics` holds the whole server's totals, which the engine thread writes (worker.py).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from ..core.stats import Stats


@dataclass
class Counts:
    """The request totals a key's view and the whole server's have in common."""

    requests: dict = field(default_factory=dict)  # (endpoint, status) -> count (HTTP side)
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


@dataclass
class KeyFigures(Counts):
    """Totals of one partition's requests since start."""

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


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the batch-size histogram's upper bounds


@dataclass
class Metrics(Counts):
    """Totals since start (counters) for /metrics; written by the worker thread only (but
    `requests`, which the HTTP side counts)."""

    generation_seconds: float = 0.0
    prefill_seconds: float = 0.0
    batch_size: int = 0  # rows in the batch's last pass (0 when no batch runs)
    batch_size_max: int = 0
    batch_passes: int = 0  # batched target passes
    batch_rows: int = 0  # requests in them, summed over passes
    batch_target_rows: int = 0  # target rows in them (B x (k+1)), summed over passes
    batch_hist: list[int] = field(default_factory=lambda: [0] * len(BATCH_BUCKETS))
    rows_alone: int = 0  # batch rows that went on as a single stream (Engine._alone)
    rows_rejoined: int = 0  # of them, rows that joined a batch again
    streams_moved: int = 0  # lone streams that went on as batch rows (Engine._into_batch)

    def add(self, stats: Stats, passes: bool = True) -> None:
        self.prompt_tokens += stats.prompt_tokens
        self.prompt_tokens_cached += stats.prompt_tokens_reused
        self.generated_tokens += stats.generated_tokens
        self.drafted += stats.drafted
        self.accepted += stats.accepted
        if passes:  # a batched pass is counted once by add_pass, not once per row
            self.target_passes += stats.target_passes
        self.generation_seconds += stats.generation_seconds
        self.prefill_seconds += stats.prefill_seconds

    def add_pass(self, rows: int, target_rows: int) -> None:
        """One batched target pass over `rows` requests (`target_rows` token rows)."""
        self.batch_size = rows
        self.batch_size_max = max(self.batch_size_max, rows)
        self.target_passes += 1
        self.batch_passes += 1
        self.batch_rows += rows
        self.batch_target_rows += target_rows
        for i, bound in enumerate(BATCH_BUCKETS):
            if rows <= bound:
                self.batch_hist[i] += 1
                break
