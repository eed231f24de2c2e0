"""Widgets of the chat app: a reply that colours tokens by provenance, and the stats panel."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

BAR_WIDTH = 16
# C0/C1 control characters (but newline and tab) would be dropped or reach the terminal raw;
# models do emit them, so show them as replacement characters
CONTROL_CHARS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if c not in (9, 10)}


class ReplyView(Static):
    """One assistant reply: (text, accepted) pieces, re-assembled at most ~30 times a second.

    Colours come from the component classes in app.tcss, so they follow the theme.
    """

    COMPONENT_CLASSES = {"reply--accepted", "reply--target", "reply--note"}

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.pieces: list[tuple[str, bool]] = []
        self.note = ""  # e.g. "[stopped]"
        self.dirty = False

    def add_pieces(self, pieces: list[tuple[str, bool]]) -> None:
        self.pieces += pieces
        self.dirty = True

    def mark(self, note: str) -> None:
        self.note = note
        self.dirty = True

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)

    def _style(self, name: str) -> str:
        color = self.get_component_styles(name).color
        return color.hex

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
        accepted, target = self._style("reply--accepted"), self._style("reply--target")
        parts = [
            (text.translate(CONTROL_CHARS), accepted if ok else target) for text, ok in self.pieces
        ]
        if self.note:
            parts.append((f" {self.note}", self._style("reply--note")))
        return Content.assemble(*parts)

    def refresh_if_dirty(self) -> None:
        if self.dirty:
            self.dirty = False
            self.update(self.assemble())


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of eighth-blocks for a fraction in [0, 1]."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, rest = divmod(eighths, 8)
    return ("█" * full + ("▏▎▍▌▋▊▉"[rest - 1] if rest else "")).ljust(width)


class StatsPanel(Static):
    """Live numbers that decide whether speculation pays, from a `Stats.to_json()` dict."""

    COMPONENT_CLASSES = {"reply--accepted", "reply--target"}

    def __init__(self, **kwargs):
        super().__init__("", **kwargs)
        self.stats: dict | None = None
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
        lines += [
            f"tokens/s     {s['tokens_per_second']:.1f}",
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
        accepted = self.get_component_styles("reply--accepted").color.hex
        target = self.get_component_styles("reply--target").color.hex
        return Content.assemble(
            self.render_text(),
            "\n\n",
            ("■ accepted draft token", accepted),
            "\n",
            ("■ produced by the target", target),
        )

    def refresh_if_dirty(self) -> None:
        if self.dirty:
            self.dirty = False
            self.update(self.assemble())
