"""Progress where work is long (issue 47): probe and bench draw one bar with an estimate on a
terminal's stderr, and write their plain stage lines anywhere else (what scripts read)."""

from __future__ import annotations

import io
import time

from mlx_spec.cli import main
from mlx_spec.commands.progress import Stages


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    with Stages(3, stream=out) as say:
        say("BLAS: x")
        say.step("run 1/1 chat")
    assert out.getvalue() == "BLAS: x\nrun 1/1 chat\n"


def test_a_bar_with_an_estimate_on_a_terminal():
    term = Terminal()
    with Stages(4, stream=term) as say:
        say("BLAS: x")
        for i in range(2):
            say.step(f"run {i + 1}/4")
    assert "\n".join(["BLAS: x", "run 1/4"]) not in term.getvalue()  # no plain lines
    assert "2/4" in term.getvalue() and "━" in term.getvalue()  # the bar, the count
    clock = Terminal()
    with Stages(30, by_time=True, stream=clock) as say:
        say("timing the target's verify pass…")
        time.sleep(0.5)
    assert "of ~30 s" in clock.getvalue() and "timing the target" in clock.getvalue()


def test_probe_keeps_its_stage_lines_off_a_terminal(tiny_models, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.draft)]
    assert main(["probe", *pair, "--context", "16", "--budget", "0.5"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("BLAS: ") and err[1] == "building 16 tokens of context…"
    from mlx_spec.commands.probe import SAMPLE_TOKENS

    assert any(line.startswith(f"sampling up to {SAMPLE_TOKENS} tokens at k=") for line in err)
