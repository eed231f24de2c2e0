"""The chat app's picture (docs/chat.md): `python -m tui.screenshot OUT.svg [QUESTION ...]`.

Runs the app headless (App.run_test) with the offline demo pair, asks the questions, shows the
rejected guesses (f8) and saves Textual's SVG screenshot; convert it to PNG with
`rsvg-convert -z 0.75 OUT.svg -o OUT.png` (apt-get install librsvg2-bin).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

QUESTIONS = ["What is the capital of France?", "Write two lines about the sea."]


async def screenshot(out: Path, questions: list[str], size=(110, 36)) -> None:
    from mlx_spec import GenerationConfig, load_pair

    from .app import ChatApp

    pair = load_pair("smollm2-demo")  # its shipped head, at the k it fixes (1)
    app = ChatApp(pair, pair_name="smollm2-demo", generation=GenerationConfig(max_tokens=60))
    async with app.run_test(size=size) as pilot:
        for question in questions:
            await pilot.click("#prompt")
            await pilot.press(*question, "enter")
            await pilot.pause()
            await app.workers.wait_for_complete()
            await pilot.pause(0.2)
        await pilot.press("f8")
        app.query_one("#prompt").cursor_blink = False
        await pilot.pause(0.2)
        svg = app.export_screenshot()
    # rsvg would drop the leading space of a text run without it
    out.write_text(svg.replace("<svg ", '<svg xml:space="preserve" ', 1), encoding="utf-8")


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "chat.svg").resolve()
    asyncio.run(screenshot(target, sys.argv[2:] or QUESTIONS))
