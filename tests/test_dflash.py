"""DFlash block drafters: tiny heads written in z-lab's published layout (random weights,
config.json as z-lab's) over tiny targets; lossless greedy and sampled, refused when malformed,
and the context state the same after rejection-heavy rounds as a fresh prefill's."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import Decoder, SamplingParams, SpecError, generate, load_pair
from mlx_spec.cli import main
from mlx_spec.core.processors import Penalties
from mlx_spec.drafters.dflash import DFlashArgs, DFlashDrafter, DFlashHead


def head_config(target: dict, layer_ids, block_size=8, mask=5, layers=1) -> dict:
    """A config.json as z-lab publishes one (a Qwen3 config with the DFlash fields)."""
    hidden = target["hidden_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "intermediate_size": hidden * 2,
        "hidden_act": "silu",
        "vocab_size": target["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "layer_types": ["full_attention"] * layers,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "block_size": block_size,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(layer_ids)},
    }


def write_head(path, config: dict, seed: int = 1, drop: str | None = None):
    """Random weights under z-lab's names (model.safetensors), `drop` one left out."""
    mx.random.seed(seed)
    weights = dict(tree_flatten(DFlashHead(DFlashArgs(config)).parameters()))
    weights = {k: v * 3 if k.endswith("o_proj.weight") else v for k, v in weights.items()}
    return tiny.write_head(path, config, weights, drop)


@pytest.fixture(scope="module")
def heads(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    llama = json.loads((tiny_models.target / "config.json").read_text())
    out = {"llama": write_head(root / "llama", head_config(llama, [0, 2]))}
    qcfg = tiny.family_configs(320)["qwen3_5"]
    qtarget = tiny.write_model(
        root / "qwen3_5", qcfg, tiny.family_weights(qcfg, 0), tiny_models.tokenizer
    )
    out["qwen3_5_target"] = qtarget
    out["qwen3_5"] = write_head(root / "qwen3_5_head", head_config(qcfg, [1, 2], block_size=6))
    small = json.loads((tiny_models.small_target / "config.json").read_text())
    out["small"] = write_head(root / "small", head_config(small, [0, 1], block_size=4, mask=15))
    out["root"] = root
    out["llama_config"] = llama
    return out


@pytest.fixture(scope="module")
def llama_pair(tiny_models, heads):
    return load_pair(target=str(tiny_models.target), drafter="dflash", head=str(heads["llama"]))


@pytest.fixture(scope="module")
def qwen_pair(heads):
    target = str(heads["qwen3_5_target"])
    return load_pair(target=target, drafter="dflash", head=str(heads["qwen3_5"]))


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_equals_the_target_alone(llama_pair, k):
    assert_greedy_equals_the_target_alone(llama_pair, k)


def assert_greedy_equals_the_target_alone(pair, k):
    """Every test prompt, 32 tokens at k: the target's own tokens, some drafted at a fixed k
    (`auto` follows this machine's timings: on a loaded machine it may pause a costly head,
    DFlash2's, at once)."""
    drafted = 0
    for prompt in PROMPTS:
        res = generate(pair, prompt, max_tokens=32, num_draft_tokens=k)
        assert res.tokens == reference(pair, prompt, 32)
        drafted += res.stats.drafted
    assert drafted > 0 or k == "auto"


@pytest.mark.parametrize("k", [5, "auto"])
def test_greedy_on_a_recurrent_target(qwen_pair, k):
    """Qwen3.5 (Gated-DeltaNet): rejected rounds restore the target and replay the kept tokens,
    whose hidden rows the head takes from the pass that verified them."""
    res = generate(qwen_pair, PROMPTS[1], max_tokens=30, num_draft_tokens=k)
    assert res.tokens == reference(qwen_pair, PROMPTS[1], 30)
    if k != "auto":  # auto follows this machine's timings: it may pause a poor head at once
        assert res.stats.drafted > 0


def test_the_block_is_the_heads_and_k_is_capped(llama_pair):
    drafter = DFlashDrafter(llama_pair.head, llama_pair.target)
    assert drafter.max_draft == 7 and drafter.hidden_layers == (0, 2)
    drafter.prefill([1, 9, 40, 7], output=None)
    tokens, q = drafter.propose(12, SamplingParams(), None)
    assert tokens.shape == (7,) and q is None and drafter.steps == 1
    some, _ = drafter.propose(3, SamplingParams(), None)
    assert some.tolist() == tokens.tolist()[:3]  # the controller verifies a prefix
    tokens, q = drafter.propose(3, SamplingParams(temperature=1.0), mx.random.key(0))
    assert q.shape == (3, 320) and np.allclose(np.array(q.sum(-1)), 1, atol=1e-5)
    with pytest.raises(SpecError, match="at least 2 tokens"):
        DFlashDrafter(llama_pair.head, llama_pair.target, block_size=1)


def oracle(drafter_type=DFlashDrafter):
    """The real drafter, but the first guesses of a round replaced, at random, by the target's
    own continuation: rounds that accept all, some and none of the block, its state handled
    as usual."""

    class Oracle(drafter_type):
        def __init__(self, head, target, truth: list[int], seed=0):
            super().__init__(head, target)
            self.truth, self.rng = truth, random.Random(seed)

        def propose(self, k, params, key, *, processors=()):
            tokens, q = super().propose(k, params, key, processors=processors)
            at = len(self.tokens)
            right = self.truth[at : at + tokens.shape[0]]
            n = min(self.rng.choice([0, 0, 1, len(right) // 2, len(right)]), len(right))
            return mx.array(right[:n] + tokens.tolist()[n:], mx.uint32), q

    return Oracle


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_context_matches_a_fresh_prefill_after_mixed_rounds(llama_pair, qwen_pair, family):
    assert_context_matches_a_fresh_prefill(llama_pair if family == "llama" else qwen_pair)


def assert_context_matches_a_fresh_prefill(pair, drafter_type=DFlashDrafter):
    """After rounds that accept all, part and none of their blocks (and, on Qwen3.5, replays),
    the head's context cache holds exactly the rows a prefill of the whole sequence gives:
    every position the target has taken in once, no gap, and the next block's guesses are the
    same. (A recurrent target may end on a rejected round: its kept tokens are still unfed.)"""
    prompt = pair.tokenizer.encode(PROMPTS[0])
    truth = prompt + reference(pair, PROMPTS[0], 40)
    drafter = oracle(drafter_type)(pair.head, pair.target, truth)
    decoder = Decoder(pair.target, drafter, ())
    decoder.prefill(prompt)
    rounds = list(decoder.rounds(40, SamplingParams(), 4))
    assert decoder.sequence == truth[: len(decoder.sequence)]
    accepted = [r.accepted for r in rounds if r.drafted]
    assert 0 in accepted and max(accepted) == 4  # rejected and fully accepted rounds
    drafter.settle()
    n = len(decoder.sequence) - decoder.unfed  # positions the target holds
    fresh = drafter_type(pair.head, pair.target)
    Decoder(pair.target, fresh, ()).prefill(decoder.sequence[: n + 1])
    fresh.settle()
    assert drafter.spans == [[0, n]] and fresh.spans == [[0, n]]
    for mine, theirs in zip(drafter.cache, fresh.cache, strict=True):
        for a, b in zip(mine.keys_and_values(), theirs.keys_and_values(), strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=2e-4, rtol=1e-3)
    if decoder.unfed == 1:
        params = SamplingParams()
        mine = drafter_type.propose(drafter, 4, params, None)[0]  # its own guesses
        theirs = fresh.propose(4, params, None)[0]
        assert mine.tolist() == theirs.tolist()


def test_a_follow_up_prompt_reuses_the_context(llama_pair):
    """A second turn that extends the first: the rows of the shared prefix stay, the rest
    (the first reply's end-of-sequence tail, if any) is cut, and the new rows follow."""
    pair = llama_pair
    drafter = DFlashDrafter(pair.head, pair.target)
    decoder = Decoder(pair.target, drafter, ())
    first = pair.tokenizer.encode(PROMPTS[2])
    decoder.prefill(first)
    list(decoder.rounds(12, SamplingParams(), 3))
    follow = decoder.sequence + pair.tokenizer.encode(" and", add_special_tokens=False)
    assert decoder.prefill(follow) > len(first)  # reused
    drafter.settle()
    fresh = DFlashDrafter(pair.head, pair.target)
    Decoder(pair.target, fresh, ()).prefill(follow)
    fresh.settle()
    assert drafter.spans == fresh.spans == [[0, len(follow) - 1]]
    params = SamplingParams()
    assert (
        drafter.propose(4, params, None)[0].tolist() == fresh.propose(4, params, None)[0].tolist()
    )


def test_processors_and_a_grammar_stay_lossless(llama_pair):
    assert_processors_and_a_grammar_stay_lossless(llama_pair)


def assert_processors_and_a_grammar_stay_lossless(pair):
    """Penalties see the block's earlier guesses as `proposed`; a grammar (no pipelining) masks
    each position after them: greedy output equals the target alone under the same rules."""
    penalties = (Penalties(repetition=1.3, presence=0.5),)
    for settings in ({"processors": penalties}, {"regex": r"(the|a) (quick|lazy) [a-z ]{1,24}\."}):
        plain = generate(pair, PROMPTS[0], max_tokens=24, use_draft=False, **settings)
        res = generate(pair, PROMPTS[0], max_tokens=24, num_draft_tokens=3, **settings)
        assert res.tokens == plain.tokens
        assert res.stats.drafted > res.stats.forced_drafted


def test_sampling_keeps_the_target_distribution(tiny_models, heads):
    """Temperature 1 on a 16-token vocabulary: the first two tokens' joint frequencies match
    the target's exact joint distribution (q per position, drawn independently)."""
    target = str(tiny_models.small_target)
    pair = load_pair(target=target, drafter="dflash", head=str(heads["small"]))
    params = SamplingParams(temperature=1.0)
    drafter = DFlashDrafter(pair.head, pair.target)
    counts = first_two(pair, params, 600, k=3, drafter=drafter)
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold


def test_the_cli_drafts_with_a_head(tiny_models, heads, capsys):
    assert_the_cli_drafts(tiny_models.target, "dflash", heads["llama"], capsys)


def assert_the_cli_drafts(target, kind: str, head, capsys):
    """`generate --drafter KIND --head DIR --json`: the plain reply's tokens, some drafted."""
    common = ["generate", "--target", str(target), "--max-tokens", "20", "--json"]
    head = ["--drafter", kind, "--head", str(head)]
    assert main([*common, *head, "--num-draft-tokens", "4", PROMPTS[1]]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert main([*common, "--no-draft", PROMPTS[1]]) == 0
    assert drafted["tokens"] == json.loads(capsys.readouterr().out)["tokens"]
    assert drafted["stats"]["drafted"] > 0


def bad_heads(root, llama: dict) -> dict:
    cfg = head_config(llama, [0, 2])
    no_ids = head_config(llama, [0, 2])
    del no_ids["dflash_config"]["mask_token_id"]
    cases = {
        "missing weights": (
            write_head(root / "missing", cfg, drop="layers.0.self_attn.k_norm.weight"),
            "weights do not fit its config",
        ),
        "layer past the depth": (
            write_head(root / "deep", head_config(llama, [0, 4])),
            "reads target layer 4, but the target has 4 layers",
        ),
        "block of one": (
            write_head(root / "one", head_config(llama, [0, 2], block_size=1)),
            "at least 2 tokens",
        ),
        "another model's width": (
            write_head(root / "wide", head_config({**llama, "hidden_size": 32}, [0, 2])),
            "hidden size is 32, the target's 64",
        ),
        "no mask token": (write_head(root / "nomask", cfg), "no dflash_config.mask_token_id"),
    }
    (root / "nomask" / "config.json").write_text(json.dumps(no_ids))
    return cases


def test_bad_heads_are_refused_in_one_line(tiny_models, heads, capsys):
    cases = bad_heads(heads["root"] / "bad", heads["llama_config"])
    target = str(tiny_models.target)
    for path, message in cases.values():
        with pytest.raises(SpecError, match=message):
            load_pair(target=target, drafter="dflash", head=str(path))
    path, message = cases["layer past the depth"]
    args = ["generate", "--target", target, "--drafter", "dflash", "--head", str(path), "x"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    with pytest.raises(SpecError, match="needs a head directory"):
        load_pair(target=target, drafter="dflash")
