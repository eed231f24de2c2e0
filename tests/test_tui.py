"""The chat app, headless under App.run_test() with a real tiny pair."""

from __future__ import annotations

import pytest

from mlx_spec import generate, load_pair, make_decoder
from tui.app import ChatApp
from tui.widgets import ReplyView, StatsPanel

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


def colours(reply: ReplyView) -> tuple[str, str]:
    return (
        reply.get_component_styles("reply--accepted").color.hex,
        reply.get_component_styles("reply--target").color.hex,
    )


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
        # every piece carries the engine's flag for its token (pieces are tokens here)
        flags = [ok for text, ok in reply.pieces]
        assert flags == expected.accepted
        accepted_hex, target_hex = colours(reply)
        assert accepted_hex != target_hex
        content = reply.assemble()
        assert reply.content == content  # what is on screen is the whole reply
        offset = 0
        for text, ok in reply.pieces:
            if text:
                styles = {str(s.style) for s in content.spans if s.start <= offset < s.end}
                assert styles == {accepted_hex if ok else target_hex}
            offset += len(text)
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
        assert 0 < len(reply.pieces) < 200
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
        assert reply.pieces and not any(ok for _, ok in reply.pieces)
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
