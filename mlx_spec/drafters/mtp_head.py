"""The target's own multi-token-prediction (MTP) layer: its model and its weights. Two layouts:

Qwen3.5 / Qwen3.6 and Qwen3-Next ship it beside the model as `mtp.*` tensors (vLLM's
qwen3_next_mtp.py / qwen3_5_mtp.py):

    x = fc(concat[pre_fc_norm_embedding(embed(s[t+1])), pre_fc_norm_hidden(h[t])])
    g = norm(layer(x))          # one full-attention decoder layer of the target's family
    logits = lm_head(g)         # the target's own embedding and head

DeepSeek-V3 and GLM-4.5 / 4.6 / 4.7-Flash ship it as one more layer, `model.layers.{N}.*` with
N = num_hidden_layers (vLLM's deepseek_mtp.py / glm4_moe_mtp.py, SGLang's deepseek_nextn.py):

    x = eh_proj(concat[enorm(embed(s[t+1])), hnorm(h[t])])   # embedding first, plain RMS norms
    g = layer(x)                # a decoder layer of the target's family (MLA, MoE: as its own)
    logits = lm_head(shared_head.norm(g))

h[t] is the target's post-final-norm hidden state (what its lm_head reads). For k > 1 the head
runs again on its own output `g` and its own guess. Its layer keeps a KV cache of
(h[t], s[t+1]) pairs built from the target's hidden states only: the entries a proposal adds
from its own outputs are forgotten at commit, and the next proposal feeds the target's hidden
states of the tokens the round kept (the verify pass computed them). A head directory is what
`mlx-spec heads extract` writes: the head's tensors in mlx-lm's convention (Qwen's RMS norm
weights w + 1, experts stacked, DeepSeek's kv_b_proj split), optionally quantized, and
config.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from ..errors import SpecError
from ..models.model_dir import text_config
from .mtp_source import FAMILIES, HEAD_TYPE, Family

# RMS norms stored zero-centred ((1 + w) x) in the original Qwen checkpoints; mlx-lm adds 1
NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def family(config: dict) -> Family:
    """A config's MTP family, or a one-line refusal."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise SpecError(f"no MTP layout for model type {model_type!r} (known: {known})")
    return FAMILIES[model_type]


def layer_count(config: dict) -> int:
    text = text_config(config)
    n = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers"))
    return 1 if n is None else int(n)


def _args(config: dict):
    module, args_class, layer_class = family(config).classes()
    text = json.loads(json.dumps(text_config(config)))  # from_dict may edit its input
    return module, args_class.from_dict(text), layer_class


def build_head(config: dict) -> nn.Module:
    """The head of a config's family, with fresh weights."""
    return HEADS[family(config).layout](config)


class MTPHead(nn.Module):
    """Qwen's layout: fc over [embedding; hidden], one decoder layer of the target's family,
    a norm. Its output is what the target's head reads, and what the next step chains on."""

    zero_first = False  # the embedding at position 0 is used as it is

    def __init__(self, config: dict):
        super().__init__()
        _, args, layer = _args(config)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # the layer index of a full-attention layer (and, in Qwen3-Next, a sparse one)
        self.layers = [layer(args, args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.hidden_size = hidden

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """(1, L, H) embeddings of s[t+1] and hidden states at t -> (1, L, H) outputs."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        x = self.layers[0](x, mask=create_attention_mask(x, cache[0]), cache=cache[0])
        return self.norm(x)

    def final(self, x: mx.array) -> mx.array:
        """An output -> what the target's lm_head reads (here the output itself)."""
        return x

    @staticmethod
    def where(config: dict) -> str:
        return "mtp.*"

    @staticmethod
    def tensor_name(key: str, config: dict) -> str | None:
        """`mtp.fc.weight` (or `model.mtp.fc.weight`) -> `fc.weight`; None for other tensors."""
        if key.startswith("mtp."):
            return key[4:]
        at = key.find(".mtp.")
        return key[at + 5 :] if at >= 0 else None

    @staticmethod
    def weights(tensors: dict, config: dict, original: bool) -> dict:
        return head_weights(tensors, config, original)


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)


class NextNHead(nn.Module):
    """DeepSeek-V3 / GLM-4.x layout: eh_proj over [enorm(embedding); hnorm(hidden)], one decoder
    layer of the target's family (built as layer N of the target, so MoE where the target's
    later layers are), shared_head.norm before the target's head."""

    # DeepSeek's MTP was trained with the embedding at position 0 masked: vLLM's deepseek_mtp.py
    # and glm4_moe_mtp.py zero it ("not needed by MTP"); only the pair (h[0], s[1]) sees it
    zero_first = True
    OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    # copies of the target's embedding and head: the head uses the target's (SGLang does too)
    SHARED = ("embed_tokens.weight", "shared_head.head.weight")

    def __init__(self, config: dict):
        super().__init__()
        _, args, layer = _args(config)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [layer(args, args.num_hidden_layers)]
        self.shared_head = SharedHead(hidden, eps)
        self.hidden_size = hidden

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """(1, L, H) embeddings of s[t+1] and hidden states at t -> (1, L, H) outputs, before
        shared_head.norm: the next step chains on these, as vLLM's proposer does (the model's
        forward returns them and compute_logits applies shared_head.norm), which follows
        DeepSeek-V3's report (depth k+1 reads depth k's layer output; the norm is part of the
        output head). SGLang chains on the normed state; hnorm makes the two nearly alike."""
        x = mx.concatenate([self.enorm(embeddings), self.hnorm(hidden)], axis=-1)
        x = self.eh_proj(x)
        # MLA attention (deepseek_v3, glm4_moe_lite) masks with mx.where: it needs an array
        mask = create_attention_mask(x, cache[0], return_array=True)
        return self.layers[0](x, mask=mask, cache=cache[0])

    def final(self, x: mx.array) -> mx.array:
        return self.shared_head.norm(x)

    @staticmethod
    def where(config: dict) -> str:
        return f"model.layers.{int(text_config(config)['num_hidden_layers'])}.*"

    @classmethod
    def tensor_name(cls, key: str, config: dict) -> str | None:
        """`model.layers.{N}.eh_proj.weight` -> `eh_proj.weight`; None for other tensors."""
        prefix = cls.where(config)[:-1]
        return key[len(prefix) :] if key.startswith(prefix) else None

    @classmethod
    def weights(cls, tensors: dict, config: dict, original: bool) -> dict:
        """The layer's tensors -> the head's parameters. The decoder layer goes through its
        architecture's own `Model.sanitize` (experts stacked, kv_b_proj split into MLA's
        embed_q / unembed_out, fp8 dequantized) as layer 0 of a one-layer model, the names
        mlx-lm's sanitize looks for; the target's copies are dropped after a shape check."""
        n = layer_count(config)
        if n != 1:
            raise SpecError(f"this checkpoint has {n} MTP layers; only one is supported")
        module, args, _ = _args(config)
        text = text_config(config)
        shape = (int(text["vocab_size"]), int(text["hidden_size"]))
        out = dict(tensors)
        for name in cls.SHARED:
            v = out.pop(name, None)
            if v is not None and tuple(v.shape) != shape:
                raise SpecError(f"the MTP layer's {name} is {tuple(v.shape)}, not {shape}")
        one = dataclasses.replace(args, num_hidden_layers=1)
        layer = module.Model.sanitize(
            SimpleNamespace(args=one), {f"model.layers.0.{k}": v for k, v in out.items()}
        )
        weights = {}
        for k, v in layer.items():
            name = k.removeprefix("model.layers.0.")
            weights[name if name.startswith(cls.OWN) else f"layers.0.{name}"] = v
        return weights


HEADS = {"qwen": MTPHead, "nextn": NextNHead}


# ------------------------------------------------------------------ checkpoint -> head weights


def is_original(names, mlx_format: bool) -> bool:
    """Whether tensors come from an original (Hugging Face) checkpoint, whose norms are
    zero-centred: experts not yet stacked, or files not written by mlx (format "mlx")."""
    if any(".experts.0." in n or n.endswith("experts.gate_up_proj") for n in names):
        return True
    return not mlx_format and not any(".switch_mlp." in n for n in names)


def head_weights(tensors: dict, config: dict, original: bool) -> dict:
    """Qwen's `mtp.*` tensors with the prefix stripped -> the MTPHead's parameters (mlx-lm's
    convention: norms w + 1 in an original checkpoint, experts stacked into switch_mlp)."""
    n = layer_count(config)
    if n != 1:
        raise SpecError(f"this checkpoint has {n} MTP layers; only one is supported")
    out = dict(tensors)
    experts = int(text_config(config).get("num_experts") or 0)
    prefix = "layers.0.mlp"
    if f"{prefix}.experts.gate_up_proj" in out:  # Qwen3.5 MoE: fused (E, 2I, H)
        gate_up = out.pop(f"{prefix}.experts.gate_up_proj")
        mid = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    elif f"{prefix}.experts.0.up_proj.weight" in out:  # Qwen3-Next: one tensor per expert
        for name in ("up_proj", "down_proj", "gate_proj"):
            parts = [out.pop(f"{prefix}.experts.{e}.{name}.weight") for e in range(experts)]
            out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(parts)
    if original:
        for k, v in out.items():
            if v.ndim == 1 and (k in NORMS or any(k.endswith(s) for s in NORMS if s[0] == ".")):
                out[k] = v + 1.0
    return out


def quantize_head(head: MTPHead, bits: int, group_size: int) -> dict:
    """Quantize the head's linear layers as mlx-lm quantizes the target (MoE router gates at
    8 bits); returns the config's `quantization` entry."""

    def predicate(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        if module.weight.shape[-1] % group_size:
            return False
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=predicate)
    return {"group_size": group_size, "bits": bits}


def read_head(path: Path) -> tuple[dict, dict]:
    """A head directory's config and weights, or a one-line refusal."""
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(
            f"the head {path} has no config.json (write one with heads extract)"
        ) from None
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise SpecError(f"the head's config.json cannot be read: {err}") from None
    if not isinstance(config, dict) or config.get("head_type") != HEAD_TYPE:
        raise SpecError(f"{path} is not an MTP head (config.json has no head_type 'mtp')")
    if not weights_file.is_file():
        raise SpecError(f"the head {path} has no model.safetensors")
    try:
        weights = mx.load(str(weights_file))
    except Exception as err:  # a truncated or foreign file
        raise SpecError(f"the head's weights cannot be read: {err}") from None
    return config, weights


def load_head(path: Path, target_config: dict) -> nn.Module:
    config, weights = read_head(Path(path))
    ours, theirs = text_config(config), text_config(target_config)
    if FAMILIES.get(config.get("model_type"), 1) != FAMILIES.get(target_config.get("model_type")):
        raise SpecError(
            f"the head {path} is for a {config.get('model_type')} target, not "
            f"{target_config.get('model_type')}"
        )
    for field in ("hidden_size", "vocab_size"):
        if ours.get(field) != theirs.get(field):
            raise SpecError(
                f"the head's {field} ({ours.get(field)}) is not the target's ({theirs.get(field)})"
            )
    head = build_head(config)
    quantization = config.get("quantization")
    if quantization:
        nn.quantize(
            head,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights and hasattr(m, "to_quantized"),
        )
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise SpecError(f"the head's weights do not fit its config: {err}") from None
    return head
