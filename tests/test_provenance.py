"""One vocabulary and one colour scheme (issue 47): the CLI's ANSI colours, `--json`'s kinds, the
chat's component colours and the docs' legend all come from mlx_spec/core/provenance.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from textual.color import Color

from mlx_spec import GenerationConfig, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.core.provenance import (
    EMITTED,
    KINDS,
    RESET,
    ROUND_KINDS,
    markdown_legend,
    markdown_round_kinds,
    paint,
)
from tui.app import ChatApp
from tui.widgets import ReplyView, StatsPanel

DOCS = Path(__file__).resolve().parent.parent / "docs"
ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def mixed(tiny_models):
    """A draft that agrees often, not always, at a fixed k: all three emitted kinds."""
    return ["--target", str(tiny_models.target), "--draft", str(tiny_models.noisy)]


def test_the_cli_paints_with_the_modules_codes(mixed, capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    capsys.readouterr()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # colour forced: "a terminal"
    args = ["generate", *mixed, "--num-draft-tokens", "4", "--max-tokens", "40", "--seed", "0"]
    assert main([*args, "Hello there, how are you"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == " · ".join(paint(kind, kind) for kind in EMITTED)  # legend
    codes = set(ESCAPE.findall(out))
    assert codes - {RESET} <= {KINDS[k].ansi for k in EMITTED}
    assert len(codes - {RESET}) >= 2  # the reply mixes kinds: the test means something
    # the same run with --json: each token's kind, in the same order as the colours
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert main([*args, "--json", "Hello there, how are you"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["kinds"]) <= set(EMITTED)
    painted = [c for c in ESCAPE.findall(out) if c != RESET]  # one per token, in order
    by_code = {KINDS[k].ansi: k for k in EMITTED}
    assert [by_code[c] for c in painted] == result["kinds"]
    assert {r["kind"] for r in result["rounds"]} <= set(ROUND_KINDS)


def test_round_kinds_follow_the_module(tiny_models):
    pair = load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.noisy), num_draft_tokens=4
    )
    result = generate(pair, "Hello there, how are you", GenerationConfig(32, seed=0))
    for r in result.rounds:
        assert r.kind in ROUND_KINDS
        if r.kind == "bonus":
            assert r.drafted and r.accepted == len(r.drafted)


async def test_the_chats_colours_are_the_modules(tiny_models):
    pair = load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.noisy), num_draft_tokens=4
    )
    app = ChatApp(pair, pair_name="tiny", generation=GenerationConfig(max_tokens=24))
    async with app.run_test(size=(110, 40)) as pilot:
        await pilot.pause()
        await pilot.click("#prompt")
        await pilot.press(*"Hello", "enter")
        await app.workers.wait_for_complete()
        await pilot.pause(0.1)
        reply = app.query(ReplyView).last()
        panel = app.query_one(StatsPanel)
        for widget in (reply, panel):
            for kind in KINDS.values():
                styles = widget.get_component_styles(f"reply--{kind.name}")
                assert styles.color == Color.parse(kind.textual), (widget, kind.name)
                assert bool(styles.text_style.strike) == kind.strike
        # what is on screen: every piece in its kind's colour
        spans = {str(s.style) for s in reply.assemble().spans}
        kinds = {k for _, k in reply.pieces if k != "rejected"}
        assert {KINDS[k].style for k in kinds} <= spans and len(kinds) >= 2
        legend = panel.assemble()
        for kind in KINDS.values():  # the panel's legend: each name in its colour, its meaning
            assert f"{kind.name} {kind.meaning}" in legend.plain
            assert any(str(s.style) == kind.style for s in legend.spans)


@pytest.mark.parametrize("page", ["commands.md", "chat.md"])
def test_the_docs_legend_is_the_modules(page):
    text = (DOCS / page).read_text()
    assert markdown_legend() in text
    if page == "commands.md":
        assert markdown_round_kinds() in text
