"""The chat app, headless under App.run_test() with a real tiny pair."""

from __future__ import annotations

import pytest

from mlx_spec import generate, load_pair, make_decoder
from tui.app import ChatApp
from tui.widgets import CONTROL_CHARS, ReplyView, StatsPanel

PROMPT = "Tell me a story"


@pytest.fixture(scope="module")
def chat_pair(tiny_models):
    # a fixed k: provenance and the picture must not depend on this machine's timings
    return load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.noisy), num_draft_tokens=4
    )


@pytest.fixture(scope="module")
def slow_pair(tiny_models):
    """A draft that is always wrong and drafts 8 tokens: one token per round, slowly, so a
    reply is still running when the test presses a key."""
    return load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.deranged), num_draft_tokens=8
    )


async def send(pilot, text: str) -> None:
    await pilot.pause()
    await pilot.click("#prompt")
    await pilot.press(*text)
    await pilot.press("enter")


async def finish(app, pilot) -> ReplyView:
    await app.workers.wait_for_complete()
    await pilot.pause(0.1)  # let the last messages and a refresh tick through
    return app.query(ReplyView).last()


KINDS = ("accepted", "regenerated", "target", "rejected")


def colours(reply: ReplyView) -> dict[str, str]:
    return {k: reply.get_component_styles(f"reply--{k}").color.hex for k in KINDS}


def shown(reply: ReplyView) -> list[tuple[str, str]]:
    return [(t, k) for t, k in reply.pieces if k != "rejected" or reply.show_rejected]


def check_spans(reply: ReplyView) -> None:
    """Every visible piece is on screen in its kind's colour (struck through if rejected)."""
    hexes = colours(reply)
    content = reply.assemble()
    assert reply.content == content  # what is on screen is the whole reply
    offset = 0
    for text, kind in shown(reply):
        if text:
            styles = {str(s.style) for s in content.spans if s.start <= offset < s.end}
            want = f"strike {hexes[kind]}" if kind == "rejected" else hexes[kind]
            assert styles == {want}, (text, kind, styles)
        offset += len(text)


async def test_reply_colours_follow_the_engine(chat_pair):
    expected = generate(
        chat_pair,
        [{"role": "user", "content": PROMPT}],
        max_tokens=40,
        decoder=make_decoder(chat_pair),
    )
    assert 0 < expected.stats.acceptance_rate < 1  # mixed rounds: both colours appear
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=40)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        reply = await finish(app, pilot)
        assert reply.text == expected.text
        # every piece carries the engine's kind for its token (pieces are tokens here): the
        # three classes match the per-round records token for token
        kinds = [k for _, k in reply.pieces if k != "rejected"]
        assert kinds == expected.kinds
        assert {"accepted", "regenerated", "target"} <= set(kinds)
        expected_kinds = []
        for r in expected.rounds:
            n = min(r.accepted, r.emitted)
            expected_kinds += ["accepted"] * n
            if r.emitted > n:
                expected_kinds.append("regenerated" if r.kind == "correction" else "target")
        assert kinds == expected_kinds
        assert len(set(colours(reply).values())) == len(KINDS)
        check_spans(reply)
        # the losing guesses: hidden, then (f8) struck through right before each correction
        rejected = [i for i, (_, k) in enumerate(reply.pieces) if k == "rejected"]
        assert rejected and all(reply.pieces[i + 1][1] == "regenerated" for i in rejected)
        assert reply.content.plain == reply.text.translate(CONTROL_CHARS)
        assert not reply.show_rejected
        corrections = [r for r in expected.rounds if r.kind == "correction" and r.emitted]
        tok = chat_pair.tokenizer
        assert [reply.pieces[i][0] for i in rejected] == [
            tok.decode(r.drafted[r.accepted :]) for r in corrections
        ]
        await pilot.press("f8")
        assert reply.show_rejected and reply.text == expected.text
        assert reply.content.plain == "".join(t for t, _ in reply.pieces).translate(CONTROL_CHARS)
        check_spans(reply)
        await pilot.press("f8")
        assert not reply.show_rejected
        panel = app.query_one(StatsPanel).render_text()
        stats = expected.stats
        assert f"acceptance   {stats.acceptance_rate:.0%}" in panel
        assert f"tokens/pass  {stats.tokens_per_target_pass:.2f}" in panel
        assert f"tokens       {stats.generated_tokens} in {stats.target_passes} passes" in panel
        # at most one message per verify round (a round whose only token is still being
        # detokenized rides with the next), so fewer messages than tokens
        assert 0 < app.rounds_received <= stats.target_passes < stats.generated_tokens


async def test_follow_up_reuses_the_cache(chat_pair):
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=12)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await finish(app, pilot)
        await send(pilot, "And then?")
        await finish(app, pilot)
        stats = app.query_one(StatsPanel).stats
        assert stats["prompt_tokens_reused"] > 0
        assert f"({stats['prompt_tokens_reused']} reused" in app.query_one(StatsPanel).render_text()
        assert len(app.history) == 4


async def test_escape_stops_a_reply_and_keeps_it(slow_pair):
    # 200 tokens: long enough to stop mid-way, short enough that the follow-up conversation
    # still fits the tiny model's 512-token context
    app = ChatApp(slow_pair, pair_name="tiny", max_tokens=200)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await pilot.pause(0.05)
        await pilot.press("escape")
        reply = await finish(app, pilot)
        assert reply.note == "[stopped]"
        assert 0 < len([p for p in reply.pieces if p[1] != "rejected"]) < 200
        assert app.history[-1] == {"role": "assistant", "content": reply.text}
        await send(pilot, "again")  # the app takes a new message after a stop
        second = await finish(app, pilot)
        assert second is not reply and second.pieces


async def test_new_chat_clears_the_conversation(chat_pair):
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=8)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await finish(app, pilot)
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert app.history == []
        assert not app.query(ReplyView)


async def test_speculation_off_means_all_target_tokens(chat_pair):
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=20)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f2")
        await send(pilot, PROMPT)
        reply = await finish(app, pilot)
        assert reply.pieces and all(k == "target" for _, k in reply.pieces)
        panel = app.query_one(StatsPanel).render_text()
        assert "speculation  off" in panel and "tokens       20 in 20 passes" in panel
        await pilot.press("f2", "f4", "f6")
        assert "speculation  on   k = 5" in app.query_one(StatsPanel).render_text()
        await pilot.press(*["f3"] * 5)
        assert "k = auto" in app.query_one(StatsPanel).render_text()  # below 1: the controller
        await pilot.press("f4", "f4")
        assert "speculation  on   k = 2" in app.query_one(StatsPanel).render_text()
        assert app.temperature == 0.1


async def test_quit_during_generation_exits_zero(slow_pair):
    app = ChatApp(slow_pair, pair_name="tiny", max_tokens=480)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await pilot.pause(0.05)
        assert app.reply is not None  # still generating
        await pilot.press("ctrl+q")
    assert app.return_code == 0


def test_snapshot_after_a_reply(chat_pair, snap_compare):
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=24)

    async def run_before(pilot):
        await send(pilot, PROMPT)
        await finish(app, pilot)
        panel = app.query_one(StatsPanel)
        # timings and the cursor blink vary from run to run; pin them for a stable picture
        panel.speeds = [1.0] * len(panel.speeds)  # the sparkline, too
        panel.show({**panel.stats, "tokens_per_second": 0.0, "peak_memory_gb": 0.0})
        app.query_one("#prompt").cursor_blink = False
        await pilot.pause(0.1)
        app.screen.refresh(repaint=True, layout=True)  # one full render, however it streamed
        await pilot.pause(0.1)

    assert snap_compare(app, terminal_size=(110, 32), run_before=run_before)


async def test_panel_shows_what_auto_decided(tiny_models):
    """With `auto` the panel says what the controller chose and why."""
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    app = ChatApp(pair, pair_name="tiny", max_tokens=30)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await finish(app, pilot)
        panel = app.query_one(StatsPanel).render_text()
        assert "k = auto" in panel
        auto = next(line for line in panel.splitlines() if line.startswith("auto "))
        assert auto.split(maxsplit=1)[1].startswith(("k=", "drafting paused", "probing"))
        assert "% of tokens" in panel


class Broken:
    """A target model that fails on every forward pass (a corrupt file, out of memory)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        raise RuntimeError("boom")

    def __getattr__(self, name):
        return getattr(self.model, name)


async def test_an_exception_in_generation_leaves_a_usable_app(chat_pair):
    import dataclasses

    broken = dataclasses.replace(chat_pair, target=Broken(chat_pair.target))
    app = ChatApp(broken, pair_name="tiny", max_tokens=10)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        reply = await finish(app, pilot)
        assert "[error: RuntimeError: boom]" in reply.content.plain
        assert app.reply is None and app.history == []  # the failed turn is forgotten
        app.use_pair(chat_pair, "tiny")
        await send(pilot, PROMPT)
        reply = await finish(app, pilot)
        assert reply.text and "error" not in reply.content.plain
        assert [m["role"] for m in app.history] == ["user", "assistant"]


async def test_a_base_model_without_chat_template_chats_in_plain_turns(tiny_models, tmp_path):
    import json
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_models.target, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    for f in base.glob("chat_template*"):
        f.unlink()
    pair = load_pair(target=str(base), draft=str(tiny_models.noisy), num_draft_tokens=3)
    assert not pair.tokenizer.has_chat_template
    app = ChatApp(pair, pair_name="base", max_tokens=30)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        reply = await finish(app, pilot)
        assert "no chat template" in str(app.status_line.content)
        assert reply.text and "[error" not in reply.content.plain
        assert "\nUser:" not in reply.text
        expected = generate(pair, f"User: {PROMPT}\nAssistant:", max_tokens=30)
        assert expected.text.startswith(reply.text)


@pytest.mark.parametrize("compare", [False, True], ids=["f9", "--compare"])
async def test_race_against_plain_decoding(chat_pair, compare):
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=24, compare=compare)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await finish(app, pilot)
        if not compare:
            await pilot.press("f9")
        await finish(app, pilot)
        await pilot.pause(0.1)
        await finish(app, pilot)
        first, race = list(app.query(ReplyView))[-2:]
        assert race.has_class("race") and not first.has_class("race")
        assert race.text == first.text  # greedy: plain decoding says exactly the same
        assert all(k == "target" for _, k in race.pieces)
        panel = app.query_one(StatsPanel).render_text()
        assert "draft on" in panel and "draft off" in panel and "same text    yes" in panel
        assert "race: speculation" in str(app.status_line.content)
        assert [m["role"] for m in app.history] == ["user", "assistant"]  # not a new turn
        await send(pilot, "and then?")  # the conversation goes on
        await finish(app, pilot)
        await finish(app, pilot)  # with --compare, its race too
        assert len(app.history) == 4
        raced = "race" in app.query_one(StatsPanel).render_text()
        assert raced == compare  # f9 races once; --compare races every reply


async def test_think_blocks_are_dimmed_and_fold(chat_pair):
    app = ChatApp(chat_pair, pair_name="tiny")
    async with app.run_test(size=(120, 40)) as pilot:
        view = ReplyView()
        await app.message_list.mount(view)
        view.add_pieces(
            [("<think>", "target"), ("the user", "accepted"), (" wants</think>", "target")]
        )
        view.add_pieces([("Hi", "accepted"), ("!", "regenerated")])
        hexes = colours(view)
        content = view.assemble()
        assert content.plain == "<think>the user wants</think>Hi!"
        styles = [(content.plain[s.start : s.end], str(s.style)) for s in content.spans]
        assert ("the user", f"dim {hexes['accepted']}") in styles
        assert ("Hi", hexes["accepted"]) in styles and ("!", hexes["regenerated"]) in styles
        await pilot.press("f10")
        folded = view.content.plain
        assert folded.startswith("[thinking: 29 characters") and folded.endswith("Hi!")
        await pilot.press("f10")
        assert view.content.plain == "<think>the user wants</think>Hi!"


async def test_thinking_off_goes_through_the_chat_template(tiny_models, tmp_path):
    """Qwen3's template writes an empty think block when enable_thinking is False."""
    import json
    import shutil

    qwen_like = tmp_path / "thinking"
    shutil.copytree(tiny_models.target, qwen_like)
    template = (qwen_like / "chat_template.jinja").read_text()
    template = template.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}",
    )
    assert "enable_thinking" in template
    (qwen_like / "chat_template.jinja").write_text(template)
    config = json.loads((qwen_like / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (qwen_like / "tokenizer_config.json").write_text(json.dumps(config))
    pair = load_pair(target=str(qwen_like), draft=str(tiny_models.noisy), num_draft_tokens=3)
    app = ChatApp(pair, pair_name="thinking", max_tokens=5)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        await finish(app, pilot)
        with_thinking = app.stats_panel.stats["prompt_tokens"]
        await pilot.press("ctrl+n", "f11")
        assert not app.thinking
        await send(pilot, PROMPT)
        await finish(app, pilot)
        assert app.stats_panel.stats["prompt_tokens"] > with_thinking


async def test_copy_save_and_system_message(chat_pair, tmp_path, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    app = ChatApp(chat_pair, pair_name="tiny", max_tokens=12)
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, PROMPT)
        reply = await finish(app, pilot)
        plain_prompt = app.stats_panel.stats["prompt_tokens"]
        await pilot.press("ctrl+y")
        assert app.clipboard == reply.text
        await send(pilot, "/system Answer briefly.")
        assert app.system == "Answer briefly." and len(app.history) == 2
        await send(pilot, PROMPT)
        await finish(app, pilot)
        # the system message is in the prompt now (and the first turn is in it too)
        assert app.stats_panel.stats["prompt_tokens"] > plain_prompt
        await pilot.press("ctrl+s")
        saved = json.loads(app.saved_to.with_suffix(".json").read_text())
        assert saved["messages"] == app.history and saved["system"] == "Answer briefly."
        assert saved["stats"]["generated_tokens"] > 0
        markdown = app.saved_to.with_suffix(".md").read_text()
        assert PROMPT in markdown and "tok/s" in markdown
