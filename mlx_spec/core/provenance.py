"""Where a token came from: one vocabulary and one colour scheme for every surface.

A token of a reply is *accepted* (the draft's, kept), *regenerated* (the target's correction of a
rejected draft token) or the *target*'s own (the bonus after a fully accepted round, or a step
with nothing drafted); a *rejected* token is the draft's losing guess, never emitted (the chat
shows it struck through with f8). `generate` colours with these ANSI codes, `--json` names them in
`kinds`, the chat's component styles are made from them (`textual_css`) and docs/commands.md and
docs/chat.md carry the legend (`tests/test_provenance.py` holds all four to this module).

A round is a *bonus* round, a *correction* round or a *plain* step (`--json`'s `rounds[].kind`),
by what its last token was: the same vocabulary seen per round.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCEPTED, REGENERATED, TARGET, REJECTED = "accepted", "regenerated", "target", "rejected"
BONUS, CORRECTION, PLAIN = "bonus", "correction", "plain"


@dataclass(frozen=True)
class Kind:
    name: str  # as `--json` writes it
    meaning: str  # one line, for legends and the docs
    colour: str  # an ANSI colour name: the terminal's own palette, in the CLI and the chat alike
    code: int  # its SGR code
    strike: bool = False  # drawn struck through (the draft's losing guesses)

    @property
    def ansi(self) -> str:
        """The escape sequence that starts this kind's colour in a terminal."""
        return f"\x1b[{'9;' if self.strike else ''}{self.code}m"

    @property
    def textual(self) -> str:
        """The colour as Textual names it (`ansi_green`): the chat's component style."""
        return f"ansi_{self.colour}"

    @property
    def style(self) -> str:
        """The whole Textual style of a piece of this kind."""
        return f"strike {self.textual}" if self.strike else self.textual


KINDS = {
    k.name: k
    for k in (
        Kind(ACCEPTED, "a draft token the target kept", "green", 32),
        Kind(REGENERATED, "the target's correction of a rejected draft token", "yellow", 33),
        Kind(TARGET, "the target's own: a bonus token, or a plain step", "cyan", 36),
        Kind(REJECTED, "a draft token the target rejected (never emitted)", "bright_black", 90,
             strike=True),
    )
}  # fmt: skip
EMITTED = (ACCEPTED, REGENERATED, TARGET)  # the kinds of tokens a reply holds
RESET = "\x1b[0m"

ROUND_KINDS = {
    BONUS: "every draft token accepted; the round ends with the target's own token (target)",
    CORRECTION: "a draft token rejected; the round ends with the target's correction (regenerated)",
    PLAIN: "nothing drafted: one step of the target alone (target)",
}


def round_kind(drafted: int, accepted: int) -> str:
    """A round's kind by how many tokens it drafted and how many of them were accepted."""
    if not drafted:
        return PLAIN
    return BONUS if accepted == drafted else CORRECTION


def paint(text: str, kind: str) -> str:
    """`text` in the colour of `kind`, for a terminal."""
    return f"{KINDS[kind].ansi}{text}{RESET}"


def textual_css(*widgets: str, prefix: str = "reply--") -> str:
    """Rules giving each widget's component classes (`reply--accepted`, …) the kinds' colours."""
    rules = []
    for kind in KINDS.values():
        selectors = ", ".join(f"{w} > .{prefix}{kind.name}" for w in widgets)
        strike = " text-style: strike;" if kind.strike else ""
        rules.append(f"{selectors} {{ color: {kind.textual};{strike} }}")
    return "\n".join(rules)


def markdown_legend() -> str:
    """The legend as docs/commands.md and docs/chat.md show it (a test keeps them equal)."""
    rows = ["| kind | colour | meaning |", "|---|---|---|"]
    for k in KINDS.values():
        colour = k.colour.replace("_", " ") + (", struck through" if k.strike else "")
        rows.append(f"| `{k.name}` | {colour} | {k.meaning} |")
    return "\n".join(rows)


def markdown_round_kinds() -> str:
    """`--json`'s round kinds as docs/commands.md shows them."""
    rows = ["| round `kind` | meaning |", "|---|---|"]
    rows += [f"| `{name}` | {meaning} |" for name, meaning in ROUND_KINDS.items()]
    return "\n".join(rows)
