"""Time to stream a 3000-piece reply (paragraphs of 6 lines) through ReplyView, rendering after
every 3 pieces: finished paragraphs in their own widgets against the whole reply in the tail.

    flock /tmp/bench.lock python -m tui.bench_reply
"""

import asyncio
import statistics
import time

from .app import ChatApp
from .widgets import ReplyView

WORDS = (
    "the sea is a vast and mysterious realm where boundaries of the world are ever changing".split()
)


def pieces(n: int) -> list[tuple[str, str]]:
    """Words of the three kinds, a line end every 12 and a blank line every 72."""
    out = []
    for i in range(n):
        w = " " + WORDS[i % len(WORDS)]
        if i % 12 == 11:
            w += "\n"
        if i % 72 == 71:
            w += "\n"
        out.append((w, ("accepted", "target", "regenerated")[i % 3]))
    return out


async def run(freeze: bool) -> float:
    """Seconds to stream the reply, 3 pieces per update; `freeze` False: all of it in the tail."""
    app = ChatApp()
    async with app.run_test(size=(120, 40)) as pilot:
        view = ReplyView()
        if not freeze:
            view.TAIL_LINES = 10**9
        await app.message_list.mount(view)
        ps = pieces(3000)
        if not freeze:  # no blank-line freezing either
            ps = [(t.replace("\n\n", "\n"), k) for t, k in ps]
        t0 = time.perf_counter()
        for i in range(0, len(ps), 3):
            view.add_pieces(ps[i : i + 3])
            view.refresh_if_dirty()
            app.message_list.scroll_end(animate=False)
            await pilot.pause(0)
        await pilot.pause()
        return time.perf_counter() - t0


async def main():
    res = {True: [], False: []}
    for _ in range(3):
        for f in (True, False):
            res[f].append(await run(f))
    a, b = statistics.median(res[True]), statistics.median(res[False])
    # printed after the apps have closed (Textual captures stdout while one runs)
    print(f"paragraph widgets {a:.2f} s, one Static {b:.2f} s: {b / a:.2f}x (medians of 3)")


if __name__ == "__main__":
    asyncio.run(main())
