"""The MTP drafter (drafters/mtp.py) and `mlx-spec heads extract`, on tiny Qwen3.5 checkpoints
written in the original layout: shards + index, `model.language_model.*` names, conv1d in
(C, 1, K), zero-centred norms, and `mtp.*` tensors of random weights beside the model."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import reference

from mlx_spec import SamplingParams, generate, load_pair, make_decoder
from mlx_spec.cli import main as cli_main
from mlx_spec.core.hidden import FINAL_NORM, capturing
from mlx_spec.drafters import KINDS, mtp, mtp_head
from mlx_spec.drafters.mtp_extract import locate

PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of"]
MLX_NORMS = (  # the target's norms mlx-lm shifts by one when it reads an original checkpoint
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def qwen35_config(vocab: int) -> dict:
    flat = tiny.family_configs(vocab)["qwen3_5"]
    text = {k: v for k, v in flat.items() if k not in ("model_type", "eos_token_id")}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "text_config": {**text, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1},
    }


OUTPUTS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")


def original_checkpoint(
    path, vocab: int, tokenizer, seed: int = 0, head_scale: float = 4.0, agree=None, config=None
):
    """A Qwen3.5 checkpoint as the Hugging Face repositories ship it; returns its mtp tensors.
    (`config`: another Qwen3.5 config than `qwen35_config(vocab)`.)

    `agree` (a noise level): a head that predicts well. The target's layers are damped so it
    is nearly a bigram model (its hidden state at t+1 ~ final_norm(embed(s[t+1]))), and the
    head computes just that: fc takes the embedding half, its layer adds nothing (its output
    projections are zero; its attention still fills the cache), mtp.norm is the final norm.
    Noise on fc makes it wrong some of the time."""
    config = config or qwen35_config(vocab)
    weights = tiny.family_weights(config, seed=seed, head_scale=head_scale)
    if agree is not None:
        for k, v in weights.items():
            if k.startswith("language_model.model.layers.") and k.endswith(OUTPUTS):
                weights[k] = v * 0.05
    hf = {}
    for k, v in weights.items():
        if k.startswith("language_model.model."):
            name = "model.language_model." + k.removeprefix("language_model.model.")
        else:
            name = k.removeprefix("language_model.")  # lm_head.weight
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # (C, K, 1) -> the original (C, 1, K)
        if v.ndim == 1 and name.endswith(MLX_NORMS):
            v = v - 1.0  # zero-centred: (1 + w) x
        hf[name] = v
    mx.random.seed(seed + 100)
    head = dict(tree_flatten(mtp_head.MTPHead(config).parameters()))
    for k, v in head.items():
        if v.ndim == 1:  # norms: zero-centred in the file, not all zero
            head[k] = 0.1 * mx.random.normal(v.shape)
    if agree is not None:
        hidden = config["text_config"]["hidden_size"]
        eye = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
        head["fc.weight"] = eye + agree * mx.random.normal(eye.shape)
        head["pre_fc_norm_embedding.weight"] = mx.zeros((hidden,))  # (1 + 0) x
        head["norm.weight"] = weights["language_model.model.norm.weight"] - 1.0
        for k in head:
            if k.endswith(OUTPUTS):
                head[k] = mx.zeros_like(head[k])
    hf.update({"mtp." + k: v.astype(mx.float32) for k, v in head.items()})
    names = sorted(hf)
    shards = {  # the model over two shards; the mtp tensors in a third and in the second
        "model-00001-of-00003.safetensors": [n for n in names if "layers.0." in n[:30]],
        "model-00003-of-00003.safetensors": [n for n in names if n.startswith("mtp.layers")],
    }
    placed = {n for ns in shards.values() for n in ns}
    shards["model-00002-of-00003.safetensors"] = [n for n in names if n not in placed]
    path.mkdir(parents=True)
    weight_map = {}
    for file, keys in shards.items():
        mx.save_safetensors(str(path / file), {k: hf[k] for k in keys}, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (path / f.name).write_bytes(f.read_bytes())
    return {k: v for k, v in hf.items() if k.startswith("mtp.")}


@pytest.fixture(scope="module")
def checkpoint(tiny_models, tmp_path_factory):
    """A head that agrees with its target often (mixed rounds: full, partial, rejected)."""
    root = tmp_path_factory.mktemp("mtp")
    tensors = original_checkpoint(root / "qwen35", 320, tiny_models.tokenizer, agree=0.0)
    assert cli_main(["heads", "extract", str(root / "qwen35"), str(root / "head")]) == 0
    return root / "qwen35", root / "head", tensors


@pytest.fixture(scope="module")
def mtp_pair(checkpoint):
    target, head, _ = checkpoint
    return load_pair(target=str(target), drafter="mtp", head=str(head))


@pytest.fixture(scope="module")
def random_pair(tiny_models, tmp_path_factory):
    """Random head weights: nearly every round is rejected."""
    root = tmp_path_factory.mktemp("mtp_random")
    original_checkpoint(root / "qwen35", 320, tiny_models.tokenizer, seed=1)
    assert cli_main(["heads", "extract", str(root / "qwen35"), str(root / "head")]) == 0
    return load_pair(target=str(root / "qwen35"), drafter="mtp", head=str(root / "head"))


def test_extract_reads_only_the_mtp_shards_and_keeps_the_tensors(checkpoint):
    target, head, tensors = checkpoint
    _, _, shards, names = locate(str(target))
    assert [s.name for s in shards] == [
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert sorted(names) == sorted(tensors)
    config = json.loads((head / "config.json").read_text())
    assert config["head_type"] == "mtp" and config["model_type"] == "qwen3_5"
    saved = mx.load(str(head / "model.safetensors"))
    assert sorted(saved) == sorted(k.removeprefix("mtp.") for k in tensors)
    for k, v in tensors.items():
        shift = 1.0 if v.ndim == 1 else 0.0  # norms in mlx-lm's convention: w + 1
        assert mx.array_equal(saved[k.removeprefix("mtp.")], v + shift), k


def test_the_target_still_loads_and_the_head_reads_its_final_norm(mtp_pair):
    """mlx-lm drops mtp.* at load; the head is the kind's, and hidden states are the
    final norm's output (what the target's lm_head reads)."""
    assert isinstance(mtp_pair.head, mtp_head.MTPHead)
    ids = mx.array([[5, 9, 3, 12]])
    with capturing(mtp_pair.target, (FINAL_NORM,)) as got:
        logits = mtp_pair.target(ids)
    _, lm_head = mtp.target_parts(mtp_pair.target)
    assert mx.allclose(lm_head(got[FINAL_NORM]), logits, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, "auto"])
@pytest.mark.parametrize("which", ["mtp_pair", "random_pair"])
def test_greedy_equals_the_target_alone(request, which, k):
    pair = request.getfixturevalue(which)
    for prompt in PROMPTS:
        expected = reference(pair, prompt, 24)
        res = generate(pair, prompt, max_tokens=24, num_draft_tokens=k)
        assert res.tokens == expected, prompt
        if k != "auto":  # auto follows this machine's timings: it may pause a poor head at once
            assert res.stats.drafted > 0
        assert res.stats.accepted == sum(res.accepted)


def test_a_head_that_predicts_well_is_accepted(mtp_pair, random_pair):
    good = generate(mtp_pair, PROMPTS[0], max_tokens=32, num_draft_tokens=3).stats
    bad = generate(random_pair, PROMPTS[0], max_tokens=32, num_draft_tokens=3).stats
    print(f"acceptance: agreeing head {good.acceptance_rate:.2f}, random {bad.acceptance_rate:.2f}")
    assert good.acceptance_rate > 0.5 > 0.1 > bad.acceptance_rate
    assert good.target_passes < bad.target_passes


def test_generate_from_the_cli(checkpoint, mtp_pair, capsys):
    target, head, _ = checkpoint
    argv = ["generate", "--target", str(target), "--drafter", "mtp", "--head", str(head)]
    argv += ["--temp", "0", "--max-tokens", "16", "--num-draft-tokens", "3", "--json", "--raw"]
    assert cli_main([*argv, PROMPTS[0]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == reference(mtp_pair, PROMPTS[0], 16)
    assert out["stats"]["drafted"] > 0


def fresh_keys(pair, tokens: list[int], pairs: int) -> mx.array:
    """The head's keys for the pairs (h[t], s[t+1]), t < pairs, from one full target forward."""
    with capturing(pair.target, (FINAL_NORM,)) as got:
        pair.target(mx.array([tokens]))
    embed, _ = mtp.target_parts(pair.target)
    cache = [mtp.KVCache()]
    ids = mx.array(tokens[1 : pairs + 1])
    pair.head(embed(ids)[None], got[FINAL_NORM][:, :pairs], cache)
    return cache[0].keys[..., :pairs, :], got[FINAL_NORM][0]


@pytest.mark.parametrize("which", ["mtp_pair", "random_pair"])
def test_the_head_cache_stays_consistent_through_rejections(request, which):
    """Rejected rounds make the recurrent target replay (TargetOutput.kept = 0). The head's
    cache must then hold exactly the pairs a fresh run over the sequence gives."""
    mtp_pair = request.getfixturevalue(which)
    decoder = make_decoder(mtp_pair)
    res = generate(mtp_pair, PROMPTS[1], max_tokens=30, num_draft_tokens=4, decoder=decoder)
    assert res.stats.drafted > res.stats.accepted  # rejections happened
    assert res.stats.replayed_tokens > 0  # the target went back and replayed
    drafter = decoder.drafter
    sequence = decoder.sequence
    assert drafter.tokens == sequence
    assert drafter.end + drafter.rows.shape[0] == len(sequence) - 1  # every hidden but the last
    keys, hidden = fresh_keys(mtp_pair, sequence, drafter.end)
    assert drafter.cache[0].offset == drafter.end
    assert mx.allclose(drafter.cache[0].keys[..., : drafter.end, :], keys, atol=1e-4)
    assert mx.allclose(drafter.rows, hidden[drafter.end : len(sequence) - 1], atol=1e-4)
    # a follow-up turn continues from these caches and still matches the target alone
    ids = sequence + [7, 8]
    again = generate(mtp_pair, ids, max_tokens=16, num_draft_tokens=3, decoder=decoder)
    assert again.tokens == reference(mtp_pair, ids, 16)


def test_sampled_drafts_keep_the_targets_distribution(tiny_models, tmp_path):
    """Temperature 1 on a 16-token vocabulary: (t1, t2) counts against the exact joint."""
    original_checkpoint(
        tmp_path / "small", 16, tiny_models.tokenizer, seed=3, head_scale=2.0, agree=0.0
    )
    assert cli_main(["heads", "extract", str(tmp_path / "small"), str(tmp_path / "head")]) == 0
    pair = load_pair(target=str(tmp_path / "small"), drafter="mtp", head=str(tmp_path / "head"))
    params = SamplingParams(temperature=1.0)
    drafter = mtp.MTPDrafter(pair.head, pair.target, 16)
    counts = first_two(pair, params, runs=300, k=2, drafter=drafter)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    print(f"chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold


def test_a_quantized_head(checkpoint, tmp_path):
    target, _, _ = checkpoint
    out = tmp_path / "q4"
    assert cli_main(["heads", "extract", str(target), str(out), "--bits", "4"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    pair = load_pair(target=str(target), drafter="mtp", head=str(out))
    res = generate(pair, PROMPTS[2], max_tokens=12, num_draft_tokens=2)
    assert res.tokens == reference(pair, PROMPTS[2], 12)


def one_line(capsys, *argv) -> str:
    assert cli_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_input_gets_one_line(checkpoint, tiny_models, tmp_path, capsys):
    target, head, _ = checkpoint
    out = tmp_path / "out"
    assert "does not exist" in one_line(capsys, "heads", "extract", tmp_path / "nope", out)
    # a family without an MTP layout (the tiny llama), a directory without weights, and a
    # conversion whose mtp tensors were dropped
    err = one_line(capsys, "heads", "extract", tiny_models.target, out)
    assert "no MTP layout for model type 'llama'" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "no config.json" in one_line(capsys, "heads", "extract", bare, out)
    (bare / "config.json").write_text('{"model_type": "qwen3_5"}')
    assert "no model.safetensors" in one_line(capsys, "heads", "extract", bare, out)
    mx.save_safetensors(str(bare / "model.safetensors"), {"lm_head.weight": mx.zeros((2, 2))})
    assert "no MTP layer (no mtp.* tensors" in one_line(capsys, "heads", "extract", bare, out)
    err = one_line(capsys, "heads", "extract", "nobody/not-downloaded", out)
    assert "not downloaded" in err
    assert "already exists" in one_line(capsys, "heads", "extract", target, head)
    assert not out.exists()
    # a head that is not for this target, and --drafter mtp without a head
    err = one_line(capsys, "generate", "--target", tiny_models.target, "--drafter", "mtp",
                   "--head", head, "hi")  # fmt: skip
    assert "for a qwen3_5 target, not llama" in err
    err = one_line(capsys, "generate", "--target", target, "--drafter", "mtp", "hi")
    assert "--head" in err


def test_head_directory_checks(checkpoint, tmp_path):
    target, head, _ = checkpoint
    config = json.loads((target / "config.json").read_text())
    with pytest.raises(mtp.SpecError, match="not an MTP head"):
        mtp_head.load_head(target, config)
    other = dict(config, text_config={**config["text_config"], "vocab_size": 999})
    with pytest.raises(mtp.SpecError, match="vocab_size"):
        mtp_head.load_head(head, other)
    assert np.isfinite(float(mtp_head.load_head(head, config).fc.weight.sum()))


def cached_heads(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def listed(capsys, name: str) -> str:
    """The line `mlx-spec models` printed for a pair."""
    return next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == [name])


def test_a_pair_names_the_original_checkpoint(checkpoint, tmp_path, monkeypatch, capsys):
    """`draft = { head = "mtp", path = ORIGINAL }`: the head is extracted once into the cache
    ($MLX_SPEC_CACHE/heads), the same head `heads extract` writes, and reused after; an
    interrupted extract leaves nothing behind; `mlx-spec models` says whether it is there."""
    from mlx_spec.drafters import mtp_extract as heads

    target, head, _ = checkpoint
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    root = heads.cache_root()
    toml = tmp_path / "models.toml"
    draft = f'{{ head = "mtp", path = "{target}" }}'
    toml.write_text(f'[pairs.own]\ntarget = "{target}"\ndraft = {draft}\n')
    monkeypatch.setenv("MLX_SPEC_MODELS", str(toml))
    assert cli_main(["models"]) == 0
    assert listed(capsys, "own").split()[2] == "no"

    real = heads.extract

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # after the files are written, before they are in place

    monkeypatch.setattr(heads, "extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_pair("own")
    assert cached_heads(root) == []  # no half-written head, no hidden partial directory
    monkeypatch.setattr(heads, "extract", real)

    pair = load_pair("own")
    assert pair.config.head == str(target)
    [name] = cached_heads(root)
    assert name.endswith("-float")  # the tiny target is not quantized
    saved = mx.load(str(root / name / "model.safetensors"))
    direct = mx.load(str(head / "model.safetensors"))
    assert sorted(saved) == sorted(direct)
    assert all(mx.array_equal(saved[k], direct[k]) for k in saved)
    res = generate(pair, PROMPTS[0], max_tokens=12, num_draft_tokens=3)
    assert res.tokens == reference(pair, PROMPTS[0], 12) and res.stats.drafted > 0
    assert cli_main(["models"]) == 0
    assert listed(capsys, "own").split()[2] == "yes"

    def refuse(*args, **kwargs):
        raise AssertionError("extracted again")

    monkeypatch.setattr(heads, "extract", refuse)
    assert load_pair("own").head is not None  # reused
    monkeypatch.setattr(heads, "extract", real)
    # a quantized target gets a head quantized like it, in a directory of its own
    q4 = {"quantization": {"group_size": 64, "bits": 4}}
    quantized = KINDS["mtp"].resolve_head(str(target), q4)
    assert quantized.parent == root and quantized.name.endswith("-4bit-g64")
    assert json.loads((quantized / "config.json").read_text())["quantization"] == q4["quantization"]
    assert len(cached_heads(root)) == 2


def test_an_original_named_by_hub_id_while_offline_is_one_line(
    checkpoint, tmp_path, monkeypatch, capsys
):
    target, _, _ = checkpoint
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line(capsys, "generate", "--target", target, "--drafter", "mtp",
                   "--head", "Qwen/Qwen3.5-27B", "hi")  # fmt: skip
    assert "Qwen/Qwen3.5-27B is not downloaded and HF_HUB_OFFLINE is set" in err


def test_each_curated_qwen35_target_has_an_mtp_pair():
    """Every curated Qwen3.5 target also comes with its own MTP layer, and every MTP pair
    (Qwen3.5 and Qwen3.6, which has no small sibling to draft with) names the original
    repository of the same model."""
    from mlx_spec.pairs.registry import load_registry

    pairs = load_registry().pairs.values()
    targets = {p.target for p in pairs if "/Qwen3.5-" in p.target and p.drafter != "mtp"}
    heads = {p.target: p.head for p in pairs if p.drafter == "mtp"}
    assert targets and targets <= set(heads)
    assert any("/Qwen3.6-" in t for t in heads)
    for target, head in heads.items():  # the original repository of the same model
        assert head.startswith(("Qwen/Qwen3.5-", "Qwen/Qwen3.6-"))
        assert head.split("/")[1] + "-" in target


def test_a_checkpoint_rewritten_in_place_gets_its_own_head(tiny_models, tmp_path, monkeypatch):
    """The head cache is keyed by the checkpoint's content (its files' sizes and times, a hub
    id's revision), not its path alone: rewritten in place, it gets a new head with the new
    weights (the old head drafted for other weights: 0 proposals equal to the peer's)."""
    import shutil
    import time

    from mlx_spec.drafters.mtp_extract import cached_head

    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "qwen35"
    before = original_checkpoint(source, 320, tiny_models.tokenizer, seed=0)
    first = cached_head(str(source), None, report=lambda line: None)
    time.sleep(0.01)  # (a new modification time even on a coarse clock)
    shutil.rmtree(source)  # a re-download into the same folder
    after = original_checkpoint(source, 320, tiny_models.tokenizer, seed=5)
    second = cached_head(str(source), None, report=lambda line: None)
    assert first != second
    name = "mtp.fc.weight"
    assert not mx.array_equal(before[name], after[name])
    for head, tensors in ((first, before), (second, after)):
        stored = mx.load(str(head / "model.safetensors"))
        key = next(k for k in stored if k.endswith("fc.weight"))
        assert mx.allclose(stored[key].astype(mx.float32), tensors[name].astype(mx.float32))
    assert cached_head(str(source), None, report=lambda line: None) == second  # reused
