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
import re

import mlx.core as mx
import numpy as np
import pytest
import tiny
from mlx.utils import tree_flatten
from test_dflash import assert_processors_and_a_grammar_stay_lossless, assert_the_cli_drafts, oracle
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
        # as HF's Gemma4AssistantConfig requires them
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
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
    return tiny.write_head(path, config, weights, drop)


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
        root / "ordered_head",
        head_config(text_of(dense), ordered=True),
        target_embedding(dense),
        layer_scale=1,
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


def test_greedy_with_a_centroid_head(models):
    """E2B / E4B's ordered embeddings: the guesses come from the top clusters' tokens."""
    head = str(models["ordered_head"])
    pair = load_pair(target=str(models["dense"]), drafter="assistant", head=head)
    assert_greedy_equals_the_target_alone(pair, 3)


def test_drafting_happens_at_a_fixed_k(dense_pair):
    """k tokens a round, k draft steps, q (k, vocab) when sampling; nothing before a prefill."""
    drafter = AssistantDrafter(dense_pair.head, dense_pair.target, dense_pair.vocab_size)
    assert drafter.max_draft is None and drafter.hidden_layers[0] == "norm"
    assert drafter.propose(3, SamplingParams(), None)[0].shape == (0,)
    decoder = Decoder(dense_pair.target, drafter, ())
    decoder.prefill(dense_pair.tokenizer.encode(PROMPTS[0]))
    tokens, q = drafter.propose(5, SamplingParams(), None)
    assert tokens.shape == (5,) and q is None and drafter.steps == 5
    some, _ = drafter.propose(2, SamplingParams(), None)
    assert some.tolist() == tokens.tolist()[:2]  # a chain: a shorter proposal is a prefix
    tokens, q = drafter.propose(3, SamplingParams(temperature=1.0), mx.random.key(0))
    assert q.shape == (3, 320) and np.allclose(np.array(q.sum(-1)), 1, atol=1e-5)


# ---------------------------------------------------------------- the reference forward
# Written from mlx-vlm's gemma4_assistant.py (`_forward_hidden`, `draft_block`) and its
# _mtp_rounds, HF's Gemma 4 layer (norms around attention and MLP, GELU-tanh gating, the
# layer scalar), in plain MLX ops over the checkpoint's tensors: nothing of mlx_spec's head,
# nor mlx-lm's layers, is called for the drafter. (The target's keys, values and final hidden
# state come from mlx-lm's target with plain, never-trimmed caches: they are the target's.)


def rms(x, w, eps=1e-6):
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1 + mx.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))


def rope(x, position: int, base: float, rotated: int):
    """(heads, d) rotated at `position`, NeoX halves (j, j + d/2); only the first rotated/2
    pairs turn (proportional partial rotary: the other frequencies are zero)."""
    d = x.shape[-1]
    j = mx.arange(0, d // 2, dtype=mx.float32)
    inv = mx.where(j < rotated // 2, base ** (-2 * j / d), 0.0)
    angle = position * inv
    cos, sin = mx.cos(angle), mx.sin(angle)
    x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    return mx.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


def target_state(pair, tokens: list[int]):
    """Over tokens[:-1]: the final norm's row at the last position, and every layer's keys
    and values (kv heads, positions, d) from plain KVCaches (nothing dropped)."""
    from mlx_lm.models.cache import KVCache

    inner = pair.target.language_model.model
    n_own = inner.config.num_hidden_layers - inner.config.num_kv_shared_layers
    cache = [KVCache() for _ in range(n_own)]
    normed = inner(mx.array([tokens[:-1]]), cache=cache)
    return normed[0, -1], [(c.keys[0, :, : c.offset], c.values[0, :, : c.offset]) for c in cache]


def reference_logits(w, cfg, embed_t, state, kvs, tokens, window):
    """The drafter's logits at each step fed tokens[0] (the bonus) then tokens[1:] (the
    guesses), queries at the bonus's position P (Hugging Face's candidate generator's
    `position_ids`), the keys of positions < P a target layer of the type sees from P:
    (len(tokens), vocab)."""
    text = cfg["text_config"]
    at = kvs[0][0].shape[1]  # positions the target holds
    heads = text["num_attention_heads"]
    # the target's last layer of each type with keys of its own: 3 (sliding), 2 (full)
    source = {"sliding_attention": kvs[3], "full_attention": kvs[2]}
    out = []
    for tok in tokens:
        e = embed_t[tok] * embed_t.shape[1] ** 0.5
        h = mx.concatenate([e, state]) @ w["pre_projection.weight"].T
        for i, kind in enumerate(text["layer_types"]):
            p = f"model.layers.{i}."
            full = kind == "full_attention"
            d = text["global_head_dim"] if full else text["head_dim"]
            keys, values = source[kind]
            if not full:  # the last window - 1 positions
                keys, values = (
                    keys[:, max(0, at - (window - 1)) :],
                    values[:, max(0, at - (window - 1)) :],
                )
            rp = text["rope_parameters"][kind]
            rotated = int(d * rp.get("partial_rotary_factor", 1.0))
            a = rms(h, w[p + "input_layernorm.weight"])
            q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(heads, d)
            q = rope(rms(q, w[p + "self_attn.q_norm.weight"]), at, rp["rope_theta"], rotated)
            rep = heads // keys.shape[0]
            k, v = mx.repeat(keys, rep, axis=0), mx.repeat(values, rep, axis=0)
            att = mx.softmax((q[:, None, :] @ k.transpose(0, 2, 1))[:, 0], axis=-1)  # scale 1
            o = (att[:, None, :] @ v)[:, 0].reshape(-1) @ w[p + "self_attn.o_proj.weight"].T
            h = h + rms(o, w[p + "post_attention_layernorm.weight"])
            m = rms(h, w[p + "pre_feedforward_layernorm.weight"])
            g, u = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            m = (gelu_tanh(g) * u) @ w[p + "mlp.down_proj.weight"].T
            h = (h + rms(m, w[p + "post_feedforward_layernorm.weight"])) * w[p + "layer_scalar"]
        hn = rms(h, w["model.norm.weight"])
        logits = hn @ w["model.embed_tokens.weight"].T  # tied, no soft-cap
        if cfg["use_ordered_embeddings"]:  # HF's Gemma4AssistantMaskedEmbedder
            top = np.argsort(np.array(hn @ w["masked_embedding.centroids.weight"].T))
            top = top[-cfg["centroid_intermediate_top_k"] :]
            ordering = np.array(w["masked_embedding.token_ordering"])
            ids = ordering.reshape(cfg["num_centroids"], -1)[top].ravel()
            kept = np.array(logits)[ids]
            full = np.full(logits.shape, kept.min() - 1, np.float32)
            full[ids] = kept
            logits = mx.array(full)
        out.append(logits)
        state = hn @ w["post_projection.weight"].T
    return mx.stack(out)


@pytest.mark.parametrize("name", ["random_head", "ordered_head"])
def test_drafts_equal_a_reference_forward(models, name):
    """Past the window (a 40-token sequence, window 8): greedy guesses equal the reference's
    chain, and each sampled position's q equals the reference's softmax given the guesses
    drawn before it. Largest difference in q measured here: 7.5e-8 (float32). The ordered
    head (E2B / E4B's centroids): its q is the softmax of the masked logits it drew from."""
    pair = load_pair(target=str(models["dense"]), drafter="assistant", head=str(models[name]))
    cfg = json.loads((models[name] / "config.json").read_text())
    w = mx.load(str(models[name] / "model.safetensors"))
    embed_t = pair.target.language_model.model.embed_tokens.weight
    prompt = pair.tokenizer.encode(PROMPTS[0])
    seq = prompt + reference(pair, PROMPTS[0], 30)
    assert len(seq) > 3 * tiny.WINDOW
    drafter = AssistantDrafter(pair.head, pair.target, pair.vocab_size)
    Decoder(pair.target, drafter, ()).prefill(seq)
    state, kvs = target_state(pair, seq)
    k = 4

    greedy, _ = drafter.propose(k, SamplingParams(), None)
    chain = [seq[-1]]
    for _ in range(k):
        row = reference_logits(w, cfg, embed_t, state, kvs, chain, tiny.WINDOW)[-1]
        chain.append(int(mx.argmax(row).item()))
    assert greedy.tolist() == chain[1:]

    tokens, q = drafter.propose(k, SamplingParams(temperature=1.0), mx.random.key(3))
    drawn = [seq[-1], *tokens.tolist()[:-1]]
    want = mx.softmax(reference_logits(w, cfg, embed_t, state, kvs, drawn, tiny.WINDOW), -1)
    diff = float(mx.abs(q - want).max())
    print(f"max |q - reference q| = {diff:.2e}")
    assert diff < 1e-5
    # the keys matter: the full layer's last position taken away moves q
    short = [(kk[:, :-1], vv[:, :-1]) for kk, vv in kvs]
    moved = mx.softmax(reference_logits(w, cfg, embed_t, state, short, drawn, tiny.WINDOW), -1)
    assert float(mx.abs(moved - want).max()) > 1e-3


def assert_state_matches_a_fresh_prefill(pair, prompt: str, tokens: int = 40):
    """After rounds that accept all, part and none of their guesses, past the window: the
    drafter's state row and the keys and values it attends to are a fresh prefill's, and so
    are its next guesses."""
    start = pair.tokenizer.encode(prompt)
    truth = start + reference(pair, prompt, tokens)
    drafter = oracle(AssistantDrafter)(pair.head, pair.target, truth)
    decoder = Decoder(pair.target, drafter, ())
    decoder.prefill(start)
    rounds = list(decoder.rounds(tokens, SamplingParams(), 4))
    assert decoder.sequence == truth[: len(decoder.sequence)]
    accepted = [r.accepted for r in rounds if r.drafted]
    assert 0 in accepted and 4 in accepted and set(accepted) - {0, 4}  # none, part, all
    drafter.settle()
    # it holds the target's layers themselves, not views of their buffers (a held view
    # would make every pass's write into them copy the whole buffer)
    assert {i: kv for i, kv in drafter.kv.items()} == {
        i: (decoder.cache[i],) for i in set(pair.head.reads.values())
    }
    fresh = AssistantDrafter(pair.head, pair.target)
    Decoder(pair.target, fresh, ()).prefill(decoder.sequence)
    at = len(decoder.sequence) - 1
    assert drafter.target_at == fresh.target_at == at > 2 * tiny.WINDOW
    # float32 computed through other shapes (rounds vs one prefill): 1.5e-5 apart with
    # OpenBLAS (2026-12-05); a state out of step would be O(1) apart
    np.testing.assert_allclose(np.array(drafter.state), np.array(fresh.state), atol=1e-4)
    mine, theirs = drafter._shared(at), fresh._shared(at)
    assert mine.keys() == theirs.keys() == {"sliding_attention", "full_attention"}
    assert mine["sliding_attention"][0].shape[2] == tiny.WINDOW - 1
    assert mine["full_attention"][0].shape[2] == at
    for kind in mine:
        for a, b in zip(mine[kind], theirs[kind], strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    params = SamplingParams()
    guesses = AssistantDrafter.propose(drafter, 4, params, None)[0]
    assert guesses.tolist() == fresh.propose(4, params, None)[0].tolist()


def test_the_state_matches_a_fresh_prefill_after_mixed_rounds(dense_pair):
    assert_state_matches_a_fresh_prefill(dense_pair, PROMPTS[0])


def test_the_state_matches_after_plain_stretches_and_a_follow_up(dense_pair):
    """`auto` decodes plainly at times (the drafter fed one pass at a time, pipelined); a
    second turn that extends the first reuses the target's cache (no rows of the reused
    part): still the target's tokens."""
    pair = dense_pair
    decoder = Decoder(pair.target, AssistantDrafter(pair.head, pair.target), ())
    first = pair.tokenizer.encode(PROMPTS[2])
    decoder.prefill(first)
    list(decoder.rounds(6, SamplingParams(), 0))  # plain steps, each committed
    list(decoder.rounds(10, SamplingParams(), 3))
    follow = decoder.sequence + pair.tokenizer.encode(" and", add_special_tokens=False)
    assert decoder.prefill(follow) > len(first)
    got = [t for r in decoder.rounds(20, SamplingParams(), 3) for t in r.tokens]
    plain = Decoder(pair.target, None, ())
    plain.prefill(follow)
    assert got == [t for r in plain.rounds(20, SamplingParams(), 1) for t in r.tokens]


class SoftenedQ(AssistantDrafter):
    """Wrong: hands the verifier a flatter q than the one its guesses were drawn from."""

    def propose(self, k, params, key, *, processors=()):
        tokens, q = super().propose(k, params, key, processors=processors)
        if q is not None:
            q = mx.sqrt(q)
            q = q / q.sum(-1, keepdims=True)
        return tokens, q


@pytest.mark.parametrize("ordered", [False, True])
def test_sampling_keeps_the_target_distribution(tiny_models, tmp_path, ordered):
    """Temperature 1 on a 16-token vocabulary, past the window (a 12-token prompt): the first
    two tokens' joint frequencies match the target's exact joint distribution (a chi-square
    test at 99.9 %). The target repeats itself often (post-norm scale 0.7), so the second
    token is often a kept guess (17 of 48 guesses kept in a seeded 60-token reply); a drafter
    handing over a q other than the one it drew from fails the same test (measured: 161
    against a threshold of 36; the real one 23). The ordered (centroid) head too: 4 clusters
    of 4 tokens, the best 2 scored, the others at the floor."""
    target = tiny.write_gemma4(tmp_path / "small", tiny_models.tokenizer, 16, scale=0.7)
    top = {"num_centroids": 4, "centroid_intermediate_top_k": 2} if ordered else {}
    cfg = head_config(text_of(target), ordered=ordered, **top)
    head = write_head(tmp_path / "head", cfg, target_embedding(target))
    pair = load_pair(target=str(target), drafter="assistant", head=str(head))
    params = SamplingParams(temperature=1.0)
    prompt = [5, 9, 3, 12, 7, 1, 4, 8, 10, 11, 6, 13]
    exact = exact_joint(pair, params, prompt)
    stats = {}
    for drafter_type in (AssistantDrafter,) if ordered else (AssistantDrafter, SoftenedQ):
        drafted = []
        drafter = drafter_type(pair.head, pair.target)
        counts = first_two(
            pair, params, 600, k=3, drafter=drafter, prompt=prompt, drafted=drafted, max_tokens=4
        )
        assert max(drafted) == 3
        stats[drafter_type] = chi_square(counts, exact)
    stat, threshold = stats[AssistantDrafter]
    assert stat < threshold, (stat, threshold)
    if ordered:
        return
    stat, threshold = stats[SoftenedQ]
    assert stat > threshold, (stat, threshold)  # the test has the power to see a wrong q


def test_processors_and_a_grammar_stay_lossless(dense_pair):
    """Penalties see each step's earlier guesses; a grammar masks each step after them."""
    assert_processors_and_a_grammar_stay_lossless(dense_pair)


def test_the_cli_drafts_with_the_head(models, capsys):
    assert_the_cli_drafts(models["dense"], "assistant", models["dense_head"], capsys)


def bad_heads(root, models) -> dict:
    text = text_of(models["dense"])
    embed = target_embedding(models["dense"])
    cfg = head_config(text)
    narrow = head_config({**text, "hidden_size": 32})
    cases = {
        "missing weights": (
            write_head(root / "missing", cfg, embed, drop="model.layers.1.self_attn.q_proj.weight"),
            "head's weights do not fit its config",
        ),
        "another backbone": (
            write_head(root / "narrow", narrow, embed[:, :32]),
            "backbone_hidden_size is 32, the target's hidden size 64",
        ),
        "another head size": (
            write_head(root / "heads", head_config({**text, "global_head_dim": 16}), embed),
            "full_attention layers (4 heads of 16) cannot attend to the target's (1 key/value "
            "heads of 32)",
        ),
        "another vocabulary": (
            write_head(root / "vocab", cfg, embed),
            "vocabulary is 400 tokens, the target's 320",
        ),
        "not an assistant": (write_head(root / "type", cfg, embed), "not 'gemma4_assistant'"),
        "no text_config": (write_head(root / "notext", cfg, embed), "has no text_config"),
        "a layer type of its own": (
            write_head(root / "types", cfg, embed),
            "text_config.layer_types must name 2 layers",
        ),
        "no weights": (write_head(root / "empty", cfg, embed), "has no .safetensors weights"),
        "layers of their own keys": (
            write_head(root / "unshared", cfg, embed),
            "text_config.num_kv_shared_layers is 1: an assistant's layers share every key",
        ),
        "a MoE layer": (write_head(root / "moe", cfg, embed), "text_config.enable_moe_block"),
    }
    edits = {
        "vocab": lambda c: c["text_config"].update(vocab_size=400),
        "type": lambda c: c.update(model_type="gemma4_text"),
        "notext": lambda c: c.pop("text_config"),
        "types": lambda c: c["text_config"].update(layer_types=["chunked_attention"] * 2),
        "unshared": lambda c: c["text_config"].update(num_kv_shared_layers=1),
        "moe": lambda c: c["text_config"].update(enable_moe_block=True),
    }
    for name, edit in edits.items():
        changed = json.loads(json.dumps(cfg))
        edit(changed)
        (root / name / "config.json").write_text(json.dumps(changed))
    (root / "empty" / "model.safetensors").unlink()
    return cases


def test_bad_heads_are_refused_in_one_line(tiny_models, models, capsys):
    cases = bad_heads(models["root"] / "bad", models)
    target = str(models["dense"])
    for label, (path, message) in cases.items():
        with pytest.raises(SpecError, match=re.escape(message)):
            load_pair(target=target, drafter="assistant", head=str(path))
        args = ["generate", "--target", target, "--drafter", "assistant", "--head", str(path)]
        assert main([*args, "x"]) == 2, label
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err and "Traceback" not in err, label
    with pytest.raises(SpecError, match="needs a head directory"):
        load_pair(target=target, drafter="assistant")
    # a non-Gemma-4 target (the tiny Llama)
    llama = str(tiny_models.target)
    args = ["generate", "--target", llama, "--drafter", "assistant"]
    assert main([*args, "--head", str(models["dense_head"]), "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "drafts for a Gemma 4 target (gemma4, gemma4_text), not llama" in err
    assert "\n" not in err


def test_the_server_batches_with_the_head(dense_pair):
    """The server's resident pair batches with the assistant drafting (tests/
    test_batch_gemma4_assistant.py: rows as alone); a lone request drafts as a single stream."""
    from mlx_spec.decode.batch_assistant import AssistantBatch
    from mlx_spec.server.resident import Resident

    resident = Resident(lambda name: None, [], max_batch=4)
    resident.install(dense_pair, "gemma4")
    assert resident.batch is not None and not resident.batch_plain and resident.lone_alone
    assert isinstance(resident.batch.heads, AssistantBatch) and resident.batch.drafting


def quantized_head(source, path):
    """The head at `source` converted as mlx-lm converts a model: 4-bit (group 32) weights,
    the config's `quantization` saying so."""
    import mlx.nn as nn

    cfg = json.loads((source / "config.json").read_text())
    head = AssistantHead(AssistantArgs(cfg))
    head.load_weights(
        list(AssistantHead.sanitize(mx.load(str(source / "model.safetensors"))).items())
    )
    nn.quantize(head, group_size=32, bits=4)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(head.parameters())))
    cfg["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("case", ["bfloat16", "4-bit target", "4-bit head"])
def test_as_published_dtypes(models, case):
    """The published heads are bfloat16 and the curated targets 4-bit conversions: a bfloat16
    target and head, a 4-bit target (quantized here, group 32) with the float head, or a
    4-bit conversion of the head — the dense head and the centroid one, greedy at k 3,
    single stream and batch."""
    import mlx.nn as nn

    from mlx_spec import batch_generate

    for head in ("dense_head", "ordered_head"):
        path = models[head]
        if case == "4-bit head":
            path = quantized_head(path, models["root"] / f"{head}-4bit")
        pair = load_pair(target=str(models["dense"]), drafter="assistant", head=str(path))
        if case == "4-bit head":
            assert isinstance(pair.head.model.embed_tokens, nn.QuantizedEmbedding)
        elif case == "bfloat16":
            pair.target.set_dtype(mx.bfloat16)
            pair.head.set_dtype(mx.bfloat16)
        elif case == "4-bit target":
            nn.quantize(pair.target, group_size=32, bits=4)
        drafted = 0
        for prompt in PROMPTS:
            res = generate(pair, prompt, max_tokens=24, num_draft_tokens=3)
            assert res.tokens == reference(pair, prompt, 24), (case, head)
            drafted += res.stats.drafted
        assert drafted > 0
        rows = batch_generate(pair, PROMPTS, max_tokens=24, num_draft_tokens=3)
        for prompt, row in zip(PROMPTS, rows, strict=True):
            assert row.tokens == reference(pair, prompt, 24), (case, head, "batch")


def test_the_target_cache_is_written_in_place(dense_pair):
    """The drafter holds the target layers it reads, never a view of their buffers across a
    pass (a held view makes MLX copy the whole buffer at the next write: 22 ms against
    0.03 ms for a 64 MB layer on this machine). Plain steps (pipelined) and drafting rounds
    within one allocation step: each layer's buffer stays at one address."""
    pair = dense_pair
    decoder = Decoder(pair.target, AssistantDrafter(pair.head, pair.target), ())
    decoder.prefill(pair.tokenizer.encode(PROMPTS[0]))

    def address(a) -> int:
        return np.asarray(memoryview(a)).__array_interface__["data"][0]

    seen = {i: set() for i in set(pair.head.reads.values())}
    for k in (0, 2, 4):
        for _ in decoder.rounds(8, SamplingParams(), k):
            for i in seen:
                seen[i].add(address(decoder.cache[i].keys))
    assert all(len(s) == 1 for s in seen.values()), seen
