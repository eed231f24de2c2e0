"""DFlash2 block drafters (drafters/dflash2.py), read by the `dflash` kind: tiny heads written in
z-lab's published layout (config.json and tensor names as `tests/fixtures/dflash2-*.json` in
z-lab/dflash: the codebooks without `.weight`), random weights, over tiny targets; lossless
greedy and sampled, the guesses and q equal to a forward written apart in plain MLX ops after
z-lab's `dflash/model.py`, refused when malformed (batches: test_batch_dflash2.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_dflash import (
    assert_greedy_equals_the_target_alone,
    assert_processors_and_a_grammar_stay_lossless,
    assert_the_cli_drafts,
)
from test_dflash import head_config as dflash_config
from test_distribution import chi_square, exact_joint, first_two
from test_dspark import reference_states, rope_halves, target_features
from test_greedy_equality import PROMPTS, reference

from mlx_spec import Decoder, SamplingParams, SpecError, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.drafters.dflash2 import DFlash2Args, DFlash2Drafter, DFlash2Head

BOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def head_config(target: dict, layer_ids, block_size=8, mask=5, top_k=16) -> dict:
    """A config.json as z-lab publishes a DFlash2 head (the block size and the new fields in
    `dflash_config`, sliding layers, not causal)."""
    cfg = dflash_config(target, layer_ids, mask=mask)
    del cfg["block_size"], cfg["auto_map"]
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"] |= {
        "block_size": block_size,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "output_multiplier": 0.5,
        "selector_rank": 8,
        "selector_top_k": top_k,
    }
    layers = cfg["num_hidden_layers"]
    return cfg | {
        "is_causal": False,
        "layer_types": ["sliding_attention"] * layers,
        "sliding_window": 2048,
        "use_sliding_window": True,
    }


def write_head(path, config: dict, seed: int = 1, drop: str | None = None):
    """Random weights under z-lab's names; the kernels' base taps near (1, 0) so the layers
    pass their input on, mixed."""
    mx.random.seed(seed)
    weights = dict(tree_flatten(DFlash2Head(DFlash2Args(config)).parameters()))
    for k in [k for k in weights if k.endswith("base_kernel")]:
        taps = mx.array([1.0, 0.0])[None, :, None]
        weights[k] = taps + 0.3 * mx.random.normal(weights[k].shape)
    weights = {k: v * 3 if k.endswith("o_proj.weight") else v for k, v in weights.items()}
    for book in BOOKS:  # published without `.weight`; scaled so the selector matters
        weights[book] = weights.pop(book + ".weight") * 3
    return tiny.write_head(path, config, weights, drop)


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    llama = json.loads((tiny_models.target / "config.json").read_text())
    out = {"llama": write_head(root / "llama", head_config(llama, [0, 2]))}
    qcfg = tiny.family_configs(320)["qwen3_5"]
    out["qwen3_5_target"] = tiny.write_model(
        root / "qwen3_5", qcfg, tiny.family_weights(qcfg, 0), tiny_models.tokenizer
    )
    out["qwen3_5"] = write_head(root / "qwen3_5_head", head_config(qcfg, [1, 2], block_size=6))
    small = json.loads((tiny_models.small_target / "config.json").read_text())
    out["small"] = write_head(root / "small", head_config(small, [0, 1], 4, mask=15, top_k=6))
    out["root"], out["llama_config"] = root, llama
    return out


@pytest.fixture(scope="module")
def llama_pair(tiny_models, heads):
    return load_pair(target=str(tiny_models.target), drafter="dflash", head=str(heads["llama"]))


def test_the_dflash_kind_reads_a_dflash2_head(llama_pair):
    assert isinstance(llama_pair.head, DFlash2Head)
    drafter = llama_pair.config.kind.build(llama_pair)
    assert isinstance(drafter, DFlash2Drafter) and drafter.max_draft == 7
    drafter.prefill([1, 9, 40, 7], output=None)
    tokens, q = drafter.propose(12, SamplingParams(), None)
    assert tokens.shape == (7,) and q is None
    tokens, q = drafter.propose(3, SamplingParams(temperature=1.0), mx.random.key(0))
    assert q.shape == (3, 320) and np.allclose(np.array(q.sum(-1)), 1, atol=1e-5)
    assert int((q > 0).sum(-1).max()) <= 16  # q lives on each position's candidates


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_greedy_equals_the_target_alone(llama_pair, k):
    assert_greedy_equals_the_target_alone(llama_pair, k)


def test_greedy_on_a_recurrent_target(heads):
    pair = load_pair(
        target=str(heads["qwen3_5_target"]), drafter="dflash", head=str(heads["qwen3_5"])
    )
    res = generate(pair, PROMPTS[1], max_tokens=30, num_draft_tokens=4)
    assert res.tokens == reference(pair, PROMPTS[1], 30) and res.stats.drafted > 0


def reference_conv(w, cfg):
    """z-lab's GroupedDynamicCausalConv in plain ops: (prefix, x) -> (mixed x, mix output)."""
    flash = cfg["dflash_config"]
    taps, group = flash["conv_kernel_size"], flash["conv_group_size"]

    def mix(x, dynamic, base):  # x (L, H), dynamic (L, taps, groups), base (taps, H)
        L, H = x.shape
        out = mx.zeros((L, H))
        for t in range(taps):
            rows = mx.concatenate([mx.zeros((t, H)), x[: L - t]]) if t else x
            per_group = mx.repeat(dynamic[:, t], group, axis=-1)  # (L, H)
            out = out + base[t] * rows + per_group * rows
        return out

    def conv(prefix, x):
        groups = x.shape[-1] // group
        dynamic = (x @ w[prefix + "kernel_projection.weight"].T).reshape(-1, 2, taps, groups)
        base = w[prefix + "base_kernel"]
        return mix(x, dynamic[:, 0], base[0]), lambda out: mix(out, dynamic[:, 1], base[1])

    return conv


def test_drafts_equal_a_reference_forward(llama_pair, heads):
    """z-lab's DFlash2 forward written apart (convolutions, neox rope, multiplier, soft-cap,
    the selector's greedy path and its sampled q over the candidates): the guesses and each
    position's q equal it."""
    pair = llama_pair
    cfg = json.loads((heads["llama"] / "config.json").read_text())
    flash = cfg["dflash_config"]
    w = mx.load(str(heads["llama"] / "model.safetensors"))
    embed_w = pair.target.model.embed_tokens.weight
    head_w = pair.target.lm_head.weight
    prompt = pair.tokenizer.encode(PROMPTS[0])
    ctx = target_features(pair.target, prompt, flash["target_layer_ids"])[:-1]
    states = reference_states(w, cfg, ctx, embed_w, prompt[-1], rope_halves, reference_conv(w, cfg))
    states = states[1:]  # DFlash's rows: the anchor's guesses nothing
    cap = flash["final_logit_softcapping"]
    logits = mx.tanh(states @ head_w.T * flash["output_multiplier"] / cap) * cap
    projected = states @ w["candidate_selector.hidden_projection.weight"].T

    def scores(i, previous):  # (vocab,): -inf off the top candidates
        top = mx.argsort(-logits[i])[: flash["selector_top_k"]]
        pred = w[BOOKS[0]][previous] * projected[i]
        s = logits[i][top] + w[BOOKS[1]][top] @ pred
        out = mx.full((logits.shape[-1],), -mx.inf)
        out[top] = s
        return out

    drafter = DFlash2Drafter(pair.head, pair.target)
    Decoder(pair.target, drafter, ()).prefill(prompt)
    greedy, _ = drafter.propose(7, SamplingParams(), None)
    want, previous = [], prompt[-1]
    for i in range(7):
        previous = int(mx.argmax(scores(i, previous)).item())
        want.append(previous)
    assert greedy.tolist() == want

    tokens, q = drafter.propose(7, SamplingParams(temperature=1.0), mx.random.key(5))
    drawn = [prompt[-1], *tokens.tolist()]
    expected = mx.stack([mx.softmax(scores(i, drawn[i]), axis=-1) for i in range(7)])
    diff = float(mx.abs(q - expected).max())
    print(f"max |q - reference q| = {diff:.2e}")
    assert diff < 1e-5


def test_sampling_keeps_the_target_distribution(tiny_models, heads):
    """Temperature 1 on a 16-token vocabulary, 6 candidates a position: the first two tokens'
    joint frequencies match the target's exact joint distribution."""
    pair = load_pair(
        target=str(tiny_models.small_target), drafter="dflash", head=str(heads["small"])
    )
    params = SamplingParams(temperature=1.0)
    drafter = DFlash2Drafter(pair.head, pair.target)
    counts = first_two(pair, params, 600, k=3, drafter=drafter)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold


def test_processors_and_a_grammar_stay_lossless(llama_pair):
    """Penalties and a grammar apply to each position's logits before its candidates are
    chosen: the target's tokens."""
    assert_processors_and_a_grammar_stay_lossless(llama_pair)


def test_the_cli_drafts_with_a_head(tiny_models, heads, capsys):
    assert_the_cli_drafts(tiny_models.target, "dflash", heads["llama"], capsys)


def test_bad_heads_are_refused_in_one_line(tiny_models, heads, capsys):
    root, llama = heads["root"] / "bad", heads["llama_config"]
    cfg = head_config(llama, [0, 2])
    odd = head_config(llama, [0, 2])
    odd["dflash_config"]["conv_group_size"] = 24
    cases = {
        "a selector codebook missing": (
            write_head(root / "missing", cfg, drop=BOOKS[1]),
            "weights do not fit its config",
        ),
        "a group size that does not divide": (
            write_head(root / "odd", cfg),
            "conv_group_size 24 does not divide the hidden size 64",
        ),
    }
    (root / "odd" / "config.json").write_text(json.dumps(odd))
    target = str(tiny_models.target)
    for label, (path, message) in cases.items():
        args = ["generate", "--target", target, "--drafter", "dflash", "--head", str(path), "x"]
        assert main(args) == 2, label
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, label
    with pytest.raises(SpecError, match="a DFlash2 head, not a DSpark head"):
        load_pair(target=target, drafter="dspark", head=str(heads["llama"]))
