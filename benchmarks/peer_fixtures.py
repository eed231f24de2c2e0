"""Regenerate tests/fixtures/peers: tiny drafting heads written in each peer's own layout, with
the first-round proposals the peer itself computes from them (tests/test_peer_heads.py checks
mlx-spec against those).

Needs the peers (`pip install -e .[peers]`, or `pip install --no-deps --target DIR` the pins
of the `peers` extra and DIR on PYTHONPATH); the tests need nothing of them. Each fixture is a
head directory (config.json as the peer reads it, model.safetensors in float16 under the
peer's weight names) and `expected.json`: the peer, its version, the prompt (token ids), the
proposals the peer drafts from the target's features of the prompt (greedy, one block), and
the tiny target's own greedy continuation (so a drifted target builder fails loudly, not as a
head mismatch).

The target: `peer_target_config()` with `tiny.random_weights(config, seed=TARGET_SEED)`, rebuilt
the same way by the tests.

    PYTHONPATH=.:tests:/tmp/peers python benchmarks/peer_fixtures.py [--out tests/fixtures/peers]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import tiny  # noqa: E402

TARGET_SEED = 11
VOCAB = 320
PROMPT = [1, 40, 77, 203, 9, 150, 61, 300, 18, 95, 240, 33]
GREEDY = 24  # tokens of the target's own continuation kept as its fingerprint


def peer_target_config() -> dict:
    """The tiny llama every fixture drafts for (hidden 32: heads of a few tens of KB)."""
    return {**tiny.llama_config(VOCAB, layers=6, hidden=32), "max_position_embeddings": 256}


def build_target():
    from mlx_lm.models import llama

    cfg = peer_target_config()
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.load_weights(list(tiny.random_weights(cfg, seed=TARGET_SEED).items()))
    mx.eval(model.parameters())
    return model, cfg


def layer_outputs(model, tokens: list[int]) -> list[mx.array]:
    """Every layer's output (rows, hidden) over `tokens`, mlx-lm's llama layers one by one."""
    h, outs = model.model.embed_tokens(mx.array([tokens])), []
    for layer in model.model.layers:
        h = layer(h, "causal")
        outs.append(h[0])
    return outs


def target_greedy(model, tokens: list[int], n: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits[0, -1]).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)
    return out


def half(weights: dict) -> dict:
    """float16 for the file (integer tables kept as they are)."""
    return {
        k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }


def scaled(model: nn.Module, seed: int, scale: float = 1.0) -> dict:
    """Random weights of `model` (its own init, seeded), norms kept at one, projections scaled
    by `scale` so that guesses are peaked (no near ties between implementations)."""
    mx.random.seed(seed)
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if "norm" in k:
            out[k] = mx.ones_like(v)
        elif mx.issubdtype(v.dtype, mx.floating):
            out[k] = mx.random.normal(v.shape) * (scale / max(v.shape[-1], 1) ** 0.5)
        else:
            out[k] = v
    return out


def write(out: Path, name: str, config: dict, weights: dict, expected: dict) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "model.safetensors"), half(weights))
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (d / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{name}: {size / 1024:.0f} KB, proposals {expected['proposals']}")


def expected(peer: str, proposals, model, **extra) -> dict:
    return {
        "peer": peer,
        "version": importlib.metadata.version(peer),
        "prompt": PROMPT,
        "proposals": [int(t) for t in proposals],
        "target_seed": TARGET_SEED,
        "target_greedy": target_greedy(model, PROMPT, GREEDY),
        **extra,
    }


def argmax(x):
    return mx.argmax(x, axis=-1)


# ----------------------------------------------------------------------------- DFlash / DSpark


def dflash_block_config(tcfg: dict, ids: list[int], block: int, extra: dict) -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "block_size": block,
        "num_target_layers": tcfg["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": 5},
        **extra,
    }


def mlx_vlm_block(out: Path, model, tcfg, name: str, config: dict, dspark: bool, seed: int):
    """A DFlash / DSpark head as mlx-vlm 0.7.10 reads it, its first block from mlx-vlm's own
    draft_block over the target's features of the prompt."""
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

    if dspark:
        from mlx_vlm.speculative.drafters.dspark.config import DSparkConfig as Config
        from mlx_vlm.speculative.drafters.dspark.dspark import DSparkDraftModel as Model
    else:
        from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig as Config

        Model = DFlashDraftModel
    head = Model(Config.from_dict(json.loads(json.dumps(config))))
    weights = scaled(head, seed, scale=3.0)
    if dspark:
        weights["markov_head.markov_w2.weight"] *= 2.0
    d = out / name
    write(out, name, config, weights, {"proposals": []})
    w16 = head.sanitize(mx.load(str(d / "model.safetensors")))
    head.load_weights(list(w16.items()), strict=True)
    # (mlx-vlm's DSpark bind first checks the target's rollback hooks, which a bare mlx-lm
    # llama lacks; the binding itself is DFlash's)
    DFlashDraftModel.bind(head, model)
    ids = head.config.target_layer_ids
    outs = layer_outputs(model, PROMPT)
    hidden = mx.concatenate([outs[i] for i in ids], axis=-1)[None, :-1]
    width = head.config.block_size
    drafted = head.draft_block(PROMPT[-1], hidden, head.make_cache(), width, argmax)
    proposals = drafted.reshape(-1).tolist()
    (d / "expected.json").write_text(
        json.dumps(expected("mlx-vlm", proposals, model, block_size=width), indent=1) + "\n"
    )
    print(f"  {name}: mlx-vlm proposals {proposals}")


def mlx_dspark_head(out: Path, model, tcfg, name: str, config: dict, seed: int, draft_vocab=None):
    """A DSpark head as mlx-dspark 0.20.3 loads it (its load_drafter, unquantized), the first
    block from its own draft loop's calls (embed, backbone, head_slice, sample_block)."""
    from mlx_dspark.config import DSparkConfig
    from mlx_dspark.load import load_drafter
    from mlx_dspark.model import DSparkDrafter

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    pcfg = DSparkConfig.from_json(d / "config.json")
    pcfg.has_own_embed = pcfg.has_own_lm_head = True
    head = DSparkDrafter(pcfg)
    weights = scaled(head, seed, scale=3.0)
    weights["markov_head.markov_w2.weight"] *= 2.0
    weights["confidence_head.proj.weight"] = mx.zeros_like(weights["confidence_head.proj.weight"])
    # the head's own embedding and output head are the target's (rows of it, reduced)
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight
    if draft_vocab is not None:
        d2t = mx.array([t - i for i, t in enumerate(draft_vocab)], mx.int64)
        weights["d2t"] = d2t
        t2d = mx.zeros((VOCAB,), mx.bool_)
        t2d[mx.array(draft_vocab)] = True
        weights["t2d"] = t2d
        weights["lm_head.weight"] = model.lm_head.weight[mx.array(draft_vocab)]
    else:
        weights["lm_head.weight"] = model.lm_head.weight
    write(out, name, config, weights, {"proposals": []})
    drafter, pcfg = load_drafter(str(d), quantize=False)
    ids = pcfg.target_layer_ids
    outs = layer_outputs(model, PROMPT)
    fused = mx.concatenate([outs[i] for i in ids], axis=-1)[None, :-1]
    ctx = drafter.make_ctx_cache()
    drafter.update_context(fused, 0, ctx)
    cap = drafter.max_draft
    width = drafter.draft_width(cap)
    block = [PROMPT[-1]] + [pcfg.mask_token_id] * (width - 1)
    hidden = drafter.backbone(drafter.embed(mx.array([block])), len(PROMPT) - 1, ctx)
    logits = drafter.compute_logits(drafter.head_slice(hidden, cap))[0]
    proposals = drafter.sample_block(logits, first_prev_token=PROMPT[-1]).tolist()
    extra = {"block_size": width, "logits_start": pcfg.logits_start}
    (d / "expected.json").write_text(
        json.dumps(expected("mlx-dspark", proposals, model, **extra), indent=1) + "\n"
    )
    print(f"  {name}: mlx-dspark proposals {proposals} (logits_start {pcfg.logits_start})")


def dflash_mlx_head(out: Path, model, tcfg, seed: int):
    """A z-lab DFlash head that names no target layers (`num_target_layers` only) as
    dflash-mlx 0.1.8 reads it (its DFlashDraftModelArgs / DFlashDraftModel, its own default
    layers from build_target_layer_ids), the first block from its forward over a full-context
    cache, the target's embedding and head (as its runtime binds them)."""
    from dflash_mlx.model import DFlashDraftModel, DFlashDraftModelArgs, FullContextDraftKVCache

    name = "dflash_dflash_mlx_default_layers"
    config = dflash_block_config(tcfg, [1, 3, 4], 6, {})
    del config["dflash_config"]["target_layer_ids"]
    head = DFlashDraftModel(DFlashDraftModelArgs.from_dict(json.loads(json.dumps(config))))
    weights = scaled(head, seed, scale=3.0)
    d = out / name
    write(out, name, config, weights, {"proposals": []})
    head.load_weights(list(mx.load(str(d / "model.safetensors")).items()), strict=True)
    outs = layer_outputs(model, PROMPT)
    ids = head.target_layer_ids
    hidden = mx.concatenate([outs[i] for i in ids], axis=-1)[None, :-1]
    block = mx.array([[PROMPT[-1]] + [head.mask_token_id] * (head.block_size - 1)])
    cache = [FullContextDraftKVCache() for _ in head.layers]
    states = head(
        noise_embedding=model.model.embed_tokens(block), target_hidden=hidden, cache=cache
    )
    proposals = argmax(model.lm_head(states[:, 1:]))[0].tolist()
    exp = expected("dflash-mlx", proposals, model, target_layer_ids=list(ids))
    (d / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    print(f"  {name}: dflash-mlx proposals {proposals} (layers {list(ids)})")


# ----------------------------------------------------------------------------- EAGLE-3


def eagle_speculators_config(tcfg: dict, draft_vocab: int, ids) -> dict:
    layer = {
        "model_type": "llama",
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
    }
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": tcfg["hidden_size"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
        },
    }
    if ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
    return cfg


def to_specforge(cfg: dict, weights: dict, ids_outputs) -> tuple[dict, dict]:
    """The same head as SpecForge / SafeAILab EAGLE publish it: a LlamaForCausalLMEagle3
    config (the layer's fields at the top, draft_vocab_size, eagle_config with the layer
    *output* ids) and the first layer under `midlayer.*`."""
    layer = cfg["transformer_layer_config"]
    out = {
        **layer,
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg["draft_vocab_size"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    if ids_outputs is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids_outputs}
    renamed = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in weights.items()
    }
    return out, renamed


def mlx_vlm_eagle(
    out: Path, model, tcfg, seed: int, draft_vocab: list[int], name: str, ids, rope=None
):
    """An EAGLE-3 head in the speculators layout as mlx-vlm reads it (with `d2t`), its first
    block from mlx-vlm's prefill_from_target_hidden + draft_block; with the layer ids `ids`
    (vLLM / speculators: the layers whose *input* is read), or none (the features then of
    EAGLE's default, the inputs of the target's layers 2, N/2, N-3: mlx-vlm's own default
    counts the head's layers instead); with a rope_scaling block `rope` (mlx-vlm's attention
    then given the rope SpecForge builds from it: mlx-vlm's own ignores it, its proposals are
    kept as `peer_as_is`). The first one's weights again in SpecForge's layout (no peer here
    reads it: its proposals are the speculators head's)."""
    from mlx_lm.models.rope_utils import initialize_rope
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    cfg = eagle_speculators_config(tcfg, len(draft_vocab), ids)
    if rope is not None:
        cfg["transformer_layer_config"]["rope_scaling"] = rope
    head = Eagle3DraftModel(Eagle3Config.from_dict(json.loads(json.dumps(cfg))))
    weights = scaled(head, seed, scale=3.0)
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight  # SpecForge: frozen copy
    weights["d2t"] = mx.array([t - i for i, t in enumerate(draft_vocab)], mx.int64)
    t2d = mx.zeros((VOCAB,), mx.bool_)
    t2d[mx.array(draft_vocab)] = True
    weights["t2d"] = t2d
    d = out / name
    write(out, name, cfg, weights, {"proposals": []})
    w = head.sanitize(mx.load(str(d / "model.safetensors")))
    # mlx-spec runs an EAGLE-3 head in float32 on the CPU: the peer does too, on the same values
    w = {k: v.astype(mx.float32) if v.dtype == mx.float16 else v for k, v in w.items()}
    head.load_weights(list(w.items()), strict=True)
    head.bind(model)
    n = tcfg["num_hidden_layers"]
    reads = ids if ids is not None else [2, n // 2, n - 3]
    outs = layer_outputs(model, PROMPT)
    hidden = mx.concatenate([outs[i - 1] for i in reads], axis=-1)[None, :-1]

    def draft(k=5):
        head.reset(model)
        head.prefill_from_target_hidden(
            mx.array([PROMPT[:-1]]), hidden, PROMPT[-1], argmax, greedy=True
        )
        return head.draft_block(PROMPT[-1], None, None, k + 1, argmax, greedy=True)

    extra = {"capture_outputs": [i - 1 for i in reads]}
    if rope is not None:
        extra["peer_as_is"] = draft().reshape(-1).tolist()
        layer = cfg["transformer_layer_config"]
        for block in head.layers:
            block.self_attn.rope = initialize_rope(
                layer["head_dim"], layer["rope_theta"], False, rope,
                layer["max_position_embeddings"],
            )  # fmt: skip
    proposals = draft().reshape(-1).tolist()
    exp = expected("mlx-vlm", proposals, model, **extra)
    (d / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    print(f"  {name}: mlx-vlm proposals {proposals} {extra}")
    if name != "eagle3_speculators_mlx_vlm":
        return
    sf_cfg, sf_weights = to_specforge(cfg, weights, [i - 1 for i in ids])
    write(out, "eagle3_specforge_midlayer", sf_cfg, sf_weights,
          {**exp, "peer": "mlx-vlm (the speculators twin's proposals)"})  # fmt: skip


# ----------------------------------------------------------------------------- Qwen3.5 MTP

MTP_SEED = 13


def peer_qwen35_config() -> dict:
    """A small Qwen3.5 original-checkpoint config (tests/test_mtp.py's, narrowed: a head of a
    few tens of KB)."""
    from test_mtp import qwen35_config

    cfg = qwen35_config(VOCAB)
    cfg["text_config"] |= {
        "hidden_size": 32,
        "intermediate_size": 64,
        "head_dim": 8,
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 0],
        },
    }
    return cfg


def mlx_vlm_mtp(out: Path, seed: int):
    """A Qwen3.5 MTP head in the original checkpoints' layout (`mtp.*`, zero-centred norms) as
    mlx-vlm reads it (Qwen3_5MTPDraftModel.sanitize), over tests/test_mtp.py's original
    checkpoint of `peer_qwen35_config()` (seed MTP_SEED, its own random head replaced by this
    one); the first block from mlx-vlm's prefill_from_target_hidden + draft_block over the
    target's final-norm hidden states of the prompt."""
    from mlx_lm import load as mlx_load
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel
    from test_mtp import original_checkpoint
    from test_peer_heads import with_head

    cfg = peer_qwen35_config()
    head = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict(json.loads(json.dumps(cfg))))
    weights = scaled(head, seed, scale=3.0)
    mx.random.seed(seed + 1)
    hf = {  # the original's names and zero-centred norms
        "mtp." + k: (0.1 * mx.random.normal(v.shape) if "norm" in k else v)
        for k, v in weights.items()
    }
    name = "qwen3_5_mtp_mlx_vlm"
    d = out / name
    write(out, name, cfg, hf, {"proposals": []})
    w16 = {k: v.astype(mx.float32) for k, v in mx.load(str(d / "model.safetensors")).items()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny.write_tokenizer(root / "tokenizer")
        original_checkpoint(root / "ckpt", VOCAB, root / "tokenizer", seed=MTP_SEED, config=cfg)
        with_head(root / "ckpt", w16)
        model, _ = mlx_load(str(root / "ckpt"))
        from mlx_spec import load_pair
        from mlx_spec.cli import main as cli_main

        assert cli_main(["heads", "extract", str(root / "ckpt"), str(root / "head")]) == 0
        pair = load_pair(target=str(root / "ckpt"), drafter="mtp", head=str(root / "head"))
        gap = smallest_gap(pair, PROMPT, 3)
    head.load_weights(list(head.sanitize(w16).items()), strict=True)
    head.bind(model)
    head.reset(model)
    inner = model.language_model.model
    hidden = inner(mx.array([PROMPT[:-1]]))  # the final norm's output
    head.prefill_from_target_hidden(
        mx.array([PROMPT[:-1]]), hidden, PROMPT[-1], argmax, greedy=True
    )
    proposals = head.draft_block(PROMPT[-1], None, None, 4, argmax, greedy=True)
    proposals = proposals.reshape(-1).tolist()
    exp = expected("mlx-vlm", proposals, model, target_seed=MTP_SEED)
    (d / "expected.json").write_text(json.dumps(exp, indent=1) + "\n")
    print(f"  {name}: mlx-vlm proposals {proposals}")
    return gap


MIN_GAP = 0.25  # the least top-two logit gap a fixture's guesses may have (float16, Metal)


def smallest_gap(pair, prompt: list[int], k: int) -> float:
    """The least gap between the two best logits over mlx-spec's guesses for the fixture's
    first round: a near tie could flip between backends (float16 kernels), a fixture then
    failing for no drift. (Read through a processor, which sees each position's logits.)"""
    from mlx_spec import Decoder, SamplingParams

    rows = []

    def record(context, proposed, logits):
        rows.append(logits[0])
        return logits

    drafter = pair.config.kind.build(pair)
    Decoder(pair.target, drafter, ()).prefill(prompt)
    drafter.propose(k, SamplingParams(), None, processors=(record,))
    return min(float(mx.subtract(*mx.sort(r)[-1:-3:-1])) for r in rows)


def settled(
    make, name: str, seed: int, target_dir: Path | None, kind: str | None, unless=None
) -> None:
    """`make(seed)` for the first seed from `seed` whose guesses have no near tie and, with
    `unless` (a config.json without the field the fixture is about), whose proposals differ
    from those of the head read under that config: a fixture that tells the field's reading
    apart from its absence."""
    from mlx_spec import Decoder, SamplingParams, load_pair

    for _ in range(40):
        gap = make(seed)
        out = Path(make.out if gap is None else "") / name
        if gap is None:
            pair = load_pair(target=str(target_dir), drafter=kind, head=str(out))
            want = json.loads((out / "expected.json").read_text())
            gap = smallest_gap(pair, want["prompt"], len(want["proposals"]))
        if unless is not None and gap >= MIN_GAP:
            with tempfile.TemporaryDirectory() as tmp:
                other = Path(tmp) / name
                other.mkdir()
                (other / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
                (other / "config.json").write_text(json.dumps(unless))
                pair = load_pair(target=str(target_dir), drafter=kind, head=str(other))
                drafter = pair.config.kind.build(pair)
                Decoder(pair.target, drafter, ()).prefill(want["prompt"])
                k = len(want["proposals"])
                if drafter.propose(k, SamplingParams(), None)[0].tolist() == want["proposals"]:
                    print(f"  {name}: seed {seed} proposes the same without the field")
                    seed += 1000
                    continue
        if gap >= MIN_GAP:
            print(f"  {name}: seed {seed}, least top-two gap {gap:.3f}")
            return
        print(f"  {name}: seed {seed} has a near tie ({gap:.3f}), the next seed")
        seed += 1000
    raise SystemExit(f"{name}: no seed without a near tie")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "peers")
    args = p.parse_args(argv)
    out = args.out
    model, tcfg = build_target()
    out.mkdir(parents=True, exist_ok=True)
    target = {"config": tcfg, "seed": TARGET_SEED, "prompt": PROMPT,
              "greedy": target_greedy(model, PROMPT, GREEDY)}  # fmt: skip
    (out / "target.json").write_text(json.dumps(target, indent=1) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        tdir = Path(tmp)
        tiny.write_tokenizer(tdir / "tokenizer")
        weights = tiny.random_weights(tcfg, seed=TARGET_SEED)
        tiny.write_model(tdir / "target", tcfg, weights, tdir / "tokenizer")
        fixtures(out, model, tcfg, tdir / "target")


def fixtures(out: Path, model, tcfg: dict, target_dir: Path) -> None:
    def make(kind, name, fn, unless=None):
        def run(seed):
            fn(seed)

        run.out = out
        return lambda seed: settled(run, name, seed, target_dir, kind, unless)

    dflash = dflash_block_config(tcfg, [1, 3, 4], 6, {})
    name = "dflash_mlx_vlm"
    make("dflash", name, lambda s: mlx_vlm_block(out, model, tcfg, name, dflash, False, s))(21)
    dspark = {"architectures": ["Lfm2DSparkDraftModel"], "markov_rank": 8,
              "markov_head_type": "vanilla", "enable_confidence_head": False}  # fmt: skip
    variants = {
        "dspark_mlx_vlm": (5, {}, {}),
        "dspark_mlx_vlm_no_anchor_row": (5, {"sample_from_anchor": False}, {}),
        "dspark_mlx_vlm_bonus_anchor": (6, {}, {"dspark_bonus_anchor": True}),
    }
    for seed, (name, (block, nested, top)) in enumerate(variants.items(), 22):
        cfg = dflash_block_config(tcfg, [1, 3, 4], block, dspark) | top
        cfg["dflash_config"] |= nested
        block_head = partial(mlx_vlm_block, out, model, tcfg, name, cfg, True)
        # the field left out: what mlx-spec read before it read them
        bare = dflash_block_config(tcfg, [1, 3, 4], block, dspark) if nested or top else None
        make("dspark", name, lambda s, f=block_head: f(seed=s), bare)(seed)
    # vLLM speculators packaging (mlx-dspark translates it): a reduced vocabulary with d2t,
    # block 6 for 5 speculative tokens -> logits_start 1
    mx.random.seed(5)
    draft_vocab = sorted(mx.random.permutation(VOCAB)[:96].tolist())
    skip = ("architectures", "block_size", "num_target_layers", "dflash_config")
    layer = {k: v for k, v in dflash_block_config(tcfg, [1, 3, 4], 6, {}).items() if k not in skip}
    spec = {
        "architectures": ["DSparkSpeculator"],
        "speculators_model_type": "dspark",
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [1, 3, 4],
        "draft_vocab_size": len(draft_vocab),
        "block_size": 6,
        "mask_token_id": 5,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
        },
    }
    name = "dspark_speculators_mlx_dspark"
    make("dspark", name,
         lambda s: mlx_dspark_head(out, model, tcfg, name, spec, s, draft_vocab))(25)  # fmt: skip
    assert tcfg["num_hidden_layers"] == 6
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    eagles = {  # (layer ids, rope scaling)
        "eagle3_speculators_mlx_vlm": ([2, 3, 5], None),  # and its SpecForge twin
        "eagle3_speculators_default_layers": (None, None),
        "eagle3_speculators_llama3_rope": ([2, 3, 5], llama3),
    }
    for seed, (name, (ids, rope)) in enumerate(eagles.items(), 26):
        eagle = partial(mlx_vlm_eagle, out, model, tcfg, draft_vocab=draft_vocab, name=name)
        make("eagle3", name, lambda s, f=eagle, i=ids, r=rope: f(seed=s, ids=i, rope=r))(seed)
    name = "dflash_dflash_mlx_default_layers"
    make("dflash", name, lambda s: dflash_mlx_head(out, model, tcfg, s))(29)
    settled(lambda s: mlx_vlm_mtp(out, s), "qwen3_5_mtp_mlx_vlm", 30, None, None)


if __name__ == "__main__":
    main()
