"""The MTP drafter in the DeepSeek-V3 / GLM-4.5 layout (drafters/mtp.py NextNHead) and
`mlx-spec heads extract` on tiny checkpoints written as the originals ship: the MTP layer is
`model.layers.{num_hidden_layers}.*` (enorm, hnorm, eh_proj, shared_head, copies of the
embedding and head, and a decoder layer of the family with one tensor per expert and, for
DeepSeek's MLA, an unsplit kv_b_proj), in shards with a safetensors index.

mlx-lm's deepseek_v3 drops the MTP layer at load by the literal name `model.layers.61` (the
real checkpoints'), so a two-layer DeepSeek target is its mlx-lm conversion (what users run:
an mlx-community model), the head extracted from the original beside it. glm4_moe drops
`model.layers.{num_hidden_layers}`: its target is the original checkpoint itself."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
import real_configs
import tiny
from mlx.utils import tree_flatten
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import reference

from mlx_spec import SamplingParams, generate, load_pair, make_decoder
from mlx_spec.cli import main as cli_main
from mlx_spec.core.hidden import FINAL_NORM, capturing
from mlx_spec.drafters import mtp, mtp_head
from mlx_spec.drafters.base import TargetOutput
from mlx_spec.drafters.mtp_extract import locate

PROMPTS = ["The quick brown fox", "Paris is the capital of"]
OUTPUTS = ("o_proj.weight", "down_proj.weight")
FAMILIES = ["deepseek-v3", "glm-4.5", "glm-4.7-flash"]


def original_names(weights: dict, config: dict) -> dict:
    """mlx-lm's parameter names -> the original checkpoint's: experts one tensor each, MLA's
    embed_q / unembed_out joined back into kv_b_proj (num_heads * (nope + v), kv_lora_rank)."""
    out = {}
    for k, v in weights.items():
        if ".switch_mlp." in k:
            base, proj = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{proj}"] = v[e]
        elif k.endswith("self_attn.embed_q.weight"):
            wv = weights[k.replace("embed_q", "unembed_out")]  # (heads, v, kv_lora)
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)  # (heads, nope + v, kv_lora)
            out[k.replace("embed_q", "kv_b_proj")] = kv_b.reshape(-1, kv_b.shape[-1])
        elif not k.endswith("self_attn.unembed_out.weight"):
            out[k] = v
    return out


def write_original(
    path, name: str, vocab: int, tokenizer, seed=0, head_scale=4.0, agree=None, config=None
):
    """A checkpoint in the original layout (`config`: another than the family's tiny one);
    returns (config, the target's mlx-lm weights, the head's parameters in mlx-lm's names).

    `agree` (a noise level): a head that predicts well. The target's layers are damped so it
    is nearly a bigram model (its hidden state at t+1 ~ norm(embed(s[t+1]))), and the head
    computes that: eh_proj takes the embedding half, its layer adds nothing (zero output
    projections; its attention still fills the cache), shared_head.norm is the final norm."""
    config = config or real_configs.mtp_configs(vocab)[name]
    n = config["num_hidden_layers"]
    weights = tiny.family_weights(config, seed=seed, head_scale=head_scale)
    if agree is not None:
        for k, v in weights.items():
            if k.startswith("model.layers.") and k.endswith(OUTPUTS):
                weights[k] = v * 0.05
    mx.random.seed(seed + 100)
    head = {
        k: v.astype(mx.float32) for k, v in tree_flatten(mtp_head.build_head(config).parameters())
    }
    for k, v in head.items():
        if v.ndim == 1:  # plain RMS norms near 1, biases near 0
            head[k] = ("norm" in k) + 0.1 * mx.random.normal(v.shape)
    if agree is not None:
        hidden = config["hidden_size"]
        eye = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
        head["eh_proj.weight"] = eye + agree * mx.random.normal(eye.shape)
        head["enorm.weight"] = mx.ones((hidden,))
        head["shared_head.norm.weight"] = weights["model.norm.weight"]
        for k in head:
            if k.endswith(OUTPUTS):
                head[k] = mx.zeros_like(head[k])
    layer = {k.removeprefix("layers.0."): v for k, v in head.items()}
    layer["embed_tokens.weight"] = weights["model.embed_tokens.weight"]
    layer["shared_head.head.weight"] = weights["lm_head.weight"]
    hf = original_names(weights, config)
    hf.update({f"model.layers.{n}.{k}": v for k, v in original_names(layer, config).items()})
    names = sorted(hf)
    own = (f"model.layers.{n}.self_attn.", f"model.layers.{n}.mlp.")
    shards = {  # the model over two shards; the MTP layer in a third and in the second
        "model-00001-of-00003.safetensors": [k for k in names if k.startswith("model.layers.0.")],
        "model-00003-of-00003.safetensors": [k for k in names if k.startswith(own)],
    }
    placed = {k for ks in shards.values() for k in ks}
    shards["model-00002-of-00003.safetensors"] = [k for k in names if k not in placed]
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
    return config, weights, head


def build(root, name: str, tokenizer, vocab: int = 320, **kw):
    """(the target to load, the original checkpoint, its head directory, the head's params)."""
    original = root / f"{name}-original"
    config, weights, head = write_original(original, name, vocab, tokenizer, **kw)
    target = original
    if config["model_type"] == "deepseek_v3":  # see the module's docstring
        target = tiny.write_model(root / f"{name}-mlx", config, weights, tokenizer)
    out = root / f"{name}-head"
    assert cli_main(["heads", "extract", str(original), str(out)]) == 0
    return target, original, out, head


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("nextn")
    target, original, head_dir, head = build(root, request.param, tiny_models.tokenizer, agree=0.0)
    pair = load_pair(target=str(target), drafter="mtp", head=str(head_dir))
    return request.param, original, head_dir, head, pair


def test_extract_reads_only_the_layer_shards_and_converts_it(family):
    """The layer's tensors come from the two shards holding them; experts come out stacked,
    kv_b_proj split, the target's embedding and head copies left out: the head's parameters
    exactly as they were before they were written in the original layout."""
    name, original, head_dir, head, _ = family
    _, config, shards, names = locate(str(original))
    assert [s.name for s in shards] == [
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    n = config["num_hidden_layers"]
    assert names and all(k.startswith(f"model.layers.{n}.") for k in names)
    assert f"model.layers.{n}.shared_head.head.weight" in names
    saved = mx.load(str(head_dir / "model.safetensors"))
    assert sorted(saved) == sorted(head)
    for k, v in head.items():
        assert mx.array_equal(saved[k], v), k
    if name != "glm-4.5":  # MLA
        assert "layers.0.self_attn.embed_q.weight" in saved
    written = json.loads((head_dir / "config.json").read_text())
    assert written["head_type"] == "mtp" and written["model_type"] == config["model_type"]


def test_the_head_reads_the_final_norm_and_the_target_loads_without_the_layer(family):
    _, _, _, _, pair = family
    assert isinstance(pair.head, mtp_head.NextNHead)
    assert len(pair.target.layers) == pair.target_config["num_hidden_layers"]
    ids = mx.array([[5, 9, 3, 12]])
    with capturing(pair.target, (FINAL_NORM,)) as got:
        logits = pair.target(ids)
    _, lm_head = mtp.target_parts(pair.target)
    assert mx.allclose(lm_head(got[FINAL_NORM]), logits, atol=1e-5)


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_equals_the_target_alone(family, k):
    _, _, _, _, pair = family
    drafted = accepted = 0
    for prompt in PROMPTS:
        res = generate(pair, prompt, max_tokens=20, num_draft_tokens=k)
        assert res.tokens == reference(pair, prompt, 20), prompt
        assert res.stats.accepted == sum(res.accepted)
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    if k != "auto":  # auto follows this machine's timings: it may pause the head at once
        print(f"k={k}: {accepted}/{drafted} drafts accepted")
        assert drafted > accepted > drafted / 3  # the head is good, and wrong at times


def test_the_head_cache_stays_consistent_through_rejections(family):
    """After rounds with rejections the head's cache holds exactly the pairs (h[t], s[t+1]) a
    fresh run over the sequence gives, the embedding at position 0 masked."""
    _, _, _, _, pair = family
    decoder = make_decoder(pair)
    res = generate(pair, PROMPTS[1], max_tokens=30, num_draft_tokens=4, decoder=decoder)
    assert res.stats.drafted > res.stats.accepted > 0
    drafter, sequence = decoder.drafter, decoder.sequence
    assert drafter.tokens == sequence
    assert drafter.end + drafter.rows.shape[0] == len(sequence) - 1
    with capturing(pair.target, (FINAL_NORM,)) as got:
        pair.target(mx.array([sequence]))
    hidden = got[FINAL_NORM][0]
    fresh = mtp.MTPDrafter(pair.head, pair.target)
    fresh._run(sequence[1 : drafter.end + 1], hidden[: drafter.end], 0)
    assert drafter.cache[0].offset == drafter.end
    end = drafter.end
    keys = fresh.cache[0].keys[..., :end, :]
    assert mx.allclose(drafter.cache[0].keys[..., :end, :], keys, atol=1e-4)
    assert mx.allclose(drafter.rows, hidden[end : len(sequence) - 1], atol=1e-4)
    # position 0's embedding is masked (vLLM's deepseek_mtp.py): the first entry differs
    # from an unmasked run's, the rest are the same pairs
    plain = [mtp.KVCache()]
    embed, _ = mtp.target_parts(pair.target)
    pair.head(embed(mx.array(sequence[1:4]))[None], hidden[None, :3], plain)
    assert not mx.allclose(plain[0].keys[..., :1, :], keys[..., :1, :])
    assert mx.allclose(plain[0].keys[..., 1:3, :], keys[..., 1:3, :], atol=1e-4)


def test_a_quantized_head(family, tmp_path):
    """--bits 4: the layer's linears (MLA's unembed_out, the stacked experts) quantized."""
    _, original, _, _, pair = family
    out = tmp_path / "q4"
    argv = ["heads", "extract", str(original), str(out), "--bits", "4", "--group-size", "32"]
    assert cli_main(argv) == 0
    assert "layers.0.mlp.switch_mlp.down_proj.scales" in mx.load(str(out / "model.safetensors"))
    quantized = load_pair(target=str(pair.target_path), drafter="mtp", head=str(out))
    res = generate(quantized, PROMPTS[1], max_tokens=12, num_draft_tokens=3)
    assert res.tokens == reference(quantized, PROMPTS[1], 12) and res.stats.accepted > 0


def rms(x: mx.array, w: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("name", FAMILIES)
def test_the_forward_follows_vllm(name, tiny_models, tmp_path):
    """A random head's draft distributions against the formula of vLLM's deepseek_mtp.py /
    glm4_moe_mtp.py written out with plain MLX ops around mlx-lm's decoder layer: embedding
    first in eh_proj, position 0's embedding zeroed, step i+1 reading step i's layer output
    before shared_head.norm, logits from the target's head after shared_head.norm."""
    target, _, head_dir, _ = build(tmp_path, name, tiny_models.tokenizer, seed=1)
    pair = load_pair(target=str(target), drafter="mtp", head=str(head_dir))
    prompt = [5, 9, 3, 12, 7]
    with capturing(pair.target, (FINAL_NORM,)) as got:
        pair.target(mx.array([prompt[:-1]]))
    drafter = mtp.MTPDrafter(pair.head, pair.target)
    output = TargetOutput(None, {FINAL_NORM: got[FINAL_NORM][0]}, len(prompt) - 1, 0)
    drafter.prefill(prompt, output=output)
    drafted, qs = drafter.propose(3, SamplingParams(temperature=1.0), mx.random.key(0))

    head, eps = pair.head, pair.target_config["rms_norm_eps"]
    embed, lm_head = mtp.target_parts(pair.target)
    layer, cache = head.layers[0], mtp.KVCache()

    def step(tokens, hidden):  # (L,), (L, H) -> layer outputs (L, H)
        e = embed(mx.array(tokens))
        if cache.offset == 0:
            e[0] = 0  # vLLM: inputs_embeds[positions == 0] = 0
        x = mx.concatenate(
            [rms(e, head.enorm.weight, eps), rms(hidden, head.hnorm.weight, eps)], -1
        )
        x = x @ head.eh_proj.weight.T
        mask = mx.tril(mx.ones((len(tokens), cache.offset + len(tokens)), mx.bool_), cache.offset)
        return layer(x[None], mask=mask if len(tokens) > 1 else None, cache=cache)[0]

    g = step(prompt[1:], got[FINAL_NORM][0])[-1:]
    for i in range(3):
        logits = lm_head(rms(g, head.shared_head.norm.weight, eps))[0]
        assert mx.allclose(qs[i], mx.softmax(logits), atol=1e-5), i
        g = step([int(drafted[i])], g)


def test_sampled_drafts_keep_the_targets_distribution(tiny_models, tmp_path):
    """Temperature 1 on a 16-token vocabulary: (t1, t2) counts against the exact joint."""
    target, _, head_dir, _ = build(
        tmp_path, "deepseek-v3", tiny_models.tokenizer, 16, seed=3, head_scale=2.0, agree=0.0
    )
    pair = load_pair(target=str(target), drafter="mtp", head=str(head_dir))
    params = SamplingParams(temperature=1.0)
    drafter = mtp.MTPDrafter(pair.head, pair.target, 16)
    counts = first_two(pair, params, runs=300, k=2, drafter=drafter)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    print(f"chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold


def one_line(capsys, *argv) -> str:
    assert cli_main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_refusals(family, tiny_models, tmp_path, capsys):
    name, original, head_dir, _, pair = family
    out = tmp_path / "out"
    # an mlx-lm conversion: its sanitize dropped the MTP layer
    config = pair.target_config
    weights = tiny.family_weights(config, seed=0)
    converted = tiny.write_model(tmp_path / "converted", config, weights, tiny_models.tokenizer)
    err = one_line(capsys, "heads", "extract", converted, out)
    assert f"no MTP layer (no model.layers.{config['num_hidden_layers']}.* tensors" in err
    assert not out.exists()
    # a head for another model type, and a target without this head's layout
    other = "glm4_moe" if name == "deepseek-v3" else "deepseek_v3"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for f in head_dir.iterdir():
        (foreign / f.name).write_bytes(f.read_bytes())
    head_config = json.loads((head_dir / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**head_config, "model_type": other}))
    err = one_line(capsys, "generate", "--target", converted, "--drafter", "mtp",
                   "--head", foreign, "hi")  # fmt: skip
    assert f"is for a {other} target, not {config['model_type']}" in err
    err = one_line(capsys, "generate", "--target", tiny_models.target, "--drafter", "mtp",
                   "--head", head_dir, "hi")  # fmt: skip
    assert f"for a {config['model_type']} target, not llama" in err
