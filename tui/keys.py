"""The chat's keys: its bindings, the command palette's entries for them (the footer cannot show
them all at 100 columns) and a screen whose Keys panel lists them before the prompt's own."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

BINDINGS = [
    Binding("ctrl+n", "new_chat", "New chat", tooltip="forget the conversation"),
    Binding("escape", "stop", "Stop reply", tooltip="stop the reply (kept, [stopped])"),
    Binding("f2", "toggle_speculation", "Draft on/off", tooltip="speculation on or off"),
    Binding("f3", "change_k(-1)", "k−", tooltip="a shorter draft: auto, 1, 2, …"),
    Binding("f4", "change_k(1)", "k+", tooltip="a longer draft: auto, 1, 2, …"),
    Binding("f5", "change_temperature(-0.1)", "temp−", tooltip="temperature − 0.1"),
    Binding("f6", "change_temperature(0.1)", "temp+", tooltip="temperature + 0.1"),
    Binding("f7", "pick_pair", "Pair", tooltip="pick a pair from models.toml"),
    Binding("f8", "toggle_rejected", "Rejected guesses", tooltip="show the draft's losers"),
    Binding("f9", "race", "Race plain", tooltip="the last turn again without the draft"),
    Binding("f10", "fold_thinking", "Fold thinking", tooltip="fold <think> blocks"),
    Binding("f11", "toggle_thinking", "Thinking on/off", tooltip="enable_thinking"),
    Binding("ctrl+y", "copy_reply", "Copy reply", tooltip="the last reply to the clipboard"),
    Binding("ctrl+s", "save", "Save chat", tooltip="Markdown and JSON, in the chats folder"),
    Binding("ctrl+q", "quit", "Quit", priority=True, tooltip="quit, also mid-reply"),
]


def own_commands(app: App) -> Iterable[SystemCommand]:
    """A palette entry per binding, in the footer's order, each with its key: "^s: …"."""
    for binding in app.BINDINGS:
        yield SystemCommand(
            binding.description,
            f"{app.get_key_display(binding)}: {binding.tooltip}",
            partial(app.run_action, binding.action),
        )


class ChatScreen(Screen):
    """The app's screen: its active bindings list the app's own first, so the Keys panel
    (ctrl+p, "Keys") shows them before the prompt's text-editing keys."""

    @property
    def active_bindings(self) -> dict:
        bindings = super().active_bindings
        own = {key: b for key, b in bindings.items() if b.node is self.app}
        return {**own, **{key: b for key, b in bindings.items() if key not in own}}
