"""Widgets of the chat app: a reply that colours tokens by provenance, and the stats panel."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

BAR_WIDTH = 16
# C0/C1 control characters (but newline and tab) would be dropped or reach the terminal raw;
# models do emit them, so show them as replacement characters
CONTROL_CHARS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


class ReplyView(Static):
    """One assistant reply: (text, kind) pieces, re-assembled at most ~30 times a second.

    Kinds: "accepted" (a draft token the target accepted), "regenerated" (the target's
    correction of a rejected draft token), "target" (the target's own: a bonus token, or
    nothing was drafted) and "rejected" (the draft's losing guesses, shown struck through only
    when `show_rejected` is on). Colours come from the component classes in app.tcss, so they
    follow the theme.
    """

    COMPONENT_CLASSES = {
        "reply--accepted",
        "reply--regenerated",
        "reply--target",
        "reply--rejected",
        "reply--note",
    }

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.pieces: list[tuple[str, str]] = []
        self.note = ""  # e.g. "[stopped]"
        self.show_rejected = False
        self.fold_thinking = False  # a reasoning model's <think>…</think> block, folded
        self.dirty = False

    def add_pieces(self, pieces: list[tuple[str, str]]) -> None:
        self.pieces += pieces
        self.dirty = True

    def mark(self, note: str) -> None:
        self.note = note
        self.dirty = True

    def set_show_rejected(self, show: bool) -> None:
        if show != self.show_rejected:
            self.show_rejected = show
            self.dirty = True

    @property
    def text(self) -> str:
        return "".join(text for text, kind in self.pieces if kind != "rejected")

    def cut_at(self, marker: str) -> None:
        """Drop everything from the first `marker` in the reply's text on."""
        end = self.text.find(marker)
        if end < 0:
            return
        kept, length = [], 0
        for text, kind in self.pieces:
            if kind != "rejected":
                if length + len(text) > end:
                    text = text[: end - length]
                length += len(text)
            if text:
                kept.append((text, kind))
            if length >= end:
                break
        self.pieces, self.dirty = kept, True

    def _style(self, name: str) -> str:
        styles = self.get_component_styles(name)
        style = styles.color.hex
        if name == "reply--rejected":  # "the draft said blue" before "the target said red"
            style = f"strike {style}"
        return style

    def assemble(self) -> Content:
        style = {
            kind: self._style(f"reply--{kind}")
            for kind in ("accepted", "regenerated", "target", "rejected")
        }
        visible = [(t, k) for t, k in self.pieces if k != "rejected" or self.show_rejected]
        regions = think_regions("".join(t for t, _ in visible))
        parts, offset = [], 0
        for text, kind in visible:
            for start, end, inside in split_by(offset, len(text), regions):
                chunk = text[start - offset : end - offset].translate(CONTROL_CHARS)
                if not inside:
                    parts.append((chunk, style[kind]))
                elif not self.fold_thinking:  # reasoning: dimmed, colours kept
                    parts.append((chunk, f"dim {style[kind]}"))
                elif start in {a for a, _ in regions}:
                    a, b = next(r for r in regions if r[0] == start)
                    parts.append((f"[thinking: {b - a} characters — f10 unfolds]", "dim italic"))
            offset += len(text)
        if self.note:
            parts.append((f" {self.note}", self._style("reply--note")))
        return Content.assemble(*parts)

    def set_fold_thinking(self, fold: bool) -> None:
        if fold != self.fold_thinking:
            self.fold_thinking = fold
            self.dirty = True

    def refresh_if_dirty(self) -> None:
        if self.dirty:
            self.dirty = False
            self.update(self.assemble())


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def think_regions(text: str) -> list[tuple[int, int]]:
    """[start, end) of each <think>…</think> block (to the end while it is still open)."""
    regions, at = [], 0
    while (start := text.find(THINK_OPEN, at)) >= 0:
        close = text.find(THINK_CLOSE, start)
        end = len(text) if close < 0 else close + len(THINK_CLOSE)
        regions.append((start, end))
        at = end
    return regions


def split_by(offset: int, length: int, regions) -> list[tuple[int, int, bool]]:
    """Cut [offset, offset+length) at region edges: (start, end, inside a region)."""
    cuts = {offset, offset + length}
    for a, b in regions:
        cuts |= {c for c in (a, b) if offset < c < offset + length}
    edges = sorted(cuts)
    return [
        (a, b, any(r0 <= a < r1 for r0, r1 in regions))
        for a, b in zip(edges, edges[1:], strict=False)
        if b > a
    ]


SPARK = 16  # rounds in the tokens/s sparkline
STRIP = 10  # rounds in the accepted/drafted strip


def race_lines(drafted: dict, plain: dict, same: bool) -> list[str]:
    """The last turn with the draft on and off, side by side."""
    rows = [
        ("tokens/s", "tokens_per_second", "{:.1f}"),
        ("time", "generation_seconds", "{:.2f} s"),
        ("tokens/pass", "tokens_per_target_pass", "{:.2f}"),
        ("tokens", "generated_tokens", "{}"),
    ]
    lines = [f"{'race':<12} {'draft on':>10} {'draft off':>10}"]
    for label, key, fmt in rows:
        lines.append(f"{label:<12} {fmt.format(drafted[key]):>10} {fmt.format(plain[key]):>10}")
    speedup = drafted["tokens_per_second"] / max(plain["tokens_per_second"], 1e-9)
    lines += [f"speed-up     {speedup:.2f}x", f"same text    {'yes' if same else 'no (sampled)'}"]
    return lines


def sparkline(values: list[float]) -> str:
    """▁▂▃▅▇ per value, scaled to the largest."""
    top = max(values, default=0.0)
    if top <= 0:
        return ""
    return "".join("▁▂▃▄▅▆▇█"[min(7, int(v / top * 7.999))] for v in values)


def round_strip(rounds: list[tuple[int, int]]) -> str:
    """One group per round: ▮ an accepted draft token, ▯ a rejected one, · a plain step."""
    return " ".join("▮" * a + "▯" * (d - a) if d else "·" for d, a in rounds)


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of eighth-blocks for a fraction in [0, 1]."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, rest = divmod(eighths, 8)
    return ("█" * full + ("▏▎▍▌▋▊▉"[rest - 1] if rest else "")).ljust(width)


class StatsPanel(Static):
    """Live numbers that decide whether speculation pays, from a `Stats.to_json()` dict."""

    COMPONENT_CLASSES = {
        "reply--accepted",
        "reply--regenerated",
        "reply--target",
        "reply--rejected",
    }

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.stats: dict | None = None
        self.strip: list[tuple[int, int]] = []  # (drafted, accepted) of the reply's rounds
        self.speeds: list[float] = []  # tokens/s of the reply's rounds
        self.settings: dict = {}
        self.dirty = True

    def show(self, stats: dict | None = None, **settings) -> None:
        if stats is not None:
            self.stats = stats
        self.settings.update(settings)
        self.dirty = True

    def render_text(self) -> str:
        s, cfg = self.stats, self.settings
        spec = "on" if cfg.get("speculation", True) else "off"
        lines = [
            f"pair         {cfg.get('pair', '?')}",
            f"speculation  {spec}   k = {cfg.get('k', '?')}",
            f"temperature  {cfg.get('temperature', 0.0):.1f}",
            "",
        ]
        if s is None:
            return "\n".join([*lines, "no reply yet"])
        race = cfg.get("race")
        if race:
            return "\n".join([*lines, *race_lines(*race)])
        lines += [
            f"tokens/s     {s['tokens_per_second']:.1f}  {sparkline(self.speeds[-SPARK:])}",
            f"acceptance   {s['acceptance_rate']:.0%}",
            f"tokens/pass  {s['tokens_per_target_pass']:.2f}",
            f"tokens       {s['generated_tokens']} in {s['target_passes']} passes",
            f"k per round  {s['mean_draft_length']:.1f} on average",
            *self.controller_lines(s),
            f"draft passes {s.get('draft_steps', 0)} "
            f"({s.get('draft_steps', 0) / max(1, s['generated_tokens']):.2f} per token)",
            f"prompt       {s['prompt_tokens']} ({s['prompt_tokens_reused']} reused, "
            f"{s['prompt_tokens'] - s['prompt_tokens_reused']} computed)",
            f"memory       {s['peak_memory_gb']:.2f} GB",
            f"rounds       {round_strip(self.strip[-STRIP:])}",
            "",
            "acceptance by draft position",
        ]
        for i, rate in enumerate(s["acceptance_by_position"]):
            lines.append(f"{i + 1:>2} {bar(rate)} {rate:>4.0%}")
        return "\n".join(lines)

    @staticmethod
    def controller_lines(s: dict) -> list[str]:
        """What `auto` decided and why: "drafting paused: draft costs 1.50 steps"."""
        view = s.get("controller")
        if not view:
            return []
        plain = s.get("plain_tokens", 0) / max(1, s["generated_tokens"])
        lines = [f"auto         {view['state']}", f"plain        {plain:.0%} of tokens"]
        if view.get("draft_cost") is not None:
            lines.append(f"draft cost   {view['draft_cost']:.2f} target steps")
        return lines

    def assemble(self) -> Content:
        def color(kind: str) -> str:
            return self.get_component_styles(f"reply--{kind}").color.hex

        return Content.assemble(
            self.render_text(),
            "\n\n",
            ("■ accepted draft token", color("accepted")),
            "\n",
            ("■ regenerated: the target's correction", color("regenerated")),
            "\n",
            ("■ the target's own (bonus, no draft)", color("target")),
            "\n",
            ("rejected guess", f"strike {color('rejected')}"),
            " (f8 shows them)",
        )

    def refresh_if_dirty(self) -> None:
        if self.dirty:
            self.dirty = False
            self.update(self.assemble())
