"""`mlx-spec distill --drafter eagle3` (train/eagle_head.py): an EAGLE-3 head trained on a tiny
qwen3 and a tiny qwen3_5 (hybrid) target's own replies drafts better on held-out prompts than
the random head it starts from (measured by drafting through the engine), is written in the
layout `--drafter eagle3 --head` loads, stays lossless, resumes, fine-tunes a published head,
and bad input is one line and exit 2."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
import tiny
from test_eagle import head_weights, subset, write_head
from test_greedy_equality import PROMPTS, reference

from mlx_spec import generate, load_pair
from mlx_spec.cli import main
from mlx_spec.core.batch_caches import check_batchable
from mlx_spec.errors import SpecError
from mlx_spec.train.eagle_ttt import ttt_forward

# small and fast: 24 built-in prompts (5 held out), 3 draft steps of test-time training
FLAGS = ["--temp", "0", "--max-prompts", "24", "--reply-tokens", "32", "--batch-size", "4"]
FLAGS += [
    "--learning-rate",
    "3e-3",
    "--ttt-steps",
    "3",
    "--eval-every",
    "10",
    "--save-every",
    "10",
    "--json",
]


def error_line(capsys) -> str:
    """The one error line (after the loading progress lines, when the error comes later)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def train(target, out, *extra, steps=30):
    code = main(["distill", "--drafter", "eagle3", "--target", str(target), "--out", str(out),
                 "--steps", str(steps), *FLAGS, *extra])  # fmt: skip
    return code


@pytest.fixture(scope="module")
def targets(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("head_train")
    made = {}
    for family in ("qwen3", "qwen3_5"):
        cfg = tiny.family_configs(320)[family]
        if family == "qwen3_5":  # tied: it tends to echo, so its greedy replies are regular
            cfg = {**cfg, "tie_word_embeddings": True}  # (untied, they are chaotic: unlearnable)
        weights = tiny.family_weights(cfg, 0)
        made[family] = tiny.write_model(root / family, cfg, weights, tiny_models.tokenizer)
    return made


@pytest.fixture(scope="module")
def trained(targets, tmp_path_factory):
    """A head per target: (out folder, report)."""
    root = tmp_path_factory.mktemp("heads")
    runs = {}
    for family, target in targets.items():
        out = root / family
        assert train(target, out) == 0
        runs[family] = (out, json.loads((out / "distill.json").read_text()))
    return runs


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_training_raises_held_out_acceptance(trained, family):
    out, report = trained[family]
    before, after = report["before"], report["after"]
    # drafting through the engine with the head, k=4, on prompts never trained on
    # the hybrid target's greedy replies are a much less regular function of its features
    # than the attention target's (which fall into loops): it gains less in 30 steps
    gain = {"qwen3": (0.3, 0.15, 0.1), "qwen3_5": (0.03, 0.08, 0.05)}[family]
    assert before["tokens_per_pass_t0"] < 1.1  # the random head: nearly nothing accepted
    assert after["tokens_per_pass_t0"] > before["tokens_per_pass_t0"] + gain[0]
    assert after["greedy_agreement"][0] > before["greedy_agreement"][0] + gain[1]
    assert after["tokens_per_pass_offline"] > before["tokens_per_pass_offline"] + gain[2]
    steps = [h["step"] for h in report["history"]]
    assert steps == [0, 10, 20, 30]  # the curve: before, then every check
    held, trained_on = report["held_out_sequences"], report["train_sequences"]
    assert held >= 1 and held + trained_on == 24


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_written_head_loads_and_is_lossless(targets, trained, family):
    out, report = trained[family]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    layers = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert tuple(layers) == tuple(report["capture_layers"])
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["fc.weight"].dtype == mx.float16  # shipped half precision
    d2t, t2d = weights["d2t"], weights["t2d"]
    ids = (mx.arange(d2t.shape[0]) + d2t).tolist()
    assert sorted(ids) == [t for t in range(320) if bool(t2d[t])]
    pair = load_pair(target=str(targets[family]), drafter="eagle3", head=str(out))
    held = json.loads((out / "sequences.json").read_text())["measured_prompts"][:2]
    accepted = 0
    for prompt in [*held, PROMPTS[0]]:  # held-out chat prompts, and raw text
        res = generate(pair, prompt, max_tokens=24, num_draft_tokens=3)
        assert res.tokens == reference(pair, prompt, 24)
        accepted += res.stats.accepted
    assert accepted > 0


def test_resume_continues_the_run(targets, trained, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained["qwen3"][0], out)
    capsys.readouterr()
    assert train(targets["qwen3"], out, "--resume", steps=40) == 0
    report = json.loads(capsys.readouterr().out)
    assert [h["step"] for h in report["history"]] == [0, 10, 20, 30, 40]
    assert report["before"] == trained["qwen3"][1]["before"]  # measured once, kept
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["state"]["step"] == 40
    pair = load_pair(target=str(targets["qwen3"]), drafter="eagle3", head=str(out))
    res = generate(pair, PROMPTS[0], max_tokens=16, num_draft_tokens=2)
    assert res.tokens == reference(pair, PROMPTS[0], 16)
    # other settings than the checkpoint's: refused, one line
    assert train(targets["qwen3"], out, "--resume", "--draft-vocab", "100", steps=50) == 2
    assert "made with other settings" in error_line(capsys)


def test_a_ttt_warmup_trains_draft_step_1_alone(targets, trained, tmp_path):
    """--ttt-warmup N: the first N steps train draft step 1 alone. A run whose warm-up covers
    all its steps writes the head a run of one draft step writes (the same replies, seed and
    batches); the same run without it writes another."""
    import shutil

    heads = {}
    runs = {"warmup": ["--ttt-warmup", "10"], "one step": ["--ttt-steps", "1"], "all": []}
    for name, extra in runs.items():
        out = tmp_path / name
        out.mkdir()  # the replies of the trained run: --resume starts from them
        shutil.copy(trained["qwen3"][0] / "sequences.json", out)
        assert train(targets["qwen3"], out, "--resume", *extra, steps=10) == 0
        heads[name] = mx.load(str(out / "model.safetensors"))["fc.weight"]
    assert mx.array_equal(heads["warmup"], heads["one step"])
    assert not mx.array_equal(heads["all"], heads["one step"])


def test_a_published_head_is_fine_tuned(targets, tmp_path, capsys):
    """A head in the speculators layout, for the qwen3 target, is the starting point: the
    run starts from its weights (its held-out guesses, not a random head's) and writes the
    EAGLE layout."""
    cfg = tiny.family_configs(320)["qwen3"]
    cfg = {**cfg, "rope_theta": 1e4}
    draft_ids = subset(320, 96, seed=1)
    published = write_head(
        tmp_path / "published",
        {**cfg, "hidden_size": 64},
        head_weights({**cfg, "head_dim": 16}, draft_ids, seed=5, embed=False),
        "speculators",
        [1, 2, 3],
        "vllm",
    )
    out = tmp_path / "tuned"
    capsys.readouterr()
    flags = ["--head", str(published), "--learning-rate", "5e-4"]
    assert train(targets["qwen3"], out, *flags, steps=10) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["draft_vocab"] == 96  # the published head's vocabulary, kept
    assert report["capture_layers"] == [0, 1, 2]  # inputs of 1, 2, 3 = outputs of 0, 1, 2
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    tuned = load_pair(target=str(targets["qwen3"]), drafter="eagle3", head=str(out))
    start = load_pair(target=str(targets["qwen3"]), drafter="eagle3", head=str(published))
    assert tuned.head._to_target.tolist() == start.head._to_target.tolist() == draft_ids
    moved = mx.abs(tuned.head.fc.weight.astype(mx.float32) - start.head.fc.weight).max()
    # 10 Adam steps of 5e-4 move a weight by ~0.02 at most; a fresh head differs by ~0.3
    assert 0 < moved.item() < 0.05


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_ttt_steps_feed_the_head_its_own_output(trained, targets, norm_before_fc):
    """Step 1 of test-time training is the drafter's chained step: the same logits as
    drafting two tokens after a prefix with the head (fed its own output) — also for a head
    that norms the features before fc (speculators' norm_before_fc, as gpt-oss heads ship)."""
    from mlx.utils import tree_map

    from mlx_spec import make_decoder
    from mlx_spec.train.eagle_ttt import Batch

    out, _ = trained["qwen3"]
    pair = load_pair(target=str(targets["qwen3"]), drafter="eagle3", head=str(out))
    head = pair.head
    if norm_before_fc:
        width = head.fc.weight.shape[1]
        head.input_norm = nn.RMSNorm(width)
        head.input_norm.weight = mx.random.uniform(0.5, 2.0, (width,), key=mx.random.key(3))
    head.update(tree_map(lambda w: w.astype(mx.float32), head.parameters()))  # exact compare
    tokens = pair.tokenizer.encode(PROMPTS[1])
    from mlx_spec.core.hidden import capturing

    with capturing(pair.target, head.layers_read) as hidden:
        pair.target(mx.array(tokens)[None])
    feats = mx.concatenate([hidden[i] for i in head.layers_read], -1)
    T = len(tokens)
    zeros = mx.zeros((1, T))
    batch = Batch(feats, mx.array(tokens)[None], None, zeros, zeros, zeros, zeros)
    steps = ttt_forward(head, batch, 2)
    # the drafter over tokens[:n+1] (features of 0..n-1, entries 0..n-1): its first guess
    # comes from entry n-1 (step 0, row n-1); chaining with tokens[n+1] gives step 1, row n-1
    n = T - 2
    decoder = make_decoder(pair)
    decoder.prefill(tokens[: n + 1])
    drafter = decoder.drafter
    drafter._feed()
    g = drafter.last
    first = head.lm_head(head.norm(g))
    assert mx.allclose(first, steps[0][0][0, n - 1], atol=1e-4).item()
    g = head(g[None], mx.array([tokens[n + 1]], mx.uint32), drafter.cache)[0]
    second = head.lm_head(head.norm(g))
    assert mx.allclose(second, steps[1][0][0, n - 1], atol=1e-4).item()


@pytest.mark.parametrize("prefill_columns", [None, 3])
def test_the_replies_passes_give_a_separate_passes_features(targets, prefill_columns, monkeypatch):
    """A batchable target's training items come from the passes that sample its replies
    (left-padded rows, the prompts whole or in chunks of 3 columns, then one token at a time);
    they are the items a separate pass over the finished sequences reads, position by
    position. A recurrent target is refused there."""
    import numpy as np

    from mlx_spec.train import eagle_head as head_train
    from mlx_spec.train.eagle_head import replies_with_features
    from mlx_spec.train.eagle_ttt import TOP_K, target_features
    from mlx_spec.train.settings import Settings

    pair = load_pair(target=str(targets["qwen3"]), skip_draft=True)
    if prefill_columns:
        vocab = pair.target.model.embed_tokens.weight.shape[0]
        monkeypatch.setattr(head_train, "PREFILL_FLOATS", 5 * vocab * prefill_columns)
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS[:5]]  # lengths differ: padded
    assert len({len(p) for p in prompts}) > 1
    settings = Settings(temperature=0.7, reply_tokens=12)
    layers = (0, 1, 2)
    seqs, items = replies_with_features(pair, prompts, layers, settings, 0, print, "test")
    again = target_features(pair, layers, seqs, 2, print)
    assert [s.tokens[: s.start] for s in seqs] == prompts
    assert all(1 <= len(s.tokens) - s.start <= 12 for s in seqs)
    for it, ref in zip(items, again, strict=True):
        n = len(it["tokens"]) - 1  # the last position is never read
        assert it["start"] == ref["start"] and (it["tokens"] == ref["tokens"]).all()
        assert np.allclose(it["feats"][:n], ref["feats"][:n], rtol=2e-2, atol=2e-2)
        assert (it["argmax"][:n] == ref["argmax"][:n]).all()
        assert np.allclose(it["lse"][:n], ref["lse"][:n], atol=1e-3)
        assert it["top"].shape == (n + 1, TOP_K)
        top = np.take_along_axis(it["top"], np.argsort(-it["values"], -1), -1)[:n, :8]
        top_ref = np.take_along_axis(ref["top"], np.argsort(-ref["values"], -1), -1)[:n, :8]
        assert (top[:, 0] == top_ref[:, 0]).all()
        assert (np.sort(top, -1) == np.sort(top_ref, -1)).mean() > 0.95
    with pytest.raises(SpecError, match="recurrent"):
        check_batchable(load_pair(target=str(targets["qwen3_5"]), skip_draft=True).target)


def test_bad_input_is_one_line_and_exit_2(tiny_models, targets, tmp_path, capsys):
    target = str(targets["qwen3"])
    cases = [
        (["--target", target, "--data", str(tmp_path / "nope.txt")], "does not exist"),
        (["--target", str(tiny_models.mamba)], "a transformer layer"),
        (["--target", target, "--out", str(tmp_path / "file" / "sub")], "cannot write"),
        (["--target", target, "--head", str(tmp_path / "nohead")], "not a directory"),
    ]
    (tmp_path / "file").write_text("x")
    for flags, message in cases:
        capsys.readouterr()
        args = ["distill", "--drafter", "eagle3", "--steps", "1", "--max-prompts", "4"]
        assert main([*args, *flags]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    # a head for another target (its d2t points past this vocabulary)
    cfg = {**tiny.family_configs(320)["qwen3"], "rope_theta": 1e4}
    foreign = write_head(
        tmp_path / "foreign",
        cfg,
        head_weights({**cfg, "head_dim": 16}, subset(320, 95, 2) + [400], 5, False),
        ids=[0, 1, 2],
    )
    args = ["distill", "--drafter", "eagle3", "--target", target, "--head", str(foreign)]
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    assert "outside the target's vocabulary" in error_line(capsys)
    assert main(["distill", "--target", target, "--head", str(foreign)]) == 2
    assert "--drafter eagle3" in capsys.readouterr().err
