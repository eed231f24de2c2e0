"""`mlx-spec chat`: chat with a model pair and watch speculation happen, token by token.

Loading and generation run on one dedicated thread (`ModelThread`: MLX's streams are per
thread, so the models stay on the thread that loaded them); the reply posts one message per
verify round, and a ~30 Hz timer re-renders only what changed, so the UI never waits on the
model and vice versa.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import var
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, OptionList, ProgressBar, Static
from textual.widgets.option_list import Option
from textual.worker import get_current_worker

from mlx_spec import (
    GenerationConfig,
    SpecError,
    Stats,
    load_decoder,
    make_decoder,
    save_decoder,
    stream_rounds,
)
from mlx_spec.core.policies import Auto, Fixed
from mlx_spec.models.hub import DownloadProgress
from mlx_spec.runtime.threads import ModelThread

from .keys import BINDINGS, ChatScreen, own_commands
from .widgets import ReplyView, StatsPanel

DEFAULT_MAX_TOKENS = 1024


def chats_dir() -> Path:
    """Where ctrl+s saves chats: $MLX_SPEC_DATA/chats, else $XDG_DATA_HOME/mlx-spec/chats, else
    ~/.local/share/mlx-spec/chats."""
    env = os.environ.get("MLX_SPEC_DATA")
    if env:
        return Path(env).expanduser() / "chats"
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "mlx-spec" / "chats"


REFRESH_HZ = 30
FIXED_K_MAX = 16  # f4 steps a fixed k up to here (`auto` keeps to policies.K_MAX)
# With a fixed k, a plain step every RETIME rounds, timed while the app draws: the verdict row
# divides by those (a prefill-timed step made it 0.58-0.77x where the race measured 1.04-1.70x)
RETIME = 16


class RoundMessage(Message):
    """One verify round's tokens, posted by the generation worker: (text, kind) pieces, the
    rounds' (drafted, accepted) counts and the tokens/s since the last message."""

    def __init__(self, reply: ReplyView, pieces, stats: dict, rounds, speed: float):
        super().__init__()
        self.reply, self.pieces, self.stats = reply, pieces, stats
        self.rounds, self.speed = rounds, speed


# A model without a chat template (a base model) gets plain turns, documented in docs/chat.md.
USER, ASSISTANT = "User:", "Assistant:"
NEXT_TURN = f"\n{USER}"


def conversation(messages: list[dict], tokenizer, system: str | None = None):
    """Messages for the chat template, or plain 'User: / Assistant:' text without one."""
    if tokenizer.has_chat_template:
        if system:
            return [{"role": "system", "content": system}, *messages]
        return messages
    turns = [f"System: {system}"] if system else []
    turns += [f"{USER if m['role'] == 'user' else ASSISTANT} {m['content']}" for m in messages]
    return "\n".join([*turns, ASSISTANT])


def pieces_of(batch, tokenizer) -> list[tuple[str, str]]:
    """Events -> (text, kind) pieces; a correction is preceded by the guesses it replaced."""
    pieces = []
    for e in batch:
        if e.rejected:
            pieces.append((tokenizer.decode(e.rejected), "rejected"))
        pieces.append((e.text, e.kind))
    return pieces


class ReplyDone(Message):
    def __init__(self, reply: ReplyView, stats: dict | None, note: str = "", race: bool = False):
        super().__init__()
        self.reply, self.stats, self.note, self.race = reply, stats, note, race


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


def retimed(k):
    """A fixed k as the chat runs it: a plain step timed every RETIME rounds, so the verdict
    row compares with plain tokens taken while the app draws (policies.FixedK)."""
    return Fixed(k.k, RETIME) if isinstance(k, Fixed) else k


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "mlx-spec chat"
    BINDINGS = BINDINGS  # tui/keys.py: the app's keys, their palette entries

    # the settings the panel shows: each change re-renders it (watch_ below)
    stats_panel: StatsPanel | None = None  # found in on_mount
    k = var(None)  # policies.Fixed / Auto; None until a pair gives its own default
    temperature = var(0.0)
    speculation = var(True)

    def __init__(
        self,
        pair=None,
        *,
        loader=None,
        pair_name: str | None = None,
        generation: GenerationConfig | None = None,
        compare: bool = False,
        saved: dict | None = None,
    ):
        """Give a loaded `pair`, or a `loader(name, progress) -> pair` run in a worker.
        `generation`: the settings every reply starts from (default: 1024 tokens, greedy, the
        pair's k); its temperature, k and system message can change while chatting.
        `compare`: race every reply against plain decoding (as f9 does). `saved`: a
        conversation saved with ctrl+s (see `read_saved`) to go on with."""
        super().__init__()
        generation = generation or GenerationConfig(max_tokens=DEFAULT_MAX_TOKENS)
        self.pair = None
        self.loader = loader
        self.pair_name = pair_name
        # reactives, set without their watchers: the panel they refresh is not mounted yet
        self.set_reactive(ChatApp.k, generation.num_draft_tokens)  # None: the pair's own
        self.set_reactive(ChatApp.temperature, generation.temperature)
        self.generation = generation
        system = generation.system
        self.show_rejected = False  # f8: the draft's losing guesses, struck through
        self.compare = compare
        self.fold_thinking = False  # f10: <think> blocks folded
        self.thinking = True  # f11 off: the chat template's enable_thinking=False (Qwen3)
        self.system = system  # a system message for every turn (--system, or "/system TEXT")
        self.saved_to: Path | None = None
        self.last_turn = None  # (messages, stats, reply text) of the last reply, for the race
        self.history: list[dict] = list(saved["messages"]) if saved else []
        if saved and system is None:
            self.system = saved.get("system")
        self.decoder = None  # made on the model thread, by the first reply with a pair
        # the saved chat's caches (ctrl+s writes them): its next turn prefills only what is new
        self.saved_cache: Path | None = saved.get("cache") if saved else None
        # every load and every reply runs here, in order (not on Textual's shared pool)
        self.models = ModelThread("mlx-spec-chat")
        self.reply: ReplyView | None = None  # the reply being generated
        # set by escape / quit; the worker checks it between rounds. A flag of our own rather
        # than Worker.cancel(): a cancelled thread worker may never start (and never report),
        # or keep running after its task is cancelled; this way every reply ends in ReplyDone.
        self.stop_requested = threading.Event()
        self.rounds_received = 0  # RoundMessages handled (for measurements)
        self.refreshes = 0  # timer ticks that re-rendered something
        self._initial_pair = pair

    # ------------------------------------------------------------------ keys and commands
    def get_default_screen(self) -> Screen:
        return ChatScreen(id="_default")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The command palette: the app's own commands first (keys.own_commands)."""
        yield from own_commands(self)
        yield from super().get_system_commands(screen)

    # ------------------------------------------------------------------ layout and timer
    def compose(self) -> ComposeResult:
        with Vertical(id="chat"):
            yield VerticalScroll(id="messages")
            yield ProgressBar(id="download", show_eta=False)  # while a pair downloads
            yield Static("", id="status", markup=False)  # errors and ids hold brackets
            yield Input(placeholder="Message (enter to send)", id="prompt")
        yield StatsPanel(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        # references, not queries: a modal screen on top would hide these from query_one
        self.stats_panel = self.query_one(StatsPanel)
        self.status_line = self.query_one("#status", Static)
        self.message_list = self.query_one("#messages", VerticalScroll)
        self.download_bar = self.query_one("#download", ProgressBar)
        for m in self.history:  # a saved conversation goes on (its colours were not saved)
            self.message_list.mount(Static(m["content"], classes=m["role"], markup=False))
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

    def watch_k(self) -> None:
        self.show_settings()

    def watch_temperature(self) -> None:
        self.show_settings()

    def watch_speculation(self) -> None:
        self.show_settings()

    def show_settings(self) -> None:
        if self.stats_panel is None:  # a setting changed before the app was mounted
            return
        self.stats_panel.show(
            pair=self.pair_name or "custom",
            speculation=self.speculation and self.pair is not None and self.pair.speculative,
            k=self.k,
            temperature=self.temperature,
        )

    # ------------------------------------------------------------------ pair loading
    def use_pair(self, pair, name: str | None) -> None:
        self.pair, self.pair_name = pair, name
        self.decoder = None
        if self.k is None:
            self.k = pair.config.num_draft_tokens
        self.show_settings()
        draft = f"{pair.config.drafter} drafter, k={self.k}" if pair.speculative else "no draft"
        self.set_status(f"ready: {name or 'custom pair'} ({draft})")

    @work(exclusive=True, group="load")
    async def load_pair(self, name: str | None) -> None:
        await self.models.run(self._load_pair, name)

    def _load_pair(self, name: str | None) -> None:
        try:
            pair = self.loader(name, lambda text: self.post_message(LoadProgress(text)))
        except SpecError as err:
            self.post_message(PairLoaded(None, name, str(err)))
            return
        except Exception as err:  # out of memory, a broken file: the app keeps working
            self.post_message(PairLoaded(None, name, f"{type(err).__name__}: {err}"))
            return
        self.post_message(PairLoaded(pair, name))

    def on_load_progress(self, message: LoadProgress) -> None:
        progress = message.text
        if isinstance(progress, DownloadProgress):  # bytes done of bytes to do
            self.download_bar.display = True
            self.download_bar.update(total=progress.total or None, progress=progress.done)
        self.set_status(progress)

    def on_pair_loaded(self, message: PairLoaded) -> None:
        self.download_bar.display = False
        if message.error:
            self.error_line(message.error)
        else:
            self.use_pair(message.pair, message.name)

    def error_line(self, error: str) -> None:
        """A failure (a pair that would not load) as a line in the chat; the app goes on."""
        self.message_list.mount(Static(f"[error: {error}]", classes="error", markup=False))
        self.message_list.scroll_end(animate=False)
        self.set_status(f"error: {error}")

    def action_pick_pair(self) -> None:
        if self.loader is None or self.reply is not None:
            return
        from mlx_spec.pairs.registry import load_registry, pair_downloaded

        rows = []
        for name, spec in load_registry().pairs.items():
            have = "✓ downloaded" if pair_downloaded(spec) else "  download"
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
        if text.startswith("/system"):  # a system message for the following turns
            self.system = text.removeprefix("/system").strip() or None
            event.input.value = ""
            self.set_status(f"system message: {self.system or '(none)'}")
            return
        if not text or self.pair is None or self.reply is not None:
            self.bell()
            return
        event.input.value = ""
        self.message_list.mount(Static(text, classes="user", markup=False))
        self.reply = ReplyView()
        self.stats_panel.strip, self.stats_panel.speeds = [], []  # the strip follows the reply
        self.stats_panel.show(race=None)
        self.message_list.mount(self.reply)
        self.history.append({"role": "user", "content": text})
        self.set_status("generating… (escape stops)")
        if not self.pair.tokenizer.has_chat_template:
            self.set_status(f"no chat template: plain '{USER}/{ASSISTANT}' turns (escape stops)")
        self.stop_requested.clear()
        self.generate_reply(self.reply, list(self.history))

    # not exclusive: the next reply (a --compare race) starts when this one has posted
    # ReplyDone, maybe before its thread has returned; exclusive would cancel it there
    @work(group="generate")
    async def generate_reply(
        self, reply: ReplyView, messages: list[dict], race: bool = False
    ) -> None:
        """One reply, posted round by round. `race`: the same turn again with the draft off,
        to compare (it is not added to the conversation)."""
        worker = get_current_worker()
        await self.models.run(self._generate_reply, worker, reply, messages, race)

    def _generate_reply(self, worker, reply: ReplyView, messages: list[dict], race: bool) -> None:
        stats = Stats()
        note = ""
        seen, clock = 0, (0, 0.0)  # records posted; (tokens, seconds) at the last message
        so_far, plain_turns = "", not self.pair.tokenizer.has_chat_template
        try:
            if self.decoder is None or self.decoder.pair is not self.pair:
                self.decoder = self._first_decoder()
            config = self.generation.replace(
                temperature=self.temperature,
                num_draft_tokens=retimed(self.k),
                chat_template_kwargs={"enable_thinking": self.thinking},
                use_draft=self.speculation and not race,
                system=None,  # the conversation carries it (self.system)
                seed=None,  # the decoder's key, seeded once above, runs on across replies
            )
            prompt = conversation(messages, self.pair.tokenizer, self.system)
            for batch in stream_rounds(
                self.pair, prompt, config, decoder=self.decoder, stats=stats
            ):
                rounds = [(len(r.drafted), r.accepted) for r in stats.records[seen:]]
                seen = len(stats.records)
                tokens, seconds = stats.generated_tokens, stats.generation_seconds
                speed = (tokens - clock[0]) / max(seconds - clock[1], 1e-9)
                clock = (tokens, seconds)
                pieces = pieces_of(batch, self.pair.tokenizer)
                self.post_message(RoundMessage(reply, pieces, stats.to_json(), rounds, speed))
                # a base model writes the user's next turn itself: stop there
                so_far += "".join(e.text for e in batch)
                if plain_turns and NEXT_TURN in so_far:
                    break
                # a thread cannot be interrupted: ask between rounds
                if worker.is_cancelled or self.stop_requested.is_set():
                    note = "[stopped]"
                    break
        except SpecError as err:
            note = f"[error: {err}]"
        except Exception as err:  # never let a failed reply take the app down
            note = f"[error: {type(err).__name__}: {err}]"
        result = stats.to_json() if stats.target_passes else None
        self.post_message(ReplyDone(reply, result, note, race))

    def on_round_message(self, message: RoundMessage) -> None:
        self.rounds_received += 1
        message.reply.set_show_rejected(self.show_rejected)
        message.reply.set_fold_thinking(self.fold_thinking)
        message.reply.add_pieces(message.pieces)
        panel = self.stats_panel
        panel.strip += message.rounds
        panel.speeds.append(message.speed)
        panel.show(message.stats)

    def on_reply_done(self, message: ReplyDone) -> None:
        reply = message.reply
        reply.cut_at(NEXT_TURN)  # a base model's imagined next user turn is not the reply
        if message.note:
            reply.mark(message.note)
        reply.refresh_if_dirty()  # the timer only renders the active reply: finish this one
        if message.race:
            self.finish_race(message)
            return
        if message.stats:
            self.stats_panel.show(message.stats)
        if reply.text:
            self.last_turn = (list(self.history), message.stats, reply.text)
            self.history.append({"role": "assistant", "content": reply.text})
        else:
            self.history.pop()  # nothing came back: forget the question too
        self.reply = None
        plain_turns = self.pair is not None and not self.pair.tokenizer.has_chat_template
        notice = f" (no chat template: plain '{USER}/{ASSISTANT}' turns)" if plain_turns else ""
        self.set_status(message.note or f"ready{notice}")
        if self.compare and reply.text and not message.note:
            self.action_race()

    # ------------------------------------------------------------------ the race
    def action_race(self) -> None:
        """f9: the last turn again with the draft off; both runs side by side."""
        if self.reply is not None or self.last_turn is None or self.pair is None:
            self.bell()
            return
        messages, _, _ = self.last_turn
        self.reply = ReplyView(classes="race")
        self.reply.mark("[the same turn, plain decoding: the race]")
        self.stats_panel.strip, self.stats_panel.speeds = [], []
        self.message_list.mount(self.reply)
        self.set_status("racing: the last turn with the draft off… (escape stops)")
        self.stop_requested.clear()
        self.generate_reply(self.reply, messages, race=True)

    def finish_race(self, message: ReplyDone) -> None:
        _, drafted, text = self.last_turn
        self.reply = None
        if message.stats is None or drafted is None:
            self.set_status(message.note or "race: nothing to compare")
            return
        same = message.reply.text == text
        self.stats_panel.show(message.stats, race=(drafted, message.stats, same))
        speedup = drafted["tokens_per_second"] / max(message.stats["tokens_per_second"], 1e-9)
        self.set_status(message.note or f"race: speculation {speedup:.2f}x plain decoding")

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

    def action_fold_thinking(self) -> None:
        """Fold (or unfold) every reply's <think>…</think> block."""
        self.fold_thinking = not self.fold_thinking
        for reply in self.query(ReplyView):
            reply.set_fold_thinking(self.fold_thinking)
            reply.refresh_if_dirty()

    def action_toggle_thinking(self) -> None:
        """Turn a reasoning model's thinking off (or on) through its chat template."""
        if self.reply is None:
            self.thinking = not self.thinking
            self.set_status(f"thinking {'on' if self.thinking else 'off'} (enable_thinking)")

    def action_copy_reply(self) -> None:
        """The last finished reply (also one of a chat loaded with --load) to the clipboard."""
        replies = [m["content"] for m in self.history if m["role"] == "assistant"]
        if replies:
            self.copy_to_clipboard(replies[-1])
            self.set_status("copied the last reply")

    def _first_decoder(self):
        """The saved chat's caches when it has them and they are this pair's (once), else a
        new decoder; on the model thread."""
        path, self.saved_cache = self.saved_cache, None
        if path is not None:
            try:
                return load_decoder(self.pair, path, self.generation.seed)
            except SpecError as err:
                self.call_from_thread(self.set_status, f"prefilling again: {err}")
        return make_decoder(self.pair, self.generation.seed)

    def _save_caches(self, path: Path) -> str:
        """The conversation's caches beside its .json (on the model thread)."""
        try:
            save_decoder(self.decoder, path)
        except SpecError as err:
            return f" (caches not saved: {err})"
        return " and its caches"

    def action_save(self) -> None:
        """Write the conversation with its stats as Markdown and JSON (mlx-spec-chat-*.md)
        in the chats folder (`chats_dir`), never the working directory (a git checkout)."""
        import json
        import time

        folder = chats_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self.set_status(f"could not save in {folder}: {err.strerror}")
            return
        stem = folder / time.strftime("mlx-spec-chat-%Y%m%d-%H%M%S")
        record = {
            "pair": self.pair_name,
            "system": self.system,
            "messages": self.history,
            "stats": self.stats_panel.stats,
        }
        lines = [f"# mlx-spec chat ({self.pair_name or 'custom pair'})", ""]
        if self.system:
            lines += [f"*system:* {self.system}", ""]
        for m in self.history:
            lines += [f"**{m['role']}:** {m['content']}", ""]
        if self.stats_panel.stats:
            s = self.stats_panel.stats
            lines.append(
                f"*last reply: {s['generated_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, "
                f"acceptance {s['acceptance_rate']:.0%}, {s['tokens_per_target_pass']:.2f} "
                "tokens/pass*"
            )
        try:
            stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
            stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        except OSError as err:
            self.set_status(f"could not save: {err.strerror}")
            return
        self.saved_to = stem
        if self.decoder is None or self.reply is not None:
            self.set_status(f"saved {stem}.md and .json")
            return
        self.run_worker(self._save_with_caches(stem), group="save")

    async def _save_with_caches(self, stem: Path) -> None:
        done = await self.models.run(self._save_caches, stem.with_suffix(".safetensors"))
        self.set_status(f"saved {stem}.md and .json{done}")

    def action_toggle_rejected(self) -> None:
        """Show the draft's rejected guesses inline, struck through, in every reply."""
        self.show_rejected = not self.show_rejected
        for reply in self.query(ReplyView):
            reply.set_show_rejected(self.show_rejected)
            reply.refresh_if_dirty()
        if self.reply is None:
            self.set_status("rejected guesses shown" if self.show_rejected else "ready")

    def action_change_k(self, delta: int) -> None:
        """f3 / f4 step through auto, 1, 2, ..., FIXED_K_MAX."""
        if self.reply is None and self.k is not None:
            k = self.k.k if isinstance(self.k, Fixed) else 0  # 0: auto
            k = max(0, min(FIXED_K_MAX, k + delta))
            self.k = Fixed(k) if k else Auto()

    def action_change_temperature(self, delta: float) -> None:
        if self.reply is None:
            self.temperature = round(max(0.0, min(2.0, self.temperature + delta)), 1)

    async def action_quit(self) -> None:
        self.stop_requested.set()
        self.exit(0)

    def on_unmount(self) -> None:
        self.stop_requested.set()
        self.models.close()  # the thread ends after the reply it runs stops
