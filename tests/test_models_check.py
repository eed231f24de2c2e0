"""`mlx-spec models --check`: which parts of each pair (target, draft, head) are in the local
cache, told offline from a Hugging Face cache laid out as huggingface_hub writes it, and where
each curated pair's repository names were seen published."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlx_spec.cli import main
from mlx_spec.pairs.registry import builtin_file, parse_file


def cache_repo(hub: os.PathLike, repo: str, files=("config.json", "model.safetensors")):
    """A repository in the hub cache as huggingface_hub leaves it after a download:
    refs/main naming a snapshot that holds the files."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd")
    snapshot = folder / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")


def run_models(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec", "models", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


def test_check_tells_each_part_of_a_pair_from_the_local_cache(tmp_path, tiny_models):
    hub = tmp_path / "hub"
    cache_repo(hub, "org/target-4bit")
    cache_repo(hub, "org/config-only", files=("config.json",))  # weights never came
    user = tmp_path / "models.toml"
    user.write_text(
        '[pairs.half]\ntarget = "org/target-4bit"\ndraft = "org/draft-4bit"\n'
        'seen = "a model page, 2026-12-03"\n\n'
        '[pairs.weightless]\ntarget = "org/config-only"\ndrafter = "ngram"\nseen = false\n\n'
        f'[pairs.local]\ntarget = "{tiny_models.target}"\ndraft = "{tiny_models.draft}"\n'
    )
    env = {"MLX_SPEC_MODELS": str(user), "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    done = run_models("--check", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    half = out[out.index("half\n") : out.index("weightless\n")]
    assert "target        cached   org/target-4bit" in half
    assert "draft         missing  org/draft-4bit" in half
    assert "names seen published: a model page, 2026-12-03" in half
    weightless = out[out.index("weightless\n") : out.index("local\n")]
    assert "target        missing  org/config-only" in weightless
    assert "names not seen published" in weightless
    local = out[out.index("local\n") : out.index("\n\n")]
    assert local.count("cached") == 2 and "missing" not in local
    assert "seen" not in local  # a user's own pair that does not say
    total = len(parse_file(builtin_file())) + 3  # the user's file adds three
    assert f" of {total} pairs have everything in the local cache" in out
    # the plain listing agrees: only the local pair is complete
    listing = run_models(env=env).stdout.splitlines()
    downloaded = {line.split()[0]: line.split()[2] for line in listing if line[:1].isalnum()}
    assert downloaded["half"] == "no" and downloaded["local"] == "yes"


def test_every_curated_pair_says_whether_its_names_were_seen_published():
    pairs = parse_file(builtin_file())
    unsaid = [name for name, spec in pairs.items() if spec.seen is None]
    assert not unsaid, f"curated pairs without seen = ...: {unsaid}"


@pytest.mark.parametrize("value", ["3", "true", '""'])
def test_a_malformed_seen_is_one_line(tmp_path, monkeypatch, capsys, value):
    user = tmp_path / "models.toml"
    user.write_text(f'[pairs.mine]\ntarget = "a"\nseen = {value}\n')
    monkeypatch.setenv("MLX_SPEC_MODELS", str(user))
    assert main(["models", "--check"]) == 2
    err = capsys.readouterr().err
    assert f"{user}:1" in err and "seen must be" in err and err.count("\n") == 1
