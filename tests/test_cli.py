"""`mlx-spec generate`: JSON through a real subprocess, and every bad-input case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlx_spec import generate, load_pair
from mlx_spec.cli import main
from mlx_spec.core import caches
from mlx_spec.core.policies import Fixed

STATS_KEYS = {
    "prompt_tokens",
    "generated_tokens",
    "drafted",
    "accepted",
    "acceptance_rate",
    "tokens_per_target_pass",
    "target_passes",
    "num_draft_tokens",
    "tokens_per_second",
    "peak_memory_gb",
}


def run_cli(*args, stdin: str | None = None, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=300,
    )


def test_generate_json_subprocess(tiny_models):
    proc = run_cli(
        "generate",
        "--target",
        str(tiny_models.target),
        "--draft",
        str(tiny_models.draft),
        "--num-draft-tokens",
        "3",
        "--max-tokens",
        "20",
        "--json",
        "Hello there",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert STATS_KEYS <= set(out["stats"])
    assert out["stats"]["num_draft_tokens"] == 3
    assert len(out["tokens"]) == len(out["accepted"]) == out["stats"]["generated_tokens"] == 20
    assert sum(out["accepted"]) == out["stats"]["accepted"]
    # per-round records and token kinds rebuild the reply
    assert len(out["rounds"]) == out["stats"]["target_passes"]
    rebuilt = []
    for r in out["rounds"]:
        assert set(r) == {"drafted", "accepted", "token", "kind", "emitted"}
        rebuilt += (r["drafted"][: r["accepted"]] + [r["token"]])[: r["emitted"]]
    assert rebuilt == out["tokens"]
    assert [k == "accepted" for k in out["kinds"]] == out["accepted"]
    # the CLI applies the chat template, exactly as the API does with a messages list
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    api = generate(pair, [{"role": "user", "content": "Hello there"}], max_tokens=20)
    assert out["tokens"] == api.tokens
    assert out["text"] == api.text


def test_generate_streams_plain_text_from_stdin(tiny_models):
    proc = run_cli(
        "generate",
        "--target",
        str(tiny_models.target),
        "--draft",
        str(tiny_models.draft),
        "--raw",
        "--max-tokens",
        "12",
        "-",
        stdin="The quick brown fox",
    )
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout  # not a terminal: no colour codes
    pair = load_pair(target=str(tiny_models.target))
    assert proc.stdout == generate(pair, "The quick brown fox", max_tokens=12).text + "\n"
    assert "12 tokens" in proc.stderr and "tokens/pass" in proc.stderr


def test_subprocess_error_is_one_line(tmp_path):
    proc = run_cli("generate", "--target", str(tmp_path / "nope"), "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "does not exist" in proc.stderr


def error_cases(t):
    """(argv, words the one-line message must contain)."""
    target, draft = str(t.target), str(t.draft)
    pair = ["--target", target, "--draft", draft]
    return [
        (["generate", "--pair", "no-such-pair", "hi"], ["unknown pair", "qwen3-8b"]),
        (["generate", "--target", str(t.root / "missing"), "hi"], ["does not exist"]),
        (
            ["generate", "--target", "nobody-here/no-such-model", "hi"],
            ["nobody-here/no-such-model", "hf download"],
        ),
        (
            ["generate", "--target", target, "--draft", str(t.swapped), "hi"],
            ["vocabularies differ", "token id 100"],
        ),
        (  # (LayerCache made a class mlx-spec does not know: see the test)
            ["generate", "--target", str(t.compressed), "--draft", draft, "hi"],
            ["cannot be rolled back", "LayerCache"],
        ),
        (["generate", *pair, "--num-draft-tokens", "0", "hi"], ["num-draft-tokens", ">= 1"]),
        (["generate", *pair, "--temp", "-1", "hi"], ["temperature"]),
        (["generate", *pair, "--top-p", "0", "hi"], ["top-p"]),
        (["generate", *pair, "--top-p", "1.5", "hi"], ["top-p"]),
        (["generate", *pair, "--raw", "word " * 600], ["longer than the model's context of 512"]),
        (["generate", *pair, "   "], ["prompt is empty"]),
    ]


def exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:  # argparse's own checks
        return exit_info.code


def test_every_error_case_is_one_line_and_exit_2(tiny_models, capsys, monkeypatch):
    # a cache class that cannot roll back: every mlx-lm class does here (deepseek_v41's
    # LayerCache by a snapshot), so LayerCache stands for a new one, unknown to mlx-spec
    monkeypatch.setattr(caches, "compressed", lambda c: False)
    for argv, words in error_cases(tiny_models):
        code = exit_code(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert err.count("\n") == 1, (argv, err)
        for word in words:
            assert word in err, (argv, err)


def test_argparse_errors_exit_2_on_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--num-draft-tokens", "0", "hi"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_malformed_models_toml_names_file_and_line(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "models.toml"
    bad.write_text('[pairs.mine]\ntarget = "a"\nnum_draft_tokens = \n')
    monkeypatch.setenv("MLX_SPEC_MODELS", str(bad))
    assert main(["generate", "--pair", "mine", "hi"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 3" in err and err.count("\n") == 1
    bad.write_text('[pairs.ok]\ntarget = "a"\n\n[pairs.mine]\ndraft = "b"\n')
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4" in err and "needs target" in err


def test_user_file_adds_and_overrides_pairs(tmp_path, monkeypatch, tiny_models, capsys):
    user = tmp_path / "models.toml"
    user.write_text(
        f'[pairs.tiny]\ntarget = "{tiny_models.target}"\ndraft = "{tiny_models.draft}"\n'
        'num_draft_tokens = 2\nnote = "a tiny pair"\n\n'
        '[pairs."qwen3-8b"]\ntarget = "mlx-community/Qwen3-8B-4bit"\nnum_draft_tokens = 7\n'
    )
    monkeypatch.setenv("MLX_SPEC_MODELS", str(user))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    tiny_line = next(line for line in out.splitlines() if line.startswith("tiny "))
    assert " 2 " in tiny_line and "yes" in tiny_line
    qwen_line = next(line for line in out.splitlines() if line.startswith("qwen3-8b "))
    assert " 7 " in qwen_line and "no" in qwen_line
    pair = load_pair("tiny")
    assert pair.config.num_draft_tokens == Fixed(2) and pair.draft is not None


def test_no_acceptance_verdict_when_nothing_was_drafted():
    """auto paused drafting for the whole reply: no acceptance to show, no hint to give."""
    from mlx_spec.commands.generate import hint
    from mlx_spec.core.stats import Stats

    paused = Stats(num_draft_tokens=8, generated_tokens=7, target_passes=8)
    assert hint(paused) is None and "acceptance –" in paused.summary()
    # a low acceptance alone is no verdict (the 50 % rule is gone): only measured costs are
    poor = Stats(num_draft_tokens=4, generated_tokens=7, target_passes=6, drafted=20, accepted=1)
    poor.drafted_at, poor.accepted_at = [5, 5, 5, 5], [1, 0, 0, 0]
    assert hint(poor) is None and "acceptance 5%" in poor.summary()


@pytest.mark.parametrize("no_openblas", [True, False])
def test_the_reference_blas_is_named_once_with_the_stats(tiny_models, no_openblas):
    """On Linux without OpenBLAS loaded, one line after the stats says so and how to fix it
    (it triples decode time silently otherwise); `--json` carries it as `blas_notice`. With
    OpenBLAS loaded: no line, and `blas_notice` is null."""
    from mlx_spec.runtime import blas

    env = {"MLX_SPEC_NO_OPENBLAS": "1"} if no_openblas else {}
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.draft)]
    text = run_cli("generate", *pair, "--max-tokens", "6", "Hello", env=env)
    js = run_cli("generate", *pair, "--max-tokens", "6", "--json", "Hello", env=env)
    assert text.returncode == js.returncode == 0, text.stderr + js.stderr
    notice = json.loads(js.stdout)["stats"]["blas_notice"]
    lines = text.stderr.splitlines()
    reference = sys.platform.startswith("linux") and (no_openblas or not blas.installed())
    if not reference:
        assert notice is None and not any("BLAS" in line for line in lines)
        return
    assert sum("reference BLAS" in line for line in lines) == 1 and js.stderr == ""
    # the last line, after the stats line (and a hint on the acceptance, if any)
    assert lines[-1] == notice and any("tokens/pass" in line for line in lines[-3:-1])
    if no_openblas and blas.installed():
        assert "MLX_SPEC_NO_OPENBLAS is set; unset it" in notice
    else:
        assert notice.endswith(f"install OpenBLAS: {blas.INSTALL_HINT}")


def test_help_needs_neither_mlx_lm_nor_the_drafters():
    """`mlx-spec --help` and a command's --help build every parser without importing mlx-lm
    (transformers behind it took ~1 s of the 1.3 s) or the drafter kinds' modules."""
    import subprocess
    import sys

    for argv in (["--help"], ["generate", "--help"], ["serve", "--help"]):
        code = (
            "import sys, runpy; sys.argv = ['mlx-spec', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('mlx_spec', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('mlx_lm', 'transformers')]\n"
            "loaded += [m for m in sys.modules if m.startswith('mlx_spec.drafters')]\n"
            "print('LOADED', sorted(loaded))"
        )
        run = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
        )
        assert "usage: mlx-spec" in run.stdout, run.stderr
        assert "LOADED []" in run.stdout, run.stdout[-400:]


MODELS_PROBE = """
import sys, runpy
sys.argv = ["mlx-spec", "models"]
try:
    runpy.run_module("mlx_spec", run_name="__main__")
except SystemExit as e:
    print("EXIT", e.code)
light = ("mlx_spec.drafters", "mlx_spec.drafters.base", "mlx_spec.drafters.kinds",
         "mlx_spec.drafters.mtp_source")
loaded = [m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "transformers", "numpy")]
loaded += [m for m in sys.modules if m.startswith("mlx_spec.drafters.") and m not in light]
loaded += [m for m in sys.modules if m == "mlx_spec.pairs.loading"]
print("LOADED", sorted(loaded))
"""


def test_models_loads_neither_mlx_nor_mlx_lm(tmp_path):
    """`mlx-spec models` validates every pair (PairConfig against its kind's facts) and asks
    whether each is downloaded without importing MLX, mlx-lm (transformers behind it: ~1.2 s
    of 1.7-1.9 s; 0.43 s without them) or a drafter's module — also for pairs whose models are
    here, so that the kinds' own `head_downloaded` runs (an MTP head in the cache, an EAGLE-3
    head directory)."""
    target, head = tmp_path / "target", tmp_path / "head"
    target.mkdir()
    head.mkdir()
    (target / "config.json").write_text('{"quantization": {"bits": 4, "group_size": 64}}')
    pairs = {
        "local-mtp": 'draft = { head = "mtp", path = "Qwen/Qwen3.5-9B" }',
        "local-eagle": f'draft = {{ head = "eagle3", path = "{head}" }}',
        "local-lookup": f'drafter = "ngram+model"\ndraft = "{target}"',
        "local-self": "draft = { from_target = true, bits = 3 }",
    }
    user = tmp_path / "models.toml"
    user.write_text(
        "".join(f'[pairs.{name}]\ntarget = "{target}"\n{rest}\n\n' for name, rest in pairs.items())
    )
    env = {"HF_HUB_OFFLINE": "1", "MLX_SPEC_MODELS": str(user)}
    env["MLX_SPEC_CACHE"] = str(tmp_path / "cache")
    run = subprocess.run(
        [sys.executable, "-c", MODELS_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert "EXIT 0" in run.stdout, run.stdout[-400:] + run.stderr[-400:]
    rows = [line.split() for line in run.stdout.splitlines()[1:] if line[:1] not in " \n"]
    have = {row[0]: row[2] for row in rows if len(row) > 3}
    assert have["local-eagle"] == have["local-lookup"] == have["local-self"] == "yes"
    assert have["local-mtp"] == "no"  # its head is not extracted into the cache
    assert have["smollm2-demo"] == "yes"  # the installed demo model and the shipped head
    assert "LOADED []" in run.stdout, run.stdout[-400:]


def test_the_cli_lists_every_drafter_kind_with_its_own_help():
    """--drafter's help comes from a table in commands/args.py (the kinds' modules load MLX);
    it must say what the registry says."""
    from mlx_spec.commands.args import DRAFTER_KINDS
    from mlx_spec.drafters import KINDS

    assert DRAFTER_KINDS == {name: kind.help for name, kind in KINDS.items()}
    assert main(["generate", "--drafter", "nope", "hi"]) == 2
