"""Widgets of the chat app: a reply that colours tokens by provenance, and the stats panel."""

from __future__ import annotations

from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Static

from mlx_spec.core.payoff import Payoff
from mlx_spec.core.provenance import KINDS, textual_css

BAR_WIDTH = 16
# C0/C1 control characters (but newline and tab) would be dropped or reach the terminal raw;
# models do emit them, so show them as replacement characters
CONTROL_CHARS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


def kind_style(widget, kind: str) -> str:
    """The style `widget` draws pieces of `kind` in: its `reply--<kind>` component style (the
    app's CSS may change it), or the kind's own before the stylesheet reached the widget or
    after it left the screen — a refresh tick there once raised KeyError and ended the chat
    (the app's timer fired on a panel being unmounted, on a loaded 2-core machine)."""
    try:
        styles = widget.get_component_styles(f"reply--{kind}")
    except KeyError:
        return KINDS[kind].style
    style = styles.color.hex
    if styles.text_style.strike:  # rejected: "the draft said blue", then "the target said red"
        style = f"strike {style}"
    return style


class ReplyView(Vertical):
    """One assistant reply: (text, kind) pieces, re-assembled at most ~30 times a second.

    Kinds (core/provenance.py, the vocabulary and colours the CLI and the docs use too):
    "accepted" (a draft token the target accepted), "regenerated" (the target's correction of
    a rejected draft token), "target" (the target's own: a bonus token, or nothing was drafted)
    and "rejected" (the draft's losing guesses, shown struck through only when `show_rejected`
    is on). Their colours are component styles made from that module (DEFAULT_CSS).

    A long reply stays cheap to update: finished paragraphs (up to a blank line, or TAIL_LINES
    lines without one) move into Statics of their own, and an update re-renders only the live
    tail after them. A toggle that changes earlier text (f8, f10, a cut) lays them out again.
    """

    COMPONENT_CLASSES = {
        "reply--accepted",
        "reply--regenerated",
        "reply--target",
        "reply--rejected",
        "reply--note",
    }
    DEFAULT_CSS = textual_css("ReplyView")
    TAIL_LINES = 40  # a paragraph with more lines than this is frozen at its last line end

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pieces: list[tuple[str, str]] = []
        self.note = ""  # e.g. "[stopped]"
        self.show_rejected = False
        self.fold_thinking = False  # a reasoning model's <think>…</think> block, folded
        self.dirty = False
        self.relayout = False  # the text before the tail changed: freeze again from the start
        self.paragraphs: list[Static] = []  # finished, never re-rendered while streaming
        self.finished: list[Content] = []  # what they show, with the line end after each
        self.frozen = 0  # characters of the shown reply in `paragraphs`
        self.frozen_plain = ""
        self.first = (0, 0, 0)  # where the tail's first piece starts: see assemble
        self.starts: list[tuple[int, int, int]] = []
        self.tail = Static("", classes="tail")

    def compose(self):
        yield self.tail

    def on_mount(self) -> None:
        self.refresh_if_dirty()  # pieces that came before the tail was there

    def add_pieces(self, pieces: list[tuple[str, str]]) -> None:
        self.pieces += pieces
        self.dirty = True

    def mark(self, note: str) -> None:
        self.note = note
        self.dirty = True

    def set_show_rejected(self, show: bool) -> None:
        if show != self.show_rejected:
            self.show_rejected = show
            self.dirty = self.relayout = True

    def set_fold_thinking(self, fold: bool) -> None:
        if fold != self.fold_thinking:
            self.fold_thinking = fold
            self.dirty = self.relayout = True

    @property
    def text(self) -> str:
        return "".join(text for text, kind in self.pieces if kind != "rejected")

    @property
    def content(self) -> Content:
        """What is on screen: the finished paragraphs and the tail, as one Content."""
        return Content("").join([*self.finished, self.tail.content])

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
        self.pieces, self.dirty, self.relayout = kept, True, True

    def _style(self, name: str) -> str:
        return kind_style(self, name.removeprefix("reply--"))

    def shows(self, kind: str) -> bool:
        """Whether pieces of this kind are on screen (rejected guesses: only with f8)."""
        return kind != "rejected" or self.show_rejected

    def assemble(self, first: tuple[int, int, int] = (0, 0, 0)) -> Content:
        """The reply from `first` on: (piece index, its offset in the pieces' shown text, its
        offset on screen), as recorded in `self.starts` for every piece it went through. Think
        blocks are found in the whole text, so a folded block's placeholder knows its size."""
        style = {
            kind: self._style(f"reply--{kind}")
            for kind in ("accepted", "regenerated", "target", "rejected")
        }
        regions = think_regions("".join(t for t, k in self.pieces if self.shows(k)))
        region_end = dict(regions)
        index, offset, shown = first
        parts, self.starts = [], []
        for text, kind in self.pieces[index:]:
            if self.shows(kind):
                self.starts.append((index, offset, shown))
                for start, end, inside in split_by(offset, len(text), regions):
                    chunk = text[start - offset : end - offset].translate(CONTROL_CHARS)
                    if inside and self.fold_thinking:  # the whole block: one placeholder
                        if start not in region_end:
                            continue
                        chunk = f"[thinking: {region_end[start] - start} characters — f10 unfolds]"
                        chunk_style = "dim italic"
                    elif inside:  # reasoning: dimmed, colours kept
                        chunk_style = f"dim {style[kind]}"
                    else:
                        chunk_style = style[kind]
                    parts.append((chunk, chunk_style))
                    shown += len(chunk)
                offset += len(text)
            index += 1
        if self.note:
            parts.append((f" {self.note}", self._style("reply--note")))
        return Content.assemble(*parts)

    def refresh_if_dirty(self) -> None:
        if not self.dirty or self.tail.parent is None:  # not composed yet: the next tick
            return
        self.dirty = False
        if self.relayout:
            self.relayout = False
            self.unfreeze()
        content = self.assemble(self.first)
        at = self.first[2]  # where `content` begins on screen
        if not content.plain.startswith(self.frozen_plain[at:]):  # never keep stale paragraphs
            self.unfreeze()
            content, at = self.assemble(), 0
        live = self.frozen - at
        end = paragraph_end(content.plain, live, self.TAIL_LINES)
        if end > live:
            # a block ends a line: its own last newline would add an empty one
            block = Static(content[live : end - 1])
            self.paragraphs.append(block)
            self.finished.append(content[live:end])
            self.mount(block, before=self.tail)
            self.frozen_plain += content.plain[live:end]
            self.frozen = at + end
            # the tail's first piece: the last one that starts at or before the boundary
            self.first = next(s for s in reversed(self.starts) if s[2] <= self.frozen)
            live = end
        self.tail.update(content[live:])

    def unfreeze(self) -> None:
        for block in self.paragraphs:
            block.remove()
        self.paragraphs, self.finished, self.frozen, self.frozen_plain = [], [], 0, ""
        self.first = (0, 0, 0)


def paragraph_end(text: str, start: int, max_lines: int) -> int:
    """Where the finished paragraphs in text[start:] end: after the last blank line's first
    newline (the blank line itself begins the next block), else after the line that makes
    the tail longer than `max_lines`; `start` when nothing is finished."""
    blank = text.rfind("\n\n", start)
    if blank >= 0:
        return blank + 1
    if text.count("\n", start) > max_lines:
        return text.rfind("\n", start) + 1
    return start


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
STRIP = 28  # characters of the accepted/drafted strip: one row of the panel


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


def round_strip(rounds: list[tuple[int, int]], width: int = STRIP) -> str:
    """The last rounds that fit in `width` characters, one group per round: ▮ an accepted draft
    token, ▯ a rejected one, · a plain step."""
    groups, used = [], -1
    for d, a in reversed(rounds):
        group = "▮" * a + "▯" * (d - a) if d else "·"
        if used + 1 + len(group) > width:
            break
        groups.append(group)
        used += 1 + len(group)
    return " ".join(reversed(groups))


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
    DEFAULT_CSS = textual_css("StatsPanel")

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
            *self.verdict_lines(s),
            f"tokens       {s['generated_tokens']} in {s['target_passes']} passes",
            f"k per round  {s['mean_draft_length']:.1f} on average",
            *self.controller_lines(s),
            f"draft passes {s.get('draft_steps', 0)} "
            f"({s.get('draft_steps', 0) / max(1, s['generated_tokens']):.2f} per token)",
            f"prompt       {s['prompt_tokens']} ({s['prompt_tokens_reused']} reused, "
            f"{s['prompt_tokens'] - s['prompt_tokens_reused']} computed)",
            f"memory       {s['peak_memory_gb']:.2f} GB",
            f"rounds       {round_strip(self.strip)}",
            "",
            "acceptance by draft position",
        ]
        for i, rate in enumerate(s["acceptance_by_position"]):
            lines.append(f"{i + 1:>2} {bar(rate)} {rate:>4.0%}")
        return "\n".join(lines)

    @staticmethod
    def verdict_lines(s: dict) -> list[str]:
        """Whether drafting pays by what the replies measured, in the words `probe` and
        `generate` use (payoff.Payoff): "pays, 1.22x at k=1"."""
        if not s.get("num_draft_tokens"):
            return []
        payoff = s.get("payoff")
        words = Payoff.from_json(payoff).short() if payoff else "not measured yet"
        return [f"verdict      {words}"]

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
        """The numbers, then the legend: each kind's name in its colour and what it means."""
        legend = []
        for kind in KINDS.values():
            legend += ["\n", (kind.name, kind_style(self, kind.name)), f" {kind.meaning}"]
        return Content.assemble(self.render_text(), "\n", *legend)

    def refresh_if_dirty(self) -> None:
        if self.dirty:
            self.dirty = False
            self.update(self.assemble())
