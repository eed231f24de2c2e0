"""`mlx-spec chat`: chat with a model pair and watch speculation happen, token by token.

Generation runs in a thread worker that posts one message per verify round; a ~30 Hz timer
re-renders only what changed, so the UI never waits on the model and vice versa.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, OptionList, Static
from textual.widgets.option_list import Option
from textual.worker import get_current_worker

from mlx_spec import SpecError, Stats, make_decoder, stream_rounds
from mlx_spec.policies import Auto, Fixed, draft_length

from .widgets import ReplyView, StatsPanel

REFRESH_HZ = 30
K_MAX = 16


class RoundMessage(Message):
    """One verify round's tokens, posted by the generation worker."""

    def __init__(self, reply: ReplyView, pieces: list[tuple[str, bool]], stats: dict):
        super().__init__()
        self.reply, self.pieces, self.stats = reply, pieces, stats


class ReplyDone(Message):
    def __init__(self, reply: ReplyView, stats: dict | None, note: str = ""):
        super().__init__()
        self.reply, self.stats, self.note = reply, stats, note


class LoadProgress(Message):
    def __init__(self, text: str):
        super().__init__()
        self.text = text


class PairLoaded(Message):
    def __init__(self, pair, name: str | None, error: str | None = None):
        super().__init__()
        self.pair, self.name, self.error = pair, name, error


class PairPicker(ModalScreen[str | None]):
    """Pick a pair from models.toml; downloaded pairs are marked."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, rows: list[tuple[str, str]]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        yield OptionList(*[Option(label, id=name) for name, label in self.rows])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "mlx-spec chat"
    BINDINGS = [
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("escape", "stop", "Stop reply"),
        Binding("f2", "toggle_speculation", "Draft on/off"),
        Binding("f3", "change_k(-1)", "k−"),
        Binding("f4", "change_k(1)", "k+"),
        Binding("f5", "change_temperature(-0.1)", "temp−"),
        Binding("f6", "change_temperature(0.1)", "temp+"),
        Binding("f7", "pick_pair", "Pair"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        pair=None,
        *,
        loader=None,
        pair_name: str | None = None,
        num_draft_tokens=None,  # an int, "auto", policies.Fixed/Auto; None: the pair's own
        temperature: float = 0.0,
        max_tokens: int = 1024,
        seed: int | None = None,
    ):
        """Give a loaded `pair`, or a `loader(name, progress) -> pair` run in a worker."""
        super().__init__()
        self.pair = None
        self.loader = loader
        self.pair_name = pair_name
        self.k = None if num_draft_tokens is None else draft_length(num_draft_tokens)
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.speculation = True
        self.history: list[dict] = []
        self.decoder = None
        self.reply: ReplyView | None = None  # the reply being generated
        # set by escape / quit; the worker checks it between rounds. A flag of our own rather
        # than Worker.cancel(): a cancelled thread worker may never start (and never report),
        # or keep running after its task is cancelled; this way every reply ends in ReplyDone.
        self.stop_requested = threading.Event()
        self.rounds_received = 0  # RoundMessages handled (for measurements)
        self.refreshes = 0  # timer ticks that re-rendered something
        self._initial_pair = pair

    # ------------------------------------------------------------------ layout and timer
    def compose(self) -> ComposeResult:
        with Vertical(id="chat"):
            yield VerticalScroll(id="messages")
            yield Static("", id="status")
            yield Input(placeholder="Message (enter to send)", id="prompt")
        yield StatsPanel(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        # references, not queries: a modal screen on top would hide these from query_one
        self.stats_panel = self.query_one(StatsPanel)
        self.status_line = self.query_one("#status", Static)
        self.message_list = self.query_one("#messages", VerticalScroll)
        self.set_interval(1 / REFRESH_HZ, self.refresh_views)
        if self._initial_pair is not None:
            self.use_pair(self._initial_pair, self.pair_name)
        elif self.loader is not None:
            self.load_pair(self.pair_name)
        self.query_one("#prompt", Input).focus()

    def refresh_views(self) -> None:
        changed = False
        for view in (self.reply, self.stats_panel):
            if view is not None and view.dirty:
                view.refresh_if_dirty()
                changed = True
        if changed:
            self.refreshes += 1
            self.message_list.scroll_end(animate=False)

    def set_status(self, text: str) -> None:
        self.status_line.update(text)

    def show_settings(self) -> None:
        self.stats_panel.show(
            pair=self.pair_name or "custom",
            speculation=self.speculation and self.pair is not None and self.pair.speculative,
            k=self.k,
            temperature=self.temperature,
        )

    # ------------------------------------------------------------------ pair loading
    def use_pair(self, pair, name: str | None) -> None:
        self.pair, self.pair_name = pair, name
        self.decoder = make_decoder(pair, self.seed)
        if self.k is None:
            self.k = pair.num_draft_tokens
        self.show_settings()
        draft = f"{pair.drafter} drafter, k={self.k}" if pair.speculative else "no draft"
        self.set_status(f"ready: {name or 'custom pair'} ({draft})")

    @work(thread=True, exclusive=True, group="load")
    def load_pair(self, name: str | None) -> None:
        try:
            pair = self.loader(name, lambda text: self.post_message(LoadProgress(text)))
        except SpecError as err:
            self.post_message(PairLoaded(None, name, str(err)))
            return
        self.post_message(PairLoaded(pair, name))

    def on_load_progress(self, message: LoadProgress) -> None:
        self.set_status(message.text)

    def on_pair_loaded(self, message: PairLoaded) -> None:
        if message.error:
            self.set_status(f"error: {message.error}")
        else:
            self.use_pair(message.pair, message.name)

    def action_pick_pair(self) -> None:
        if self.loader is None or self.reply is not None:
            return
        from mlx_spec.loading import is_downloaded
        from mlx_spec.registry import load_registry

        rows = []
        for name, spec in load_registry().pairs.items():
            models = [spec.target] + ([spec.draft] if spec.draft else [])
            have = "✓ downloaded" if all(is_downloaded(m) for m in models) else "  download"
            rows.append((name, f"{have}  {name:<20} {spec.note}"))

        def chosen(name: str | None) -> None:
            if name:
                self.k = None  # take the new pair's own default
                self.set_status(f"loading {name}…")
                self.load_pair(name)

        self.push_screen(PairPicker(rows), chosen)

    # ------------------------------------------------------------------ generation
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.pair is None or self.reply is not None:
            self.bell()
            return
        event.input.value = ""
        self.message_list.mount(Static(text, classes="user", markup=False))
        self.reply = ReplyView()
        self.message_list.mount(self.reply)
        self.history.append({"role": "user", "content": text})
        self.set_status("generating… (escape stops)")
        self.stop_requested.clear()
        self.generate_reply(self.reply, list(self.history))

    @work(thread=True, exclusive=True, group="generate")
    def generate_reply(self, reply: ReplyView, messages: list[dict]) -> None:
        worker = get_current_worker()
        stats = Stats()
        note = ""
        try:
            for batch in stream_rounds(
                self.pair,
                messages,
                self.max_tokens,
                temperature=self.temperature,
                num_draft_tokens=self.k,
                use_draft=self.speculation,
                decoder=self.decoder,
                stats=stats,
            ):
                self.post_message(
                    RoundMessage(reply, [(e.text, e.accepted) for e in batch], stats.to_json())
                )
                # a thread cannot be interrupted: ask between rounds
                if worker.is_cancelled or self.stop_requested.is_set():
                    note = "[stopped]"
                    break
        except SpecError as err:
            note = f"[error: {err}]"
        self.post_message(ReplyDone(reply, stats.to_json() if stats.target_passes else None, note))

    def on_round_message(self, message: RoundMessage) -> None:
        self.rounds_received += 1
        message.reply.add_pieces(message.pieces)
        self.stats_panel.show(message.stats)

    def on_reply_done(self, message: ReplyDone) -> None:
        reply = message.reply
        if message.note:
            reply.mark(message.note)
        reply.refresh_if_dirty()  # the timer only renders the active reply: finish this one
        if message.stats:
            self.stats_panel.show(message.stats)
        if reply.text:
            self.history.append({"role": "assistant", "content": reply.text})
        else:
            self.history.pop()  # nothing came back: forget the question too
        self.reply = None
        self.set_status(message.note or "ready")

    # ------------------------------------------------------------------ controls
    def action_stop(self) -> None:
        if self.reply is not None:
            self.stop_requested.set()

    def action_new_chat(self) -> None:
        if self.reply is not None:
            return
        self.history.clear()
        self.message_list.remove_children()
        self.set_status("new chat")

    def action_toggle_speculation(self) -> None:
        if self.reply is None:
            self.speculation = not self.speculation
            self.show_settings()

    def action_change_k(self, delta: int) -> None:
        """f3 / f4 step through auto, 1, 2, ..., K_MAX."""
        if self.reply is None and self.k is not None:
            k = self.k.k if isinstance(self.k, Fixed) else 0  # 0: auto
            k = max(0, min(K_MAX, k + delta))
            self.k = Fixed(k) if k else Auto()
            self.show_settings()

    def action_change_temperature(self, delta: float) -> None:
        if self.reply is None:
            self.temperature = round(max(0.0, min(2.0, self.temperature + delta)), 1)
            self.show_settings()

    async def action_quit(self) -> None:
        self.stop_requested.set()
        self.exit(0)
