"""The chat app in a real terminal (tmux): it renders, answers, and quits with status 0."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def wait_for(predicate, timeout: float = 120.0, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("timed out")


def test_chat_in_tmux(tiny_models, tmp_path):
    session = f"mlx-spec-{uuid.uuid4().hex[:8]}"
    exit_file = tmp_path / "exit"
    command = " ".join(
        [
            shlex.quote(sys.executable),
            "-m",
            "mlx_spec.cli",
            "chat",
            "--target",
            shlex.quote(str(tiny_models.target)),
            "--draft",
            shlex.quote(str(tiny_models.noisy)),
            "--max-tokens",
            "40",
            "--num-draft-tokens",  # a fixed k: the panel's height does not depend on timings
            "3",
        ]
    )
    script = f"HF_HUB_OFFLINE=1 {command}; echo $? > {shlex.quote(str(exit_file))}"
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "50", "-c", os.getcwd(), script)
    try:
        screen = lambda: tmux("capture-pane", "-p", "-t", session)  # noqa: E731
        wait_for(lambda: "ready" in screen())
        tmux("send-keys", "-t", session, "Tell me a story", "Enter")

        def replied():
            text = screen()
            return text if "tokens       40 in" in text else None

        shown = wait_for(replied)
        print(shown)
        assert "Tell me a story" in shown
        assert "acceptance" in shown and "tokens       40 in" in shown
        assert "accepted a draft token" in shown and "regenerated" in shown  # the legend
        tmux("send-keys", "-t", session, "C-q")
        wait_for(lambda: exit_file.exists() and exit_file.read_text().strip(), timeout=30)
        assert exit_file.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
