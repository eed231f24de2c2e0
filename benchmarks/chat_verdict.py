"""The chat's verdict line on a pair, as the app shows it: one reply per prompt in a fresh chat
(`ChatApp` under Textual's `run_test`, the pair loaded once), then the stats panel's `verdict`
row, next to the reply's tokens/s and acceptance. The same prompts as `mlx-spec bench`'s
built-in set by default, so the row compares with `generate`'s line and `bench`'s ratio on the
same text (docs/performance.md, "Does it pay? One verdict"). `--race`: the chat's race too
(`--compare`, f9: the same turn again with the draft off), the ratio the app then measured.

    flock /tmp/bench.lock python benchmarks/chat_verdict.py --pair smollm2-demo --race
    flock /tmp/bench.lock python benchmarks/chat_verdict.py --pair smollm2-self --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from mlx_spec.decode.config import GenerationConfig
from mlx_spec.measure.benchmark import PROMPTS
from mlx_spec.pairs.loading import load_pair
from tui.app import ChatApp
from tui.widgets import StatsPanel


async def chat_once(pair, name: str, prompt: str, max_tokens: int, race: bool) -> dict:
    """One reply in a fresh chat (and its race): the panel's verdict row, the reply's figures
    and, racing, the plain run's tokens/s."""
    config = GenerationConfig(max_tokens=max_tokens)
    app = ChatApp(pair, pair_name=name, generation=config, compare=race)
    raced = {}
    finish_race = app.finish_race

    def finished(message):  # the race's ReplyDone: keep its stats
        raced["stats"] = message.stats
        finish_race(message)

    app.finish_race = finished
    async with app.run_test(size=(140, 50)) as pilot:
        await pilot.pause()
        app.query_one("#prompt").value = prompt
        await pilot.click("#prompt")
        await pilot.press("enter")
        while app.last_turn is None or (race and "stats" not in raced):
            await pilot.pause(0.2)
        await app.workers.wait_for_complete()
        await pilot.pause(0.2)  # the last messages and a refresh tick
        drafted = app.last_turn[1] or {}
        app.stats_panel.show(drafted, race=None)  # the reply's own rows, not the race's
        text = app.query_one(StatsPanel).render_text()
    verdict = next((line for line in text.splitlines() if line.startswith("verdict")), "")
    plain = (raced.get("stats") or {}).get("tokens_per_second")
    return {
        "verdict": verdict.removeprefix("verdict").strip() or "(no verdict row)",
        "tokens": drafted.get("generated_tokens"),
        "tokens_per_second": drafted.get("tokens_per_second"),
        "acceptance": drafted.get("acceptance_rate"),
        "race": drafted["tokens_per_second"] / plain if plain else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-demo")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--only", help="built-in prompts to run, e.g. chat,code")
    parser.add_argument("--race", action="store_true", help="race each reply against plain")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(PROMPTS)
    pair = load_pair(args.pair)
    print(f"pair {args.pair}, k {pair.config.num_draft_tokens}, max tokens {args.max_tokens}")
    for name in names:
        row = asyncio.run(chat_once(pair, args.pair, PROMPTS[name], args.max_tokens, args.race))
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        race = "" if row["race"] is None else f"  race: {row['race']:.2f}x plain"
        print(
            f"{name:<14} {row['tokens']:>4} tokens  {row['tokens_per_second']:>6.1f} tok/s  "
            f"acceptance {acceptance:>4}  verdict: {row['verdict']}{race}"
        )
    return 0


if __name__ == "__main__":
    status = main()
    # the chat's threads have run MLX: leave through os._exit, as `mlx-spec chat` does (a
    # normal interpreter exit aborted here: "terminate called without an active exception")
    sys.stdout.flush()
    os._exit(status)
