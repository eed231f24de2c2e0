"""A new EAGLE-3 head for a target: its config (the target's sizes, the three captured layers),
its draft vocabulary (the target's most frequent reply tokens), its first weights, and the
head folder it is written to (what `--drafter eagle3 --head DIR` reads).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..core.hidden import decoder_stack
from ..drafters.eagle import Eagle3Head, capture_layers, load_head
from ..errors import SpecError
from ..models.model_dir import json_object, text_config
from .common import Sequence, write_json

HEAD_WEIGHTS = "model.safetensors"


OUTPUT_SCALE = 0.2  # a new head's logits start at this share of its target's (new_head)


def head_config(target_config: dict, layers: tuple, draft_vocab: int, intermediate=None) -> dict:
    """config.json of a new head for this target: one llama layer as wide as the target,
    reading the outputs of `layers` (SpecForge's convention, named in eagle_config)."""
    t = text_config(target_config)
    try:
        hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
        int(t["intermediate_size"]), int(t["vocab_size"]), int(t["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        kind = target_config.get("model_type", "this")
        raise SpecError(
            f"an EAGLE-3 head is a transformer layer as wide as its target; a {kind} target "
            "names no hidden_size, num_attention_heads and intermediate_size"
        ) from None
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(intermediate or t["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(t.get("num_key_value_heads") or heads),
        "head_dim": hidden // heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(t.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(t.get("max_position_embeddings") or 8192),
        "vocab_size": int(t["vocab_size"]),
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
    }


def default_layers(target_layers: int) -> tuple[int, int, int]:
    """EAGLE's choice, the inputs of layers 2, N/2 and N-3 (outputs of 1, N/2-1, N-4); a
    shallow target (under 8 layers, tests' tiny ones) reads its first, middle and last."""
    if target_layers < 8:
        return (0, (target_layers - 1) // 2, target_layers - 1)
    return (1, target_layers // 2 - 1, target_layers - 4)


def choose_vocab(seqs: list[Sequence], vocab: int, size: int) -> list[int]:
    """The draft vocabulary: the `size` most frequent reply tokens (ties by id), filled up
    with the prompts' tokens and then the lowest ids when the replies hold fewer."""
    size = min(size, vocab)
    replies = Counter(t for s in seqs for t in s.tokens[s.start :])
    prompts = Counter(t for s in seqs for t in s.tokens[: s.start])
    chosen = [t for t, _ in sorted(replies.items(), key=lambda kv: (-kv[1], kv[0]))][:size]
    seen = set(chosen)
    for t, _ in sorted(prompts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    t = 0
    while len(chosen) < size:
        if t not in seen:
            chosen.append(t)
        t += 1
    return sorted(chosen)


def head_weights(head: Eagle3Head, dtype=None) -> dict:
    """The head's weights under the published names, with d2t and t2d."""
    from mlx.utils import tree_flatten

    weights = {
        k: (v.astype(dtype) if dtype is not None else v)
        for k, v in tree_flatten(head.parameters())
        if not k.startswith("embedding.")  # a head's own embedding: kept as it came
    }
    if getattr(head, "embedding", None) is not None:
        weights["embed_tokens.weight"] = head.embedding.weight
    ids = head._to_target.astype(mx.int64)  # (draft_vocab,)
    weights["d2t"] = ids - mx.arange(ids.shape[0], dtype=mx.int64)
    t2d = mx.zeros((head._gather.shape[0],), mx.bool_)
    t2d[ids] = True
    weights["t2d"] = t2d
    return weights


def write_head(out: Path, head: Eagle3Head, config: dict, dtype=None) -> None:
    """config.json and model.safetensors, each replaced whole."""
    tmp = out / "model.tmp.safetensors"
    mx.save_safetensors(str(tmp), head_weights(head, dtype))
    tmp.replace(out / HEAD_WEIGHTS)
    write_json(out / "config.json", config)


def new_head(pair, config: dict, draft_ids: list[int], where: Path, seed: int) -> Eagle3Head:
    """A randomly initialised head (mlx's default init), written to `where` and loaded back by
    the drafter's own loader: what it trains is what `--head` loads."""
    mx.random.seed(seed)
    hidden = int(config["target_hidden_size"])
    head = Eagle3Head(config, hidden, len(draft_ids), fc_bias=False)
    # the output layer starts as the target's own (its rows for the draft vocabulary, its final
    # norm): the head then learns features in the target's space, not a vocabulary from zero
    rows = output_rows(pair.target, mx.array(draft_ids, mx.uint32))
    if rows is not None and rows.shape == head.lm_head.weight.shape:
        head.lm_head.weight = rows.astype(mx.float32)
        norm = decoder_stack(pair.target).get("norm")
        if type(norm) is nn.RMSNorm and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight = norm.weight.astype(mx.float32)
        # ... but its logits start at OUTPUT_SCALE of the target's: on random features the
        # target's full-scale rows guess confidently and wrongly, and the first steps go to
        # unlearning that (demo target, 30 steps: held-out agreement 0.142 against 0.065)
        head.norm.weight = head.norm.weight * OUTPUT_SCALE
    head._to_target = mx.array(draft_ids, mx.uint32)
    head._gather = mx.zeros((int(config["vocab_size"]),), mx.uint32)
    where.mkdir(parents=True, exist_ok=True)
    write_head(where, head, config)
    return load_head(where, pair.target, pair.target_config)


def output_rows(target, ids: mx.array) -> mx.array | None:
    """The target's output-layer rows for `ids` (an untied lm_head, else the tied embedding),
    dequantized; None where neither is found."""
    for node in (target, target.get("language_model")):
        lm = node.get("lm_head") if isinstance(node, nn.Module) else None
        if isinstance(lm, nn.QuantizedLinear):
            w = mx.dequantize(lm.weight, lm.scales, lm.biases, lm.group_size, lm.bits)
            return w[ids]
        if isinstance(lm, nn.Linear):
            return lm.weight[ids]
    embed = decoder_stack(target).get("embed_tokens")
    return embed(ids) if isinstance(embed, nn.Module) else None


def init_config(path: Path, target_config: dict) -> dict:
    """The config of a published head to fine-tune, in the EAGLE layout this module writes."""
    config = json_config(path)
    if "transformer_layer_config" in config or "speculators_model_type" in config:
        layer = dict(config.get("transformer_layer_config") or {})
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        config = {**layer, **{k: config[k] for k in ("norm_before_residual",) if k in config}}
        if ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = ids
        config["architectures"] = ["LlamaForCausalLMEagle3"]
    if int(config.get("num_hidden_layers") or 1) != 1:
        raise SpecError(f"the head {path} has several layers; only one-layer heads train here")
    t = text_config(target_config)
    layers = capture_layers(config, int(t["num_hidden_layers"]))
    config.pop("eagle_aux_hidden_state_layer_ids", None)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    return config


def json_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise SpecError(f"the head {path} has no config.json")
    return json_object(path / "config.json", "config.json")
