"""Gemma 4 assistant drafters (`--drafter assistant`): tiny checkpoints written in the
published layout (config.json `gemma4_assistant` with a `text_config`; `model.*` layers
without key/value projections, `pre_projection`, `post_projection`) over tiny Gemma 4
targets carrying what the published ones do (tiny.gemma4_config: sliding and full layers,
an 8-token window the tests run past, shared keys and values, a wider full-attention head
whose keys are its values, proportional partial rotary embeddings, a soft-capped tied
head; a MoE variant). Lossless greedy and sampled, drafts equal to a forward written apart
in plain MLX ops, state after mixed rounds equal to a fresh prefill's, malformed heads
refused in one line."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_dflash import assert_the_cli_drafts
from test_distribution import PROMPT as SMALL_PROMPT
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import Decoder, SamplingParams, SpecError, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.drafters.assistant import AssistantArgs, AssistantDrafter, AssistantHead

TYPES = ["sliding_attention", "full_attention"]


def head_config(target_text: dict, ordered: bool = False, layers=TYPES, **top) -> dict:
    """A config.json as Google publishes an assistant: the top level's fields and a
    gemma4_text `text_config` whose attention shapes are the target's (num_kv_shared_layers
    unset: every layer shares)."""
    t = target_text
    text = {
        "model_type": "gemma4_text",
        "vocab_size": t["vocab_size"],
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["hidden_size"] * 2,
        "num_hidden_layers": len(layers),
        "layer_types": list(layers),
        "num_attention_heads": 4,
        "head_dim": t["head_dim"],
        "global_head_dim": t["global_head_dim"],
        "num_key_value_heads": t["num_key_value_heads"],
        "num_global_key_value_heads": t["num_global_key_value_heads"],
        "attention_k_eq_v": True,
        "sliding_window": t["sliding_window"],
        "rope_parameters": t["rope_parameters"],
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
    }
    cfg = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": t["hidden_size"],
        "use_ordered_embeddings": ordered,
        "num_centroids": 16 if ordered else 2048,
        "centroid_intermediate_top_k": 4 if ordered else 32,
        "tie_word_embeddings": True,
        "block_size": 4,
        "text_config": text,
    }
    return cfg | top


def head_weights(config: dict, target_embed: mx.array, seed: int = 1, layer_scale=0.15):
    """Weights under the published names, "trained" enough to agree with the target often:
    the tiny targets (tiny.gemma4_weights) often repeat their last token, so this drafter
    guesses the token it is fed again — its tied embedding is the target's, `pre_projection`
    passes the token's embedding through (plus a little of the state), `post_projection` is
    the identity — and the layers add a `layer_scale` share of their random attention and
    MLP outputs (1: a random head whose guesses depend on what it attends to)."""
    mx.random.seed(seed)
    args = AssistantArgs(config)
    weights = dict(tree_flatten(AssistantHead(args).parameters()))
    hidden = args.hidden_size
    eye = mx.eye(hidden)
    noise = mx.random.normal((hidden, hidden)) * 0.05
    weights["pre_projection.weight"] = mx.concatenate([eye, noise], axis=1)
    weights["post_projection.weight"] = eye
    weights["model.embed_tokens.weight"] = target_embed
    for k in weights:
        if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            weights[k] = weights[k] * layer_scale
    if args.ordered:  # clusters of consecutive ids, shuffled; centroids from the tokens
        order = np.random.default_rng(seed).permutation(args.vocab_size)
        weights["masked_embedding.token_ordering"] = mx.array(order.astype(np.int64))
        groups = target_embed[mx.array(order)].reshape(args.num_centroids, -1, hidden)
        weights["masked_embedding.centroids.weight"] = groups.mean(axis=1) * 4
    return {k: v.astype(mx.float32) if k != "masked_embedding.token_ordering" else v
            for k, v in weights.items()}  # fmt: skip


def write_head(path, config: dict, target_embed, drop: str | None = None, **kw):
    weights = head_weights(config, target_embed, **kw)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # the tied copy
    if drop:
        weights.pop(drop)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def target_embedding(target_dir) -> mx.array:
    saved = mx.load(str(target_dir / "model.safetensors"))
    return saved["model.language_model.embed_tokens.weight"]


def text_of(target_dir) -> dict:
    return json.loads((target_dir / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    tok = tiny_models.tokenizer
    out = {"root": root}
    for name, moe in (("dense", False), ("moe", True)):
        target = tiny.write_gemma4(root / name, tok, moe=moe)
        cfg = head_config(text_of(target))
        out[name] = target
        out[name + "_head"] = write_head(root / (name + "_head"), cfg, target_embedding(target))
    dense = out["dense"]
    out["random_head"] = write_head(
        root / "random_head", head_config(text_of(dense)), target_embedding(dense), layer_scale=1
    )
    out["ordered_head"] = write_head(
        root / "ordered_head", head_config(text_of(dense), ordered=True), target_embedding(dense)
    )
    return out


@pytest.fixture(scope="module")
def dense_pair(models):
    return load_pair(
        target=str(models["dense"]), drafter="assistant", head=str(models["dense_head"])
    )


@pytest.fixture(scope="module")
def moe_pair(models):
    return load_pair(target=str(models["moe"]), drafter="assistant", head=str(models["moe_head"]))


TOKENS = 40  # past the 8-token window, with the prompt


def assert_greedy_equals_the_target_alone(pair, k, tokens=TOKENS):
    drafted = accepted = 0
    for prompt in PROMPTS:
        res = generate(pair, prompt, max_tokens=tokens, num_draft_tokens=k)
        assert res.tokens == reference(pair, prompt, tokens)
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    if k != "auto":  # auto follows this machine's timings: it may pause the head
        assert drafted > 0
    return drafted, accepted


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_equals_the_target_alone(dense_pair, k):
    drafted, accepted = assert_greedy_equals_the_target_alone(dense_pair, k)
    if k != "auto":
        assert 0 < accepted < drafted  # mixed rounds: some guesses kept, some not


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_on_a_moe_target(moe_pair, k):
    """26B-A4B's layout: routed experts beside the dense MLP in every layer."""
    assert_greedy_equals_the_target_alone(moe_pair, k)
