"""The install people actually do: a built wheel in a fresh virtualenv, used from outside the
source tree. An editable install maps the source tree and hides a module or data file the wheel
leaves out; this does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from mlx_spec.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlx_spec", "tui")
SUBCOMMANDS = tuple(COMMANDS)  # every subcommand's --help must work from the wheel
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # build from a copy-free tree: pip builds in an isolated environment, as pipx and uv do
    r = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)])
    assert r.returncode == 0, r.stderr
    (path,) = out.glob("mlx_spec-*.whl")
    return path


def test_wheel_ships_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {
        str(p.relative_to(ROOT))
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sources, "no sources found"
    assert sources - names == set()
    assert "tui/app.tcss" in names
    # the demo pair's head: its config, weights and training record
    head = "mlx_spec/heads/smollm2-135m-eagle3/"
    for name in ("config.json", "model.safetensors", "distill.json"):
        assert head + name in names, name
    # models.toml: one hand-edited file at the top level, copied into the package by the build
    with zipfile.ZipFile(wheel) as z:
        assert z.read("mlx_spec/models.toml") == (ROOT / "models.toml").read_bytes()
    assert not (ROOT / "mlx_spec" / "models.toml").exists(), "a second copy in the source tree"


def test_wheel_in_a_fresh_virtualenv_runs_every_command(wheel, tmp_path):
    venv = tmp_path / "venv"
    r = run([sys.executable, "-m", "venv", str(venv)])
    assert r.returncode == 0, r.stderr
    py, exe = venv / "bin" / "python", venv / "bin" / "mlx-spec"
    # the dependencies come from the suite's own environment (the same pins, resolved by the
    # install that runs this suite): a path line in a .pth file only appends that folder to
    # sys.path, it runs none of its .pth files, so the checkout's editable mlx_spec stays out
    # of reach (asserted below). Installing them again took ~40 s of the suite's budget.
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    deps = sysconfig.get_paths()["purelib"]
    (Path(site.stdout.strip()) / "_suite_dependencies.pth").write_text(deps + "\n")
    # (no PYTHONPATH: a checkout on it, with the egg-info a build leaves there, made pip
    # think mlx-spec was installed already and install nothing)
    clean = {**os.environ, "PYTHONPATH": ""}
    r = run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], env=clean)
    assert r.returncode == 0, r.stderr
    assert exe.exists(), "the wheel's entry point was not installed"

    away = tmp_path / "elsewhere"  # outside the source tree: nothing can come from the checkout
    away.mkdir()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "MLX_SPEC_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": "",
    }
    env.pop("MLX_SPEC_MODELS", None)

    def cli(*args, via_module=False):
        cmd = [str(py), "-m", "mlx_spec", *args] if via_module else [str(exe), *args]
        return run(cmd, cwd=away, env=env)

    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mlx-spec {VERSION}", r.stdout + r.stderr
    r = cli("--version", via_module=True)
    assert r.returncode == 0 and r.stdout.strip() == f"mlx-spec {VERSION}", r.stdout + r.stderr
    # every subcommand's --help through the installed entry point, in one process (a start
    # each cost ~2 s of the suite's budget)
    helps = (
        "import contextlib, io, json, sys\n"
        "from mlx_spec.cli import main\n"
        "out = {}\n"
        "for command in sys.argv[1:]:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf):\n"
        "        try:\n"
        "            main([command, '--help'])\n"
        "        except SystemExit as e:\n"
        "            out[command] = (e.code, buf.getvalue())\n"
        "print(json.dumps(out))\n"
    )
    r = run([str(py), "-c", helps, *SUBCOMMANDS], cwd=away, env=env)
    assert r.returncode == 0, r.stderr
    answered = json.loads(r.stdout)
    assert set(answered) == set(SUBCOMMANDS)
    for command, (code, text) in answered.items():
        assert code in (0, None) and "usage: mlx-spec " + command in text, (command, text)
    r = cli("models")
    assert r.returncode == 0 and "smollm2-demo" in r.stdout and "qwen3-8b" in r.stdout, r.stderr
    # the demo's GGUF and its head are both here: nothing to download
    demo = next(line for line in r.stdout.splitlines() if line.startswith("smollm2-demo "))
    assert demo.split()[2] == "yes", r.stdout
    # the installed package, not the checkout, answered
    r = run([str(py), "-c", "import mlx_spec; print(mlx_spec.__file__)"], cwd=away, env=env)
    assert str(venv) in r.stdout and str(ROOT) not in r.stdout
    r = cli("generate", "--json", "--max-tokens", "8", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stats"]["generated_tokens"] == len(out["tokens"]) > 0
    assert out["stats"]["target_passes"] > 0 and len(out["accepted"]) == len(out["tokens"])
    assert out["stats"]["drafted"] > 0  # the default pair drafts with the head in the wheel
