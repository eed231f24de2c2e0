"""mlx-spec distill on tiny pairs: acceptance rises, the adapter loads everywhere, runs resume,
bad input gets one line."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from mlx_spec import generate, load_pair
from mlx_spec.cli import main
from mlx_spec.errors import SpecError
from mlx_spec.train.common import Prompt, read_data
from mlx_spec.train.lora import distill
from mlx_spec.train.settings import Settings

QUICK = dict(steps=40, learning_rate=1e-3, reply_tokens=32, max_length=128, eval_every=10)


def run(tiny_models, out, resume=False, prompts=24, **kw):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    settings = Settings(**{**QUICK, **kw})
    data = read_data(None, prompts, settings.seed)
    base = {"target": "tiny", "draft": "tiny draft", "draft_bits": None}
    return distill(pair, data, out, settings, base, resume=resume)


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "adapter"
    return out, run(tiny_models, out)


def test_acceptance_rises_after_a_short_run(trained):
    out, report = trained
    before, after = report["before"], report["after"]
    print(json.dumps({"before": before, "after": after}))
    assert after["acceptance_t1"] > before["acceptance_t1"] + 0.05
    assert after["greedy_agreement"] > before["greedy_agreement"]
    assert after["tokens_per_pass_sampled"] > before["tokens_per_pass_sampled"]
    assert json.loads((out / "distill.json").read_text()) == report
    assert report["history"][-1]["step"] == 40 and report["held_out_positions"] > 0
    # the LoRA B matrices start at zero: the run moved them
    weights = mx.load(str(out / "adapters.safetensors"))
    assert any(k.endswith("lora_b") and mx.abs(v).max().item() > 0 for k, v in weights.items())


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_adapter_loads_through_every_entry_point(trained, tiny_models, tmp_path, capsys):
    out, _ = trained
    target, draft = str(tiny_models.target), str(tiny_models.draft)
    adapted = load_pair(target=target, draft=draft, draft_adapter=out)
    bare = load_pair(target=target, draft=draft)
    ids = mx.array([[5, 9, 3, 12, 7]])
    assert adapted.draft_adapter == out
    assert not mx.allclose(adapted.draft(ids), bare.draft(ids)).item()

    # models.toml: a relative draft_adapter is read from the file's folder
    (tmp_path / "models.toml").write_text(
        f'[pairs.mine]\ntarget = "{target}"\ndraft = "{draft}"\n'
        f'draft_adapter = "{out.relative_to(out.parent.parent)}"\n'
    )
    (tmp_path / out.parent.name).symlink_to(out.parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_SPEC_MODELS", str(tmp_path / "models.toml"))
        named = load_pair("mine")
        assert mx.allclose(named.draft(ids), adapted.draft(ids)).item()
        assert load_pair("mine", skip_draft=True).draft is None  # --no-draft drops it

    # the CLI: generate (the output is the target's either way; what was drafted differs)
    common = ["--target", target, "--draft", draft, "--num-draft-tokens", "3"]
    code, with_adapter, _ = cli(capsys, "generate", *common, "--draft-adapter", out,
                                "--json", "--max-tokens", "32", "The quick brown fox")  # fmt: skip
    assert code == 0
    code, without, _ = cli(capsys, "generate", *common, "--json", "--max-tokens", "32",
                           "The quick brown fox")  # fmt: skip
    with_adapter, without = json.loads(with_adapter), json.loads(without)
    assert with_adapter["tokens"] == without["tokens"]
    proposals = [[r["drafted"] for r in out["rounds"]] for out in (with_adapter, without)]
    assert proposals[0] != proposals[1]
    # probe, bench and chat take the same pair options
    code, probe, _ = cli(capsys, "probe", *common, "--draft-adapter", out, "--json",
                         "--context", "16", "--sample-tokens", "8")  # fmt: skip
    assert code == 0 and json.loads(probe)["alpha"] is not None
    code, bench, _ = cli(capsys, "bench", *common, "--draft-adapter", out, "--json", "--runs",
                         "1", "--k", "2", "--temps", "0", "--max-tokens", "8")  # fmt: skip
    assert code == 0 and json.loads(bench)
    from mlx_spec.cli import build_parser
    from mlx_spec.commands.args import pair_from_args

    chat_args = build_parser().parse_args(["chat", *common, "--draft-adapter", str(out)])
    assert pair_from_args(chat_args).draft_adapter == out

    # mlx-lm reads it too: the directory is in its adapter layout
    from mlx_lm.utils import load

    model, _ = load(draft, adapter_path=str(out))
    assert mx.allclose(model(ids), adapted.draft(ids), atol=1e-5).item()


def test_resume_continues_exactly(tiny_models, tmp_path):
    part = tmp_path / "part"
    first = run(tiny_models, part, steps=3, save_every=3, eval_every=3, prompts=6)
    assert first["history"][-1]["step"] == 3
    # an uninterrupted run on the same replies (the auto policy's timing-driven k makes
    # sampled replies differ between runs; a folder with only the replies starts at step 0)
    whole = tmp_path / "whole"
    whole.mkdir()
    shutil.copy(part / "sequences.json", whole / "sequences.json")
    run(tiny_models, whole, resume=True, steps=6, save_every=3, eval_every=3, prompts=6)
    resumed = run(tiny_models, part, resume=True, steps=6, save_every=3, eval_every=3, prompts=6)
    assert [h["step"] for h in resumed["history"]] == [3, 6]
    a = mx.load(str(whole / "adapters.safetensors"))
    b = mx.load(str(part / "adapters.safetensors"))
    assert a.keys() == b.keys()
    assert all(mx.allclose(a[k], b[k], atol=1e-6).item() for k in a)
    assert resumed["before"] == first["before"]  # measured once, kept by the checkpoint
    # a save that died between its two renames leaves only the previous checkpoint
    (part / "checkpoint").rename(part / "checkpoint.old")
    again = run(tiny_models, part, resume=True, steps=7, save_every=3, eval_every=3, prompts=6)
    assert [h["step"] for h in again["history"]] == [3, 6, 7]

    with pytest.raises(SpecError, match="other settings"):
        run(tiny_models, part, resume=True, steps=9, rank=4, prompts=6)
    with pytest.raises(SpecError, match="--resume"):
        run(tiny_models, part, steps=9, prompts=6)


def test_data_files_folders_and_saved_chats(tmp_path):
    (tmp_path / "lines.txt").write_text("first prompt\n\nsecond prompt\n")
    assert read_data(str(tmp_path / "lines.txt")) == [
        Prompt.chat("first prompt"),
        Prompt.chat("second prompt"),
    ]
    chat = {
        "system": "be brief",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and now?"},
        ],
    }
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    prompts = read_data(str(tmp_path / "chat.json"))
    assert [len(p.messages) for p in prompts] == [2, 4]  # system + each user turn's history
    assert prompts[1].messages[-1]["content"] == "and now?"
    (tmp_path / "data.jsonl").write_text('"a question"\n{"prompt": "another"}\n{"text": "doc"}\n')
    assert read_data(str(tmp_path / "data.jsonl")) == [
        Prompt.chat("a question"),
        Prompt.chat("another"),
        Prompt(text="doc"),
    ]
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "main.py").write_text("def f():\n    return 1\n" * 100)
    (repo / "logo.png").write_bytes(b"\x89PNG\0\0binary")
    (repo / ".git").mkdir()
    (repo / ".git" / "config").write_text("not a prompt")
    prompts = read_data(str(repo))
    assert len(prompts) > 1 and all(p.text and "def f" in p.text for p in prompts)
    assert all(len(p.text) <= 1200 for p in prompts)


def one_line_error(capsys, *argv) -> str:
    code, _, err = cli(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_input_gets_one_line(tiny_models, tmp_path, capsys):
    pair = ["--target", str(tiny_models.target), "--draft", str(tiny_models.draft)]
    out = tmp_path / "out"
    err = one_line_error(capsys, "distill", *pair, "--data", tmp_path / "missing.txt", "--out", out)
    assert "does not exist" in err
    (tmp_path / "empty.txt").write_text("\n  \n")
    err = one_line_error(capsys, "distill", *pair, "--data", tmp_path / "empty.txt", "--out", out)
    assert "no prompts" in err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{oops\n')
    assert "bad.jsonl:2" in one_line_error(
        capsys, "distill", *pair, "--data", tmp_path / "bad.jsonl"
    )
    (tmp_path / "one.txt").write_text("Just one prompt\n")
    err = one_line_error(capsys, "distill", *pair, "--data", tmp_path / "one.txt", "--out", out)
    assert "need at least 2 prompts" in err  # (said once an empty --out folder was made)
    plot = tmp_path / "nowhere" / "curve.png"  # (said once the whole run was done, exit 1)
    err = one_line_error(capsys, "distill", *pair, "--out", out, "--plot", plot)
    assert "does not exist" in err and "nowhere" in err
    assert not out.exists()  # nothing written
    one_line_error(capsys, "distill", "--target", str(tiny_models.target), "--no-draft")

    gen = ["generate", *pair, "--max-tokens", "4", "hello"]
    err = one_line_error(capsys, *gen, "--draft-adapter", tmp_path / "nowhere")
    assert "not a directory" in err
    (tmp_path / "empty_dir").mkdir()
    assert "adapter_config.json" in one_line_error(
        capsys, *gen, "--draft-adapter", tmp_path / "empty_dir"
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"num_layers": -1}')
    assert "lora_parameters" in one_line_error(capsys, *gen, "--draft-adapter", broken)
    (broken / "adapter_config.json").write_text(
        '{"num_layers": -1, "lora_parameters": {"rank": 4, "scale": 1.0, "dropout": 0.0}}'
    )
    (broken / "adapters.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    assert "broken weights file" in one_line_error(capsys, *gen, "--draft-adapter", broken)
    # an adapter for another model: the shapes do not fit
    import tiny

    other = tiny.write_adapter(tmp_path / "other", tiny_models.small_draft)
    assert "cannot apply the adapter" in one_line_error(capsys, *gen, "--draft-adapter", other)
    # one trained for a 3-bit self-draft, applied to a separate draft model
    config = json.loads((other / "adapter_config.json").read_text())
    config["mlx_spec"] = {"base": {"draft_bits": 3}}
    (other / "adapter_config.json").write_text(json.dumps(config))
    assert "3 bits" in one_line_error(capsys, *gen, "--draft-adapter", other)
    err = one_line_error(capsys, "generate", "--target", str(tiny_models.target), "--no-draft",
                         "--draft-adapter", other, "hello")  # fmt: skip
    assert "needs a draft model" in err


def test_registry_checks_draft_adapter(tmp_path, monkeypatch):
    (tmp_path / "models.toml").write_text('[pairs.x]\ntarget = "/t"\ndraft_adapter = "a"\n')
    monkeypatch.setenv("MLX_SPEC_MODELS", str(tmp_path / "models.toml"))
    with pytest.raises(SpecError, match="needs a draft model"):
        load_pair("x")
    (tmp_path / "models.toml").write_text(
        '[pairs.x]\ntarget = "/t"\ndraft = "/d"\ndraft_adapter = 3\n'
    )
    with pytest.raises(SpecError, match="draft_adapter must be"):
        load_pair("x")


def test_quantized_draft_trains_as_qlora(tiny_models, tmp_path):
    """A 4-bit self-draft: trained on its dequantized values, applied over the quantized
    layers; the two give the same logits."""
    import mlx.nn as nn

    pair = load_pair(target=str(tiny_models.target), draft_bits=4)
    settings = Settings(**{**QUICK, "steps": 20, "learning_rate": 1e-5})
    base = {"target": "tiny", "draft": None, "draft_bits": 4}
    report = distill(pair, read_data(None, 24), tmp_path / "q", settings, base)
    assert report["after"]["acceptance_t1"] > report["before"]["acceptance_t1"]
    adapter = tmp_path / "q"
    quantized = load_pair(target=str(tiny_models.target), draft_bits=4, draft_adapter=adapter)
    layer = quantized.draft.model.layers[0].self_attn.q_proj
    assert isinstance(layer.linear, nn.QuantizedLinear)  # LoRA over the quantized weights
    from mlx_lm.utils import dequantize_model

    from mlx_spec.models.adapters import apply_draft_adapter
    from mlx_spec.pairs.loading import load_draft_model

    trained_on = dequantize_model(load_draft_model(quantized))
    apply_draft_adapter(trained_on, adapter, 4)
    ids = mx.array([[5, 9, 3, 12, 7, 30, 31]])
    assert mx.allclose(trained_on(ids), quantized.draft(ids), atol=1e-3).item()
    res = generate(quantized, "The quick brown fox", max_tokens=16, num_draft_tokens=3)
    plain = load_pair(target=str(tiny_models.target))
    assert res.tokens == generate(plain, "The quick brown fox", max_tokens=16).tokens
