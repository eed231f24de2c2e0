"""Every key of the chat can be found (issue 47): at 100 columns the footer cannot show them all,
so the command palette (ctrl+p, always in the footer) lists the app's own commands first, each
with its key, and the Keys panel lists the app's bindings before the prompt's editing keys."""

from __future__ import annotations

from rich.console import Console
from textual.widgets import Footer
from textual.widgets._footer import FooterKey
from textual.widgets._key_panel import BindingsTable

from tui.app import ChatApp

SIZE = (100, 40)


async def settle(pilot) -> None:
    """Until the footer has laid out its keys (it composes once the bindings are ready)."""
    for _ in range(50):
        await pilot.pause(0.05)
        keys = pilot.app.query_one(Footer).query(FooterKey)
        if keys and all(k.region.width for k in keys):
            return


async def test_every_binding_is_in_the_footer_or_the_palette():
    app = ChatApp(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        keys = list(app.query_one(Footer).query(FooterKey))
        palette = next(k for k in keys if k.action == "command_palette")
        assert 0 < palette.region.x and palette.region.right <= SIZE[0]  # ctrl+p is on screen
        in_footer = {
            k.action
            for k in keys
            if k is not palette and 0 < k.region.width and k.region.right <= palette.region.x
        }
        commands = list(app.get_system_commands(app.screen))
        own = commands[: len(app.BINDINGS)]  # the app's own first, in the footer's order
        assert [c.title for c in own] == [b.description for b in app.BINDINGS]
        for binding, command in zip(app.BINDINGS, own, strict=True):
            assert command.help.startswith(app.get_key_display(binding) + ": ")
        # at this width the footer shows the first few; the palette has every one of them
        assert "new_chat" in in_footer and "save" not in in_footer
        assert [c.title for c in commands[len(own) :]][:2] == ["Theme", "Quit"]  # Textual's


async def test_a_palette_command_runs_its_action():
    app = ChatApp(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert not app.show_rejected
        await pilot.press("ctrl+p")
        await pilot.pause(0.1)
        await pilot.press(*"Rejected guesses")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause(0.2)
        assert app.show_rejected


async def test_the_keys_panel_lists_the_apps_own_keys_first():
    app = ChatApp(None)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        active = list(app.screen.active_bindings.values())
        shown = [b for b in active if b.node is app]
        assert active[: len(shown)] == shown  # the app's, then the prompt's editing keys
        assert {b.action for b in app.BINDINGS} <= {b.binding.action for b in shown}
        assert len(active) > len(shown)
        app.action_show_help_panel()
        await pilot.pause(0.2)
        table = app.screen.query_one(BindingsTable).render_bindings_table()
        console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        console.print(table)
        text = console.export_text()
        assert text.index("New chat") < text.index("Move cursor left")
        assert text.index("Save chat") < text.index("Move cursor left")
