"""DSpark block drafters: tiny heads written in the published layout (DFlash's backbone, the
Markov head, the confidence head; config.json as Liquid AI's LFM2.5 heads), random weights, over
tiny targets; lossless greedy and sampled, the drafts equal to a forward written apart in plain
MLX ops after mlx-vlm's `qwen3_dspark`, refused when malformed."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_dflash import (
    assert_context_matches_a_fresh_prefill,
    assert_greedy_equals_the_target_alone,
    assert_processors_and_a_grammar_stay_lossless,
    assert_the_cli_drafts,
)
from test_dflash import head_config as dflash_config
from test_dflash import write_head as write_dflash
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import Decoder, SamplingParams, SpecError, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.drafters.dspark import DSparkArgs, DSparkDrafter, DSparkHead

RANK = 8


def head_config(target: dict, layer_ids, block_size=6, mask=5, layers=1) -> dict:
    """A config.json as Liquid AI publishes a DSpark head: DFlash's Qwen3 config, `block_size`
    the number of guesses, the Markov head's fields, interleaved rope."""
    cfg = dflash_config(target, layer_ids, block_size, mask, layers)
    cfg["architectures"] = ["Lfm2DSparkDraftModel"]
    del cfg["auto_map"]
    cfg["dflash_config"]["num_target_layers"] = target["num_hidden_layers"]
    return cfg | {
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "rope_is_neox_style": False,
    }


def head_weights(config: dict, seed: int = 1, markov: float = 4.0) -> dict:
    """Random weights under the published names, the Markov bias scaled up by `markov` (so
    that it moves the guesses: what a wrong q would show), a confidence head beside them."""
    mx.random.seed(seed)
    weights = dict(tree_flatten(DSparkHead(DSparkArgs(config)).parameters()))
    weights = {k: v * 3 if k.endswith("o_proj.weight") else v for k, v in weights.items()}
    weights["markov_head.markov_w2.weight"] *= markov
    hidden = config["hidden_size"]
    weights["confidence_head.proj.weight"] = mx.random.normal((1, hidden + RANK)) * 0.1
    weights["confidence_head.proj.bias"] = mx.zeros((1,))
    return weights


def write_head(path, config: dict, seed: int = 1, drop: str | None = None, prefix: str = ""):
    weights = head_weights(config, seed)
    if drop:
        weights.pop(drop)
    path.mkdir(parents=True, exist_ok=True)
    named = {prefix + k: v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), named)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def write_reduced(path, config: dict, draft: list[int], lm_head=True, d2t=True, seed: int = 1):
    """A head over a reduced vocabulary (mlx-dspark's vLLM speculators heads): `d2t` offsets
    to the target ids `draft`, its own `lm_head` and `markov_w2` over them."""
    weights = head_weights(config, seed)  # markov_w2 already len(draft) rows (the config's)
    if d2t:
        weights["d2t"] = mx.array([t - i for i, t in enumerate(draft)], mx.int64)
    if lm_head:
        weights["lm_head.weight"] = mx.random.normal((len(draft), config["hidden_size"])) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def lfm2_config(vocab_size: int) -> dict:
    """A tiny LFM2 (what Liquid AI's DSpark heads draft for): short-convolution layers (a
    recurrent state, as Qwen3.5's) around a full-attention one."""
    return {
        "model_type": "lfm2",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 1,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "rope_theta": 1e4,
        "layer_types": ["conv", "full_attention", "conv"],
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark")
    llama = json.loads((tiny_models.target / "config.json").read_text())
    # names prefixed `model.` as some exports write them (the loader strips it)
    out = {"llama": write_head(root / "llama", head_config(llama, [0, 2]), prefix="model.")}
    qcfg = tiny.family_configs(320)["qwen3_5"]
    qtarget = tiny.write_model(
        root / "qwen3_5", qcfg, tiny.family_weights(qcfg, 0), tiny_models.tokenizer
    )
    out["qwen3_5_target"] = qtarget
    out["qwen3_5"] = write_head(root / "qwen3_5_head", head_config(qcfg, [1, 2], block_size=5))
    lcfg = lfm2_config(320)
    out["lfm2_target"] = tiny.write_model(
        root / "lfm2", lcfg, tiny.family_weights(lcfg, 0), tiny_models.tokenizer
    )
    out["lfm2"] = write_head(root / "lfm2_head", head_config(lcfg, [0, 2], block_size=9))
    small = json.loads((tiny_models.small_target / "config.json").read_text())
    out["small"] = write_head(root / "small", head_config(small, [0, 1], block_size=3, mask=15))
    out["root"] = root
    out["llama_config"] = llama
    return out


@pytest.fixture(scope="module")
def llama_pair(tiny_models, heads):
    return load_pair(target=str(tiny_models.target), drafter="dspark", head=str(heads["llama"]))


@pytest.fixture(scope="module")
def qwen_pair(heads):
    target = str(heads["qwen3_5_target"])
    return load_pair(target=target, drafter="dspark", head=str(heads["qwen3_5"]))


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_equals_the_target_alone(llama_pair, k):
    assert_greedy_equals_the_target_alone(llama_pair, k)


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_on_a_recurrent_target(qwen_pair, k):
    """Qwen3.5 (Gated-DeltaNet): rejected rounds restore the target and replay the kept tokens,
    whose hidden rows the head takes from the pass that verified them."""
    res = generate(qwen_pair, PROMPTS[1], max_tokens=30, num_draft_tokens=k)
    assert res.tokens == reference(qwen_pair, PROMPTS[1], 30)
    if k != "auto":  # auto follows this machine's timings: it may pause a poor head at once
        assert res.stats.drafted > 0


@pytest.mark.parametrize("k", [4, 9, "auto"])
def test_greedy_on_an_lfm2_target(heads, k):
    """LFM2, the published heads' family (a block of 9, as LiquidAI/LFM2.5-*-DSpark)."""
    pair = load_pair(target=str(heads["lfm2_target"]), drafter="dspark", head=str(heads["lfm2"]))
    res = generate(pair, PROMPTS[0], max_tokens=30, num_draft_tokens=k)
    assert res.tokens == reference(pair, PROMPTS[0], 30)
    if k != "auto":
        assert res.stats.drafted > 0


def test_every_row_of_the_block_guesses(llama_pair):
    """A block of 6 drafts 6 (the anchor's row guesses too); a shorter proposal is the
    longer one's prefix (the Markov chain runs left to right)."""
    drafter = DSparkDrafter(llama_pair.head, llama_pair.target)
    assert drafter.max_draft == 6 and drafter.hidden_layers == (0, 2)
    drafter.prefill([1, 9, 40, 7], output=None)
    tokens, q = drafter.propose(12, SamplingParams(), None)
    assert tokens.shape == (6,) and q is None and drafter.steps == 1
    some, _ = drafter.propose(3, SamplingParams(), None)
    assert some.tolist() == tokens.tolist()[:3]
    tokens, q = drafter.propose(3, SamplingParams(temperature=1.0), mx.random.key(0))
    assert q.shape == (3, 320) and np.allclose(np.array(q.sum(-1)), 1, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_context_matches_a_fresh_prefill_after_mixed_rounds(llama_pair, qwen_pair, family):
    """DFlash's context bookkeeping, unchanged: after rounds that accept all, part and none of
    their blocks (and Qwen3.5's replays) the context is a fresh prefill's, the guesses too."""
    pair = llama_pair if family == "llama" else qwen_pair
    assert_context_matches_a_fresh_prefill(pair, DSparkDrafter)


# ---------------------------------------------------------------- the reference forward
# Written from mlx-vlm's qwen3_dflash/dflash.py (DFlashAttention, DFlashDecoderLayer, _hidden,
# _logits) and qwen3_dspark/dspark.py (draft_block, VanillaMarkov.sample_block), in plain MLX
# ops over the checkpoint's tensors: nothing of mlx_spec's head is called.


def rms(x, w, eps):
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_interleaved(x, start: int, base: float):
    """(heads, L, d) rotated at positions start..: pairs (2j, 2j + 1), GPT-J style."""
    d = x.shape[-1]
    pos = mx.arange(start, start + x.shape[-2], dtype=mx.float32)[:, None]
    angle = pos * base ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)[None]  # (L, d/2)
    cos, sin = mx.cos(angle), mx.sin(angle)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)


def rope_halves(x, start: int, base: float):
    """(heads, L, d) rotated at positions start..: halves (j, j + d/2), NeoX style."""
    d = x.shape[-1]
    pos = mx.arange(start, start + x.shape[-2], dtype=mx.float32)[:, None]
    angle = pos * base ** (-mx.arange(0, d, 2, dtype=mx.float32) / d)[None]  # (L, d/2)
    cos, sin = mx.cos(angle), mx.sin(angle)
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return mx.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


def no_conv(prefix, x):
    return x, lambda out: out


def reference_states(w, cfg, ctx, embed_w, anchor, rope, conv=None):
    """The backbone: the block [anchor, mask...] over the context features ctx (S, n*H) ->
    the final norm's states (block, H). `conv(prefix, x)` (DFlash2's): the sublayer's input
    mixed and a function that mixes its output."""
    eps, heads, kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    flash = cfg["dflash_config"]
    d, g = cfg["head_dim"], cfg.get("block_size") or flash["block_size"]
    block = mx.array([anchor] + [flash["mask_token_id"]] * (g - 1))
    h = embed_w[block]  # (g, H)
    h_ctx = rms(ctx @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (S, H)
    S = h_ctx.shape[0]
    conv = conv or no_conv
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x, after = conv(p + "attention_conv.", rms(h, w[p + "input_layernorm.weight"], eps))

        def proj(name, rows, n, p=p):
            return (rows @ w[p + f"self_attn.{name}_proj.weight"].T).reshape(-1, n, d)

        q = rms(proj("q", x, heads), w[p + "self_attn.q_norm.weight"], eps).transpose(1, 0, 2)
        k_ctx = rms(proj("k", h_ctx, kv), w[p + "self_attn.k_norm.weight"], eps)
        k_blk = rms(proj("k", x, kv), w[p + "self_attn.k_norm.weight"], eps)
        v = mx.concatenate([proj("v", h_ctx, kv), proj("v", x, kv)]).transpose(1, 0, 2)
        base = cfg["rope_theta"]
        q = rope(q, S, base)
        k = mx.concatenate(
            [rope(k_ctx.transpose(1, 0, 2), 0, base), rope(k_blk.transpose(1, 0, 2), S, base)],
            axis=1,
        )  # (kv, S + g, d)
        k, v = mx.repeat(k, heads // kv, axis=0), mx.repeat(v, heads // kv, axis=0)
        att = mx.softmax((q @ k.transpose(0, 2, 1)) * d**-0.5, axis=-1)  # unmasked
        o = (att @ v).transpose(1, 0, 2).reshape(g, heads * d)
        h = h + after(o @ w[p + "self_attn.o_proj.weight"].T)
        x, after = conv(p + "mlp_conv.", rms(h, w[p + "post_attention_layernorm.weight"], eps))
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + after((gate * mx.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T)
    return rms(h, w["norm.weight"], eps)


def reference_logits(w, cfg, ctx, embed_w, head_w, anchor, guesses):
    """DSpark: every row's base logits, then each position's with the Markov bias of the token
    before it (anchor, then `guesses`): (len(guesses) + 1, vocab)."""
    base_logits = reference_states(w, cfg, ctx, embed_w, anchor, rope_interleaved) @ head_w.T
    previous = mx.array([anchor] + list(guesses))
    bias = w["markov_head.markov_w1.weight"][previous] @ w["markov_head.markov_w2.weight"].T
    return base_logits[: previous.shape[0]] + bias


def target_features(model, tokens: list[int], ids) -> mx.array:
    """The target's layer outputs at `ids`, side by side, at every position (mlx-lm's llama
    layers called one by one)."""
    inner = model.model
    h, outs = inner.embed_tokens(mx.array([tokens])), []
    for layer in inner.layers:
        h = layer(h, "causal")
        outs.append(h[0])
    return mx.concatenate([outs[i] for i in ids], axis=-1)


def test_drafts_equal_a_reference_forward(llama_pair, heads):
    """Greedy guesses and sampled q (each position's, given the guess drawn before it) equal
    the reference's on the checkpoint's tensors; and the Markov bias matters: the q of a
    later position given another previous token differs."""
    pair = llama_pair
    cfg = json.loads((heads["llama"] / "config.json").read_text())
    saved = mx.load(str(heads["llama"] / "model.safetensors"))
    w = {k.removeprefix("model."): v for k, v in saved.items()}
    embed_w = pair.target.model.embed_tokens.weight
    head_w = pair.target.lm_head.weight if hasattr(pair.target, "lm_head") else embed_w
    prompt = pair.tokenizer.encode(PROMPTS[0])
    ctx = target_features(pair.target, prompt, cfg["dflash_config"]["target_layer_ids"])[:-1]
    drafter = DSparkDrafter(pair.head, pair.target)
    Decoder(pair.target, drafter, ()).prefill(prompt)
    g = cfg["block_size"]

    greedy, _ = drafter.propose(g, SamplingParams(), None)
    want = []
    for i in range(g):  # the reference's own greedy chain
        row = reference_logits(w, cfg, ctx, embed_w, head_w, prompt[-1], want)[i]
        want.append(int(mx.argmax(row).item()))
    assert greedy.tolist() == want

    params = SamplingParams(temperature=1.0)
    tokens, q = drafter.propose(g, params, mx.random.key(3))
    drawn = tokens.tolist()
    expected = mx.softmax(
        reference_logits(w, cfg, ctx, embed_w, head_w, prompt[-1], drawn[:-1]), -1
    )
    diff = float(mx.abs(q - expected).max())
    print(f"max |q - reference q| = {diff:.2e}")
    assert diff < 1e-5
    other = [(t + 1) % 320 for t in drawn[:-1]]  # other previous guesses, same block
    moved = mx.softmax(reference_logits(w, cfg, ctx, embed_w, head_w, prompt[-1], other), -1)
    assert float(mx.abs(moved[1:] - expected[1:]).max()) > 0.05


def test_processors_and_a_grammar_stay_lossless(llama_pair):
    """Penalties and a grammar see each position after the Markov bias: the target's tokens."""
    assert_processors_and_a_grammar_stay_lossless(llama_pair)


def test_sampling_keeps_the_target_distribution(tiny_models, heads):
    """Temperature 1 on a 16-token vocabulary: the first two tokens' joint frequencies match
    the target's exact joint distribution — the second guess is drawn given the first, so a q
    that left out the Markov bias (or took it from another previous token) would skew it."""
    target = str(tiny_models.small_target)
    pair = load_pair(target=target, drafter="dspark", head=str(heads["small"]))
    params = SamplingParams(temperature=1.0)
    drafter = DSparkDrafter(pair.head, pair.target)
    counts = first_two(pair, params, 600, k=3, drafter=drafter)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold


def test_the_cli_drafts_with_a_head(tiny_models, heads, capsys):
    assert_the_cli_drafts(tiny_models.target, "dspark", heads["llama"], capsys)


def bad_heads(root, llama: dict) -> dict:
    cfg = head_config(llama, [0, 2])
    no_rank = {k: v for k, v in cfg.items() if k != "markov_rank"}
    gated = cfg | {"markov_head_type": "gated"}
    cases = {
        "no Markov weights": (
            write_head(root / "missing", cfg, drop="markov_head.markov_w2.weight"),
            "weights do not fit its config",
        ),
        "no Markov rank": (write_head(root / "norank", cfg), "no markov_rank"),
        "a gated Markov head": (write_head(root / "gated", cfg), "vanilla Markov head"),
        "another vocabulary": (
            write_head(root / "vocab", head_config({**llama, "vocab_size": 400}, [0, 2])),
            "vocabulary is 400 tokens, the target's 320",
        ),
        "layer past the depth": (
            write_head(root / "deep", head_config(llama, [0, 4])),
            "DSpark head reads target layer 4, but the target has 4 layers",
        ),
        "an empty block": (write_head(root / "empty", cfg), "at least 1 token, got -1"),
        "a DFlash2 head": (write_head(root / "dflash2", cfg), "DFlash2 head"),
    }
    draft = list(range(0, 320, 2))  # a reduced vocabulary: the even ids
    reduced = cfg | {"draft_vocab_size": len(draft)}
    cases |= {
        "d2t without its own lm_head": (
            write_reduced(root / "nohead", reduced, draft, lm_head=False),
            "a d2t table but no lm_head",
        ),
        "a reduced vocabulary without d2t": (
            write_reduced(root / "nod2t", reduced, draft, d2t=False),
            "ships no d2t table",
        ),
        "d2t past the target's vocabulary": (
            write_reduced(root / "outside", reduced, [t + 2 for t in draft]),
            "outside the target's vocabulary of 320",
        ),
        "logits_start past the block": (
            write_head(root / "start", cfg),
            "logits_start must be a row of the block, got 6",
        ),
        "a speculators EAGLE-3 head": (
            write_head(root / "spec_eagle", cfg),
            "speculators 'eagle3' model, not dspark",
        ),
    }
    spec = {"speculators_model_type": "eagle3", "transformer_layer_config": cfg}
    (root / "spec_eagle" / "config.json").write_text(json.dumps(spec))
    (root / "start" / "config.json").write_text(json.dumps(cfg | {"logits_start": 6}))
    dflash2 = cfg | {"architectures": ["DFlash2DraftModel"]}
    dflash2["dflash_config"] = cfg["dflash_config"] | {"selector_top_k": 16, "selector_rank": 8}
    (root / "dflash2" / "config.json").write_text(json.dumps(dflash2))
    (root / "empty" / "config.json").write_text(json.dumps(cfg | {"block_size": -1}))
    (root / "norank" / "config.json").write_text(json.dumps(no_rank))
    (root / "gated" / "config.json").write_text(json.dumps(gated))
    return cases


def test_bad_heads_are_refused_in_one_line(tiny_models, heads, capsys):
    cases = bad_heads(heads["root"] / "bad", heads["llama_config"])
    target = str(tiny_models.target)
    for label, (path, message) in cases.items():
        with pytest.raises(SpecError, match=message):
            load_pair(target=target, drafter="dspark", head=str(path))
        args = ["generate", "--target", target, "--drafter", "dspark", "--head", str(path), "x"]
        assert main(args) == 2, label
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, label
    with pytest.raises(SpecError, match="needs a head directory"):
        load_pair(target=target, drafter="dspark")
    # each kind's head named as the other: pointed at the right kind
    with pytest.raises(SpecError, match="a DSpark head .*--drafter dspark"):
        load_pair(target=target, drafter="dflash", head=str(heads["llama"]))
    plain_cfg = dflash_config(heads["llama_config"], [0, 2])
    dflash_head = write_dflash(heads["root"] / "bad" / "plain", plain_cfg)
    with pytest.raises(SpecError, match="no markov_rank .*--drafter dflash"):
        load_pair(target=target, drafter="dspark", head=str(dflash_head))


def test_rope_pairing_defaults_to_neox_as_the_peers_read_it():
    """A config without rope_is_neox_style: NeoX (split halves; MLX traditional=False), as
    mlx-vlm 0.7.10's DSparkConfig (rope_is_neox_style: bool = True) and mlx-dspark 0.20.3
    (absent -> the family default, neox) read it; it was interleaved here before. The
    published heads say false, which stays interleaved."""
    cfg = head_config(tiny.family_configs(320)["qwen3"], [1, 2])
    assert DSparkArgs(cfg).rope_traditional is True  # the published heads' own setting
    del cfg["rope_is_neox_style"]
    assert DSparkArgs(cfg).rope_traditional is False


@pytest.mark.parametrize(
    ("fields", "dflash_fields", "rows"),
    [
        ({}, {}, (0, 6)),  # DeepSpec / Liquid AI: the anchor's row guesses, block_size guesses
        ({}, {"sample_from_anchor": True}, (0, 6)),
        ({}, {"sample_from_anchor": False}, (1, 7)),  # mlx-vlm: one wider, from row 1
        ({"dspark_bonus_anchor": True}, {}, (0, 5)),  # mlx-vlm: block_size counts the anchor
        ({"dspark_bonus_anchor": True}, {"sample_from_anchor": False}, (1, 6)),
        ({"logits_start": 1}, {}, (1, 6)),  # mlx-dspark: block_size wide, from that row
        ({"sample_from_anchor": False}, {}, (1, 6)),  # mlx-dspark's top-level spelling
        ({"sample_from_anchor": True}, {}, (0, 6)),
    ],
)
def test_the_rows_that_guess_are_read_as_the_peers_read_them(fields, dflash_fields, rows):
    """(first guessing row, block width) for a config of block_size 6: mlx-vlm 0.7.10's
    DSparkConfig.from_dict (proposal_length = block_size - dspark_bonus_anchor, the block
    1 + proposal_length - sample_from_anchor wide) and mlx-dspark 0.20.3's logits_start (the
    block block_size wide); always row 0 and block_size before."""
    cfg = head_config(tiny.family_configs(320)["qwen3"], [1, 2]) | fields
    cfg["dflash_config"] = cfg["dflash_config"] | dflash_fields
    args = DSparkArgs(cfg)
    assert (args.first_row, args.block_size) == rows
    assert DSparkHead(args).first_row == rows[0]


def test_a_speculators_config_reads_as_mlx_dspark_translates_it():
    """vLLM speculators packaging: the backbone under transformer_layer_config, the target
    layers as aux_hidden_state_layer_ids, the first guessing row block_size minus the
    proposal's speculative_tokens (else sample_from_anchor, else 1); refused before ('no
    hidden_size')."""
    layer = head_config(tiny.family_configs(320)["qwen3"], [1, 2])
    del layer["dflash_config"], layer["block_size"]
    cfg = {
        "speculators_model_type": "dspark",
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [1, 2],
        "block_size": 8,
        "mask_token_id": 5,
        "markov_rank": RANK,
        "draft_vocab_size": 100,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 7}]},
    }
    args = DSparkArgs(cfg)
    assert args.target_layer_ids == (1, 2) and args.mask_token_id == 5
    assert (args.first_row, args.block_size, args.draft_vocab_size) == (1, 8, 100)
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 8  # no anchor
    assert DSparkArgs(cfg).first_row == 0
    del cfg["speculators_config"]
    assert DSparkArgs(cfg).first_row == 1  # the heads older than sample_from_anchor
    assert DSparkArgs(cfg | {"sample_from_anchor": True}).first_row == 0


def test_a_head_that_ships_its_embedding_and_output_head_drafts_with_them(tiny_models, heads):
    """Both peers embed the block with a shipped embed_tokens, mlx-dspark projects with a
    shipped lm_head: here too (they were dropped before, the target's used)."""
    root = heads["root"] / "own"
    cfg = head_config(heads["llama_config"], [0, 2])
    weights = head_weights(cfg)
    weights["embed_tokens.weight"] = mx.random.normal((320, 64))
    weights["lm_head.weight"] = mx.random.normal((320, 64))
    root.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(root / "model.safetensors"), weights)
    (root / "config.json").write_text(json.dumps(cfg))
    pair = load_pair(target=str(tiny_models.target), drafter="dspark", head=str(root))
    drafter = DSparkDrafter(pair.head, pair.target)
    assert drafter.embed is pair.head.embed_tokens and drafter.lm_head is pair.head.lm_head
    assert mx.array_equal(pair.head.embed_tokens.weight, weights["embed_tokens.weight"])
    assert_greedy_equals_the_target_alone(pair, 4)


def test_a_reduced_vocabulary_keeps_the_target_distribution(tiny_models, heads):
    """A d2t head over 10 of the small target's 16 tokens (refused before): greedy equal to
    the target alone, guesses only among its tokens, and sampled first two tokens distributed
    as the target's (q scattered onto the target's vocabulary, 0 off the head's)."""
    small = json.loads((tiny_models.small_target / "config.json").read_text())
    draft = [0, 2, 3, 5, 7, 8, 11, 12, 13, 15]
    cfg = head_config(small, [0, 1], block_size=3, mask=15) | {"draft_vocab_size": len(draft)}
    path = write_reduced(heads["root"] / "reduced", cfg, draft)
    pair = load_pair(target=str(tiny_models.small_target), drafter="dspark", head=str(path))
    for prompt in ([1, 4, 6], [9, 9, 2, 14, 3]):
        alone = generate(pair, prompt, max_tokens=20, use_draft=False).tokens
        assert generate(pair, prompt, max_tokens=20, num_draft_tokens=3).tokens == alone
    params = SamplingParams(temperature=1.0)
    drafter = DSparkDrafter(pair.head, pair.target)
    Decoder(pair.target, drafter, ()).prefill([1, 4, 6])
    tokens, q = drafter.propose(3, params, mx.random.key(0))
    assert set(tokens.tolist()) <= set(draft)
    off = [t for t in range(16) if t not in draft]
    assert float(q[:, mx.array(off)].max()) == 0.0 and mx.allclose(q.sum(-1), mx.ones(3))
    counts = first_two(pair, params, 600, k=3, drafter=DSparkDrafter(pair.head, pair.target))
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold
