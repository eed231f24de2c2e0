"""`mlx-spec generate --json-schema / --grammar / --regex`: the reply, its stats, and every bad
input as one line on stderr with exit status 2."""

from __future__ import annotations

import json

import pytest
from test_cli import run_cli
from test_structured import CAPITALS, PERSON, reference

from mlx_spec.cli import main


def test_json_schema_subprocess(tiny_models, pair, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    prompt = "The quick brown fox"
    proc = run_cli(
        "generate", "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--num-draft-tokens", "3", "--max-tokens", "40", "--raw", "--json",
        "--json-schema", str(schema), prompt,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected, finish = reference(pair, prompt, "schema", PERSON, 40)
    assert out["tokens"] == expected and out["finish_reason"] == finish
    stats = out["stats"]
    assert stats["constrained"] == "json_schema" and stats["masks"] > 0
    assert 0 < stats["forced_tokens"] <= stats["forced_drafted"] <= stats["drafted"]
    assert out["text"].startswith('{"name": "')


def test_grammar_file_and_no_draft_baseline(tiny_models, pair, tmp_path, capsys):
    lark = tmp_path / "capitals.lark"
    lark.write_text(CAPITALS)
    prompt = "Paris is the capital of France. Paris"
    expected, _ = reference(pair, prompt, "grammar", CAPITALS, 60)
    model = ["--draft", str(tiny_models.draft)]
    for extra in (model, ["--no-draft"], [*model, "--no-forced-tokens"]):
        argv = [
            "generate", "--target", str(tiny_models.target), "--raw", "--json",
            "--max-tokens", "60", "--grammar", str(lark), *extra, prompt,
        ]  # fmt: skip
        assert main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["tokens"] == expected, extra
        if extra != model:  # the baseline drafts nothing; without forced tokens the model does
            assert out["stats"]["forced_drafted"] == 0
        else:
            assert out["stats"]["forced_tokens"] > 0


def test_the_stats_line_names_the_forced_tokens(tiny_models, capsys):
    argv = [
        "generate", "--target", str(tiny_models.target), "--raw", "--no-color",
        "--max-tokens", "30", "--regex", "(the|a) (quick|lazy) [a-z]{1,9}", "The fox",
    ]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "regex" in captured.err and "forced token" in captured.err
    assert captured.out.startswith(("the ", "a "))


def error_cases(t, tmp_path):
    target = ["--target", str(t.target)]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"type": "object",\n "properties": }')
    uncompilable = tmp_path / "objectx.json"
    uncompilable.write_text('{"type": "objectx"}')
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    lark = tmp_path / "bad.lark"
    lark.write_text("start: foo\n")
    empty = tmp_path / "empty.lark"
    empty.write_text("  \n")
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"enum": ["caf\xe9"]}')
    return [
        ([*target, "--json-schema", str(tmp_path / "missing.json")], ["no such file"]),
        ([*target, "--json-schema", str(tmp_path)], ["is a directory"]),
        ([*target, "--json-schema", str(bad_json)], ["not valid JSON", "line 2"]),
        ([*target, "--json-schema", str(array)], ["must be a JSON object"]),
        ([*target, "--json-schema", str(latin1)], ["not valid UTF-8"]),
        ([*target, "--json-schema", str(uncompilable)], ["cannot be compiled", "objectx"]),
        ([*target, "--grammar", str(lark)], ["grammar cannot be compiled", "foo"]),
        ([*target, "--grammar", str(empty)], ["is empty"]),
        ([*target, "--regex", "[a-"], ["regex cannot be compiled", "unclosed"]),
        ([*target, "--regex", "a", "--grammar", str(lark)], ["one of"]),
    ]


def test_bad_grammars_are_one_line_and_exit_2(tiny_models, tmp_path, capsys):
    for argv, words in error_cases(tiny_models, tmp_path):
        assert main(["generate", *argv, "hi"]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mlx-spec generate: error: "), err
        for w in words:
            assert w in err, (argv, err)


def test_a_bad_file_fails_before_any_model_loads(tmp_path, capsys):
    """The file is read first: a missing model is not what the user hears about."""
    argv = ["generate", "--target", str(tmp_path / "no-model"), "--json-schema",
            str(tmp_path / "missing.json"), "hi"]  # fmt: skip
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar"])
def test_subprocess_error_is_one_line(tiny_models, tmp_path, flag):
    bad = tmp_path / "bad"
    bad.write_text("start: foo\n" if flag == "--grammar" else '{"type": 3}')
    proc = run_cli("generate", "--target", str(tiny_models.target), flag, str(bad), "hi")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "cannot be compiled" in proc.stderr
