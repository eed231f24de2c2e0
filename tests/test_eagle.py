"""EAGLE-3 heads (drafters/eagle.py): tiny random heads written in the published layouts
(EAGLE / SpecForge and speculators), loaded like any pair, lossless greedy and sampled; the
head reads exactly the target layers each format's convention names, checked against a
reference forward written here with plain mlx ops; its KV cache stays what a fresh forward
over the final sequence gives, through rejections and a recurrent target's replays."""

from __future__ import annotations

import json
import math
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny
from mlx_lm.models.rope_utils import Llama3RoPE, initialize_rope
from test_distribution import PROMPT, chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import SamplingParams, SpecError, generate, load_pair, make_decoder
from mlx_spec.cli import main
from mlx_spec.core.hidden import capturing
from mlx_spec.drafters.eagle import EagleDrafter, capture_layers

# ----------------------------------------------------------------------------- tiny heads


def head_weights(
    target_cfg: dict, draft_ids: list[int], seed: int, embed: bool, head_scale: float = 4.0
) -> dict:
    """Random weights of an EAGLE-3 head (EAGLE names) for a target; lm_head over
    `draft_ids`, d2t / t2d mapping them to the target's ids."""
    hidden = target_cfg["hidden_size"]
    heads, kv = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"]
    hd, inter, vocab = hidden // heads, target_cfg["intermediate_size"], target_cfg["vocab_size"]
    mx.random.seed(seed)

    def w(rows, cols, scale=1.0):
        return mx.random.normal((rows, cols)) * (scale / math.sqrt(cols))

    weights = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "midlayer.input_layernorm.weight": 1 + 0.1 * mx.random.normal((hidden,)),
        "midlayer.hidden_norm.weight": 1 + 0.1 * mx.random.normal((hidden,)),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * mx.random.normal((hidden,)),
        "norm.weight": 1 + 0.1 * mx.random.normal((hidden,)),
        "lm_head.weight": w(len(draft_ids), hidden, head_scale),
        "d2t": mx.array([t - i for i, t in enumerate(draft_ids)], mx.int64),
        "t2d": mx.array([t in set(draft_ids) for t in range(vocab)]),
    }
    if embed:
        weights["embed_tokens.weight"] = mx.random.normal((vocab, hidden))
    return weights


def write_head(path, target_cfg, weights, layout="eagle", ids=None, convention="sglang"):
    """A head directory: config.json and model.safetensors in the EAGLE / SpecForge layout
    (`midlayer.*`) or the speculators one (`layers.0.*`, transformer_layer_config)."""
    path.mkdir(parents=True, exist_ok=True)
    layer = {
        k: target_cfg[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "vocab_size",
        )
    }
    layer |= {"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}
    draft_vocab = weights["lm_head.weight"].shape[0]
    if layout == "eagle":
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"]}
        config["draft_vocab_size"] = draft_vocab
    else:
        config = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab,
            "norm_before_residual": False,
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "x"}},
        }
        weights = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
    if ids is not None and convention == "sglang":  # SpecForge: outputs of these layers
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    elif ids is not None:  # vLLM / speculators: inputs of these layers
        config["eagle_aux_hidden_state_layer_ids"] = ids
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def subset(vocab: int, size: int, seed: int) -> list[int]:
    return sorted(np.random.default_rng(seed).choice(vocab, size, replace=False).tolist())


# ----------------------------------------------------------------------------- reference


def rms(x, w, eps):
    x32 = x.astype(mx.float32)
    return x32 * mx.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps) * w


def ref_layer_outputs(target, cfg, tokens: list[int]) -> list[mx.array]:
    """Each decoder layer's output over `tokens`, by running the llama target's layers one
    by one (hidden.capturing plays no part): (len, H) each."""
    inner = target.model
    h = inner.embed_tokens(mx.array(tokens)[None])
    outs = []
    for layer in inner.layers:
        h = layer(h, "causal", None)
        outs.append(h[0])
    return outs


class RefHead:
    """EAGLE-3's forward from its published definition, in plain mlx ops, over the whole
    history at once (no cache): entry j = (features j, token j+1)."""

    def __init__(self, weights, cfg, embed):
        self.w = {k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}
        self.cfg, self.embed = cfg, embed
        self.eps = cfg["rms_norm_eps"]

    def layer(self, feats, tokens):
        """feats (n, H) (fused or the head's own), tokens (n,) -> (k, v per entry, out)."""
        w, cfg = self.w, self.cfg
        n, hidden = feats.shape
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = hidden // heads
        e = rms(self.embed[mx.array(tokens)], w["midlayer.input_layernorm.weight"], self.eps)
        x = mx.concatenate([e, rms(feats, w["midlayer.hidden_norm.weight"], self.eps)], -1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).reshape(n, heads, hd)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).reshape(n, kv, hd)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).reshape(n, kv, hd)
        theta = cfg["rope_theta"]
        q = mx.fast.rope(
            q.transpose(1, 0, 2), hd, traditional=False, base=theta, scale=1.0, offset=0
        )
        k = mx.fast.rope(
            k.transpose(1, 0, 2), hd, traditional=False, base=theta, scale=1.0, offset=0
        )
        v = v.transpose(1, 0, 2)
        rep = heads // kv
        kk, vv = mx.repeat(k, rep, axis=0), mx.repeat(v, rep, axis=0)
        scores = (q @ kk.transpose(0, 2, 1)) / math.sqrt(hd)
        causal = mx.tril(mx.ones((n, n))) > 0
        scores = mx.where(causal, scores, -mx.inf)
        attn = (mx.softmax(scores, axis=-1) @ vv).transpose(1, 0, 2).reshape(n, heads * hd)
        h = feats + attn @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms(h, w["midlayer.post_attention_layernorm.weight"], self.eps)
        gate = m @ w["midlayer.mlp.gate_proj.weight"].T
        up = m @ w["midlayer.mlp.up_proj.weight"].T
        out = h + (gate * mx.sigmoid(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        return k, v, out

    def fuse(self, layers: list[mx.array]) -> mx.array:
        return mx.concatenate(layers, -1) @ self.w["fc.weight"].T

    def draft_logits(self, g):
        draft = rms(g, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
        return draft

    def to_target(self, draft_id: int) -> int:
        return draft_id + int(self.w["d2t"][draft_id].item())

    def greedy_chain(self, fused, tokens, k):
        """Greedy proposal of k tokens after the sequence `tokens` (features for all but the
        last): the chain feeds the head its own output."""
        feats, toks = fused, list(tokens[1:])
        out = []
        for _ in range(k):
            _, _, g = self.layer(feats, toks)
            d = int(mx.argmax(self.draft_logits(g[-1])).item())
            out.append(self.to_target(d))
            feats = mx.concatenate([feats, g[-1:]])
            toks = toks + [out[-1]]
        return out


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target_cfg():
    return tiny.llama_config(320, layers=4)


@pytest.fixture(scope="module")
def heads(tiny_models, target_cfg, tmp_path_factory):
    """Head directories over the 4-layer tiny target, all reading the outputs of layers
    0, 1 and 3, named in each format's own convention."""
    root = tmp_path_factory.mktemp("eagle")
    draft_ids = subset(320, 96, seed=1)
    plain = head_weights(target_cfg, draft_ids, seed=5, embed=False)
    own = head_weights(target_cfg, draft_ids, seed=6, embed=True)
    return {
        "weights": plain,
        "own_weights": own,
        "sglang": write_head(root / "sglang", target_cfg, plain, ids=[0, 1, 3]),
        "vllm": write_head(root / "vllm", target_cfg, plain, ids=[1, 2, 4], convention="vllm"),
        "speculators": write_head(
            root / "spec", target_cfg, plain, "speculators", [1, 2, 4], "vllm"
        ),
        "own_embed": write_head(root / "own", target_cfg, own, ids=[0, 1, 3]),
        "default": write_head(root / "default", target_cfg, plain),
    }


@pytest.fixture(scope="module")
def eagle_pair(tiny_models, heads):
    return load_pair(target=str(tiny_models.target), drafter="eagle3", head=str(heads["sglang"]))


# ----------------------------------------------------------------------------- convention


def test_capture_layer_conventions():
    # SpecForge / SGLang name outputs; vLLM / speculators name inputs (output of id - 1)
    assert capture_layers(
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32
    ) == (1, 15, 28)
    assert capture_layers({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}, 32) == (1, 15, 28)
    # no ids: the inputs of 2, N/2, N-3 in every engine = SpecForge's default outputs
    assert capture_layers({}, 32) == (1, 32 // 2 - 1, 32 - 4)
    assert capture_layers({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, 4) == (0, 1, 3)
    with pytest.raises(SpecError, match="input of layer 0"):  # the embeddings: not a layer
        capture_layers({"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}, 4)
    with pytest.raises(SpecError, match="output of layer 4"):
        capture_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}}, 4)
    with pytest.raises(SpecError, match="three target layers"):
        capture_layers({"eagle_aux_hidden_state_layer_ids": [1, 2]}, 4)


@pytest.mark.parametrize("name", ["sglang", "vllm", "speculators", "own_embed", "default"])
def test_the_head_reads_the_layers_its_format_names(tiny_models, heads, target_cfg, name):
    """Prefill, then a greedy proposal: the head's cache and its guesses equal the
    reference forward fed the target layers the format's convention names."""
    pair = load_pair(target=str(tiny_models.target), drafter="eagle3", head=str(heads[name]))
    decoder = make_decoder(pair)
    drafter = decoder.drafter
    read = (1, 1, 0) if name == "default" else (0, 1, 3)  # inputs of 2, 2, 1 by default
    assert drafter.hidden_layers == read
    prompt = pair.tokenizer.encode(PROMPTS[0])
    decoder.prefill(prompt)
    weights = heads["own_weights" if name == "own_embed" else "weights"]
    embed = weights.get("embed_tokens.weight", pair.target.model.embed_tokens.weight)
    ref = RefHead(weights, target_cfg, embed)
    outs = ref_layer_outputs(pair.target, target_cfg, prompt[:-1])
    fused = ref.fuse([outs[i] for i in read])
    k_ref, v_ref, _ = ref.layer(fused, prompt[1:])
    cache = drafter.cache[0]
    keys = cache.keys[0, :, : cache.offset]
    np.testing.assert_allclose(np.array(keys), np.array(k_ref), atol=1e-4, rtol=1e-3)
    tokens, q = drafter.propose(3, SamplingParams(temperature=0.0), None)
    assert q is None and tokens.tolist() == ref.greedy_chain(fused, prompt, 3)
    # a head reading other layers would guess otherwise (the test can fail)
    wrong = ref.fuse([outs[i] for i in (1, 2, 3)])
    assert not np.allclose(np.array(ref.layer(wrong, prompt[1:])[0]), np.array(k_ref))


# ----------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_greedy_equals_target_alone(eagle_pair, k):
    drafted = 0
    for prompt in PROMPTS:
        res = generate(eagle_pair, prompt, max_tokens=30, num_draft_tokens=k)
        assert res.tokens == reference(eagle_pair, prompt, 30)
        drafted += res.stats.drafted
    if k != "auto":
        assert drafted > 0


def test_the_cli_runs_a_head_and_refuses_a_foreign_one(
    tiny_models, heads, target_cfg, tmp_path, capsys
):
    common = ["generate", "--target", str(tiny_models.target), "--max-tokens", "20", "--json"]
    head = ["--drafter", "eagle3", "--head", str(heads["speculators"])]
    assert main([*common, *head, "--num-draft-tokens", "3", "one two two"]) == 0
    speculative = json.loads(capsys.readouterr().out)
    assert main([*common, "--no-draft", "one two two"]) == 0
    assert speculative["tokens"] == json.loads(capsys.readouterr().out)["tokens"]
    assert speculative["stats"]["drafted"] > 0
    # a head made for a larger vocabulary: d2t points past the target's 320 tokens
    weights = head_weights(target_cfg, subset(320, 95, 2) + [400], seed=5, embed=False)
    foreign = write_head(tmp_path / "foreign", target_cfg, weights, ids=[0, 1, 3])
    assert main([*common, "--drafter", "eagle3", "--head", str(foreign), "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "outside the target's vocabulary of 320" in err and len(err.splitlines()) == 1
    with pytest.raises(SpecError, match="d2t maps draft tokens outside"):
        load_pair(target=str(tiny_models.target), drafter="eagle3", head=str(foreign))


DRAFTED = [0, 3, 4, 7, 12, 15]  # the small head's vocabulary (the target's likely tokens)


def test_sampled_drafts_keep_the_distribution(tiny_models, tmp_path):
    """Temperature 1, a 16-token target and a head drafting 6 of its tokens: q is the draft
    distribution scattered into the target's vocabulary (zero elsewhere)."""
    small = tiny.llama_config(16, layers=2, hidden=32)
    head = write_head(
        tmp_path / "small",
        small,
        head_weights(small, DRAFTED, 9, False, 0.3),
        ids=[0, 0, 1],
    )
    pair = load_pair(target=str(tiny_models.small_target), drafter="eagle3", head=str(head))
    params = SamplingParams(temperature=1.0)
    drafter = EagleDrafter(pair.head)
    drafter.prefill(PROMPT, output=None)  # no features: zeros, still a distribution
    tokens, q = drafter.propose(2, params, mx.random.key(0))
    assert q.shape == (2, 16)
    outside = [t for t in range(16) if t not in DRAFTED]
    assert float(q[:, outside].sum()) == 0 and np.allclose(np.array(q.sum(-1)), 1, atol=1e-5)
    counts = first_two(pair, params, 800, k=2, drafter=EagleDrafter(pair.head))
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold


# ----------------------------------------------------------------------------- the head's cache


def check_cache(decoder, pair, layers_of, target_cfg_or_none, weights, embed):
    """The head's cache holds an entry per position with the target's features, equal to
    the reference over the final sequence (nothing of rejected drafts left)."""
    drafter = decoder.drafter
    seq = decoder.sequence
    full = layers_of(seq[:-1])
    ref = RefHead(
        weights, pair.target_config if target_cfg_or_none is None else target_cfg_or_none, embed
    )
    fused = ref.fuse([full[i] for i in drafter.hidden_layers])
    drafter.catch_up()
    assert drafter.entries == len(seq) - 1 == drafter.cache[0].offset
    k_ref, _, _ = ref.layer(fused, seq[1:])
    keys = drafter.cache[0].keys[0, :, : drafter.entries]
    np.testing.assert_allclose(np.array(keys), np.array(k_ref), atol=2e-4, rtol=1e-3)


def check_sglang_cache(decoder, pair, heads, target_cfg):
    """`check_cache` for the tiny target's head in the SGLang convention (the fixtures')."""
    check_cache(
        decoder,
        pair,
        lambda toks: ref_layer_outputs(pair.target, target_cfg, toks),
        target_cfg,
        heads["weights"],
        pair.target.model.embed_tokens.weight,
    )


def test_the_cache_holds_the_sequence_after_rejections(eagle_pair, heads, target_cfg):
    decoder = make_decoder(eagle_pair)
    res = generate(eagle_pair, PROMPTS[1], max_tokens=40, num_draft_tokens=3, decoder=decoder)
    assert res.tokens == reference(eagle_pair, PROMPTS[1], 40)
    assert res.stats.drafted - res.stats.accepted > 10  # rejection-heavy: a random head

    def check():
        check_sglang_cache(decoder, eagle_pair, heads, target_cfg)

    check()
    # a follow-up turn reuses the cache: the head stays consistent
    follow = decoder.sequence + eagle_pair.tokenizer.encode(" and more")
    res = generate(eagle_pair, follow, max_tokens=12, num_draft_tokens=2, decoder=decoder)
    check()


def test_a_reply_without_drafts_leaves_the_cache_reusable(eagle_pair, heads, target_cfg):
    """A reply decoded plainly (use_draft=False: the chat's race) hands the head none of the
    target's features. The next drafting turn computes the target again only from where they
    stop, not from the start (the demo pair's follow-up after a race reused 0 of 58 tokens);
    its tokens are the target's and the head's cache is what a fresh forward gives."""
    decoder = make_decoder(eagle_pair)
    prompt = eagle_pair.tokenizer.encode(PROMPTS[1])
    first = generate(eagle_pair, prompt, max_tokens=12, num_draft_tokens=3, decoder=decoder)
    held = len(prompt) + len(first.tokens) - 1  # the target's cache after a drafting reply
    more = prompt + first.tokens + eagle_pair.tokenizer.encode(" and")
    plain = generate(eagle_pair, more, max_tokens=10, use_draft=False, decoder=decoder)
    assert plain.stats.prompt_tokens_reused >= held
    follow = more + plain.tokens + eagle_pair.tokenizer.encode(" then")
    res = generate(eagle_pair, follow, max_tokens=16, num_draft_tokens=3, decoder=decoder)
    assert res.stats.prompt_tokens_reused >= held  # from the gap on, not from nothing
    assert res.stats.prompt_tokens_reused < len(more)  # the plain stretch computed again
    assert res.tokens == reference(eagle_pair, follow, 16)
    check_sglang_cache(decoder, eagle_pair, heads, target_cfg)


def test_a_recurrent_target_replays_and_the_head_follows(tiny_models, tmp_path):
    """Qwen3.5 (Gated DeltaNet): a rejected round hands no rows (kept = 0) and the next pass
    replays its tokens; greedy output equals the target's and the head's cache ends equal
    to a fresh forward over the sequence."""
    cfg = tiny.family_configs(320)["qwen3_5"]
    target = tiny.write_model(
        tmp_path / "q35", cfg, tiny.family_weights(cfg, 0), tiny_models.tokenizer
    )
    head_cfg = {**cfg, "intermediate_size": 128, "rope_theta": 1e4}
    weights = head_weights(head_cfg, subset(320, 64, 3), seed=4, embed=True)
    head = write_head(tmp_path / "head", head_cfg, weights, ids=[0, 1, 3])
    pair = load_pair(target=str(target), drafter="eagle3", head=str(head))
    decoder = make_decoder(pair)
    assert decoder.recurrent
    res = generate(pair, PROMPTS[2], max_tokens=30, num_draft_tokens=3, decoder=decoder)
    assert res.tokens == reference(pair, PROMPTS[2], 30)
    assert res.stats.drafted > res.stats.accepted  # rejections, so replays

    def layers_of(tokens):
        with capturing(pair.target, (0, 1, 2, 3)) as got:
            pair.target(mx.array(tokens)[None])
        return [got[i][0] for i in range(4)]

    check_cache(decoder, pair, layers_of, head_cfg, weights, weights["embed_tokens.weight"])


def test_a_grammar_masks_the_heads_guesses(eagle_pair, tiny_models):
    """Processors see the head's logits in the target's vocabulary: under a regex the
    output equals the target's constrained output and every accepted guess is allowed."""
    import re

    plain = load_pair(target=str(tiny_models.target))
    regex = r"[a-z ]{4,30}\."
    for temperature in (0.0, 1.0):
        kwargs = dict(max_tokens=30, regex=regex, temperature=temperature, seed=3)
        res = generate(eagle_pair, PROMPTS[0], num_draft_tokens=3, **kwargs)
        assert re.fullmatch(regex, res.text) or re.fullmatch(r"[a-z ]*", res.text)
        if temperature == 0.0:
            assert res.tokens == generate(plain, PROMPTS[0], **kwargs).tokens
        assert res.stats.drafted > res.stats.forced_drafted  # the head proposed


# ----------------------------------------------------------------------------- config variants


def test_rope_settings_are_read_as_specforge_reads_them(tiny_models, heads, target_cfg, tmp_path):
    """SpecForge's get_rope_config: transformers 5's rope_parameters (base and scaling in one
    block) first, else rope_theta / rope_scaling; a Llama 3.1 scaling block is applied
    (SpecForge's llama3 rotary embedding; mlx-vlm 0.7.10 builds a plain nn.RoPE and ignores
    it). A rope_parameters-only config read base 10000 and no scaling before."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    target = str(tiny_models.target)
    for name, fields in {
        "rope_scaling": {"rope_theta": 500000.0, "rope_scaling": llama3},
        "rope_parameters": {"rope_parameters": {"rope_theta": 500000.0, **llama3}},
    }.items():
        path = tmp_path / name
        shutil.copytree(heads["sglang"], path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("rope_theta")
        (path / "config.json").write_text(json.dumps(cfg | fields))
        pair = load_pair(target=target, drafter="eagle3", head=str(path))
        rope = pair.head.midlayer.self_attn.rope
        assert isinstance(rope, Llama3RoPE), name
        want = initialize_rope(16, 500000.0, False, llama3, 512)
        x = mx.random.normal((1, 4, 5, 16))
        assert mx.allclose(rope(x, offset=3), want(x, offset=3)), name
        res = generate(pair, PROMPTS[0], max_tokens=20, num_draft_tokens=3)
        assert res.tokens == reference(pair, PROMPTS[0], 20)
    plain = tmp_path / "rope_parameters_default"
    shutil.copytree(heads["sglang"], plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": 2000.0, "rope_type": "default"}
    (plain / "config.json").write_text(json.dumps(cfg))
    rope = load_pair(target=target, drafter="eagle3", head=str(plain)).head.midlayer.self_attn.rope
    assert isinstance(rope, nn.RoPE) and rope.base == 2000.0


def test_other_eagle_heads_are_refused_naming_the_variant(tiny_models, heads, target_cfg, tmp_path):
    """An EAGLE-1 / EAGLE-2 head (layers.0.*, fc over [embedding; features], no midlayer;
    said 'lacks lm_head.weight' before), a speculators EAGLE-1 head, a Qwen3-style layer."""
    target = str(tiny_models.target)
    hidden = target_cfg["hidden_size"]
    weights = {
        k.replace("midlayer.", "layers.0."): v
        for k, v in heads["weights"].items()
        if k not in ("lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight")
    }
    weights["fc.weight"] = mx.zeros((hidden, 2 * hidden))
    v1 = tmp_path / "eagle2"
    v1.mkdir()
    mx.save_safetensors(str(v1 / "model.safetensors"), weights)
    cfg = json.loads((heads["sglang"] / "config.json").read_text())
    (v1 / "config.json").write_text(json.dumps(cfg | {"architectures": ["LlamaForCausalLM"]}))
    spec1 = tmp_path / "spec_eagle"
    shutil.copytree(heads["speculators"], spec1)
    scfg = json.loads((spec1 / "config.json").read_text())
    (spec1 / "config.json").write_text(json.dumps(scfg | {"speculators_model_type": "eagle"}))
    for path, message in [
        (v1, "is an EAGLE-1 / EAGLE-2 head"),
        (spec1, "is a speculators 'eagle' model, not eagle3"),
    ]:
        with pytest.raises(SpecError, match=message):
            load_pair(target=target, drafter="eagle3", head=str(path))


def test_a_tied_speculators_head_projects_with_the_embedding(tiny_models, heads, tmp_path):
    """speculators' tie_word_embeddings with no lm_head and the full vocabulary (mlx-vlm:
    embed_tokens.as_linear): the head's own embedding when it ships one, else the target's;
    refused before ('lacks lm_head.weight')."""
    target = str(tiny_models.target)
    for name, source in (("own", "own_weights"), ("target's", "weights")):
        weights = {
            k.replace("midlayer.", "layers.0."): v
            for k, v in heads[source].items()
            if k not in ("lm_head.weight", "d2t", "t2d")
        }
        path = tmp_path / name
        path.mkdir()
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        cfg = json.loads((heads["speculators"] / "config.json").read_text())
        cfg["transformer_layer_config"]["tie_word_embeddings"] = True
        cfg["draft_vocab_size"] = 320
        (path / "config.json").write_text(json.dumps(cfg))
        pair = load_pair(target=target, drafter="eagle3", head=str(path))
        embed = weights.get("embed_tokens.weight", pair.target.model.embed_tokens.weight)
        g = mx.random.normal((64,))
        want = pair.head.norm(g) @ embed.astype(mx.float32).T
        assert mx.allclose(pair.head.logits(g), want, atol=1e-4), name
        res = generate(pair, PROMPTS[1], max_tokens=20, num_draft_tokens=3)
        assert res.tokens == reference(pair, PROMPTS[1], 20)
