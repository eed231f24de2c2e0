"""The target's own multi-token-prediction (MTP) layer as the drafter. Two layouts:

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
import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import common_prefix_len

from .. import caches
from ..errors import SpecError
from ..hidden import FINAL_NORM, decoder_stack
from ..model_dir import text_config
from ..processors import apply as apply_processors
from ..sampling import probabilities, sample
from .base import Drafter, DrafterKind

HEAD_TYPE = "mtp"


@dataclass(frozen=True)
class Family:
    """One architecture's MTP layer: its layout (`head`, the class that runs it and reads its
    tensors) and the mlx-lm module, args class and decoder layer class it is built from."""

    layout: str  # "qwen": mtp.* tensors; "nextn": model.layers.{num_hidden_layers}.*
    module: str
    args: str
    layer: str

    def classes(self):
        module = importlib.import_module(f"mlx_lm.models.{self.module}")
        return module, getattr(module, self.args), getattr(module, self.layer)


# model types whose original checkpoints carry an MTP layer mlx-lm's classes can run
FAMILIES = {
    "qwen3_5": Family("qwen", "qwen3_5", "TextModelArgs", "DecoderLayer"),
    "qwen3_5_moe": Family("qwen", "qwen3_5", "TextModelArgs", "DecoderLayer"),
    "qwen3_next": Family("qwen", "qwen3_next", "ModelArgs", "Qwen3NextDecoderLayer"),
    "deepseek_v3": Family("nextn", "deepseek_v3", "ModelArgs", "DeepseekV3DecoderLayer"),
    "glm4_moe": Family("nextn", "glm4_moe", "ModelArgs", "DecoderLayer"),
    "glm4_moe_lite": Family("nextn", "glm4_moe_lite", "ModelArgs", "Glm4MoeLiteDecoderLayer"),
}
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


# ------------------------------------------------------------------------------- the drafter


def target_parts(target):
    """The target's token embedding and its output head (the tied embedding if it has none)."""
    embed = decoder_stack(target).get("embed_tokens")
    if embed is None:
        raise SpecError(f"cannot find the embedding of this {type(target).__name__}")
    owner = target.get("language_model", target)
    lm_head = owner.get("lm_head") if isinstance(owner, nn.Module) else None
    return embed, (lm_head if lm_head is not None else embed.as_linear)


class MTPDrafter(Drafter):
    """State between rounds: `tokens` is the sequence; the head's cache holds the pairs
    (h[t], s[t+1]) for positions up to `end` (exclusive), and `rows` the target's hidden
    states at positions end .. known-1 not yet fed (at least the last one, so a proposal
    always starts from the target's own state). `target_at` is the position of the first row
    the target's next pass hands over (its cache's length)."""

    hidden_layers = (FINAL_NORM,)

    def __init__(self, head: MTPHead, target, vocab: int | None = None):
        self.head = head
        self.embed, self.lm_head = target_parts(target)
        self.vocab = vocab
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        self.cache = [KVCache()]
        self.tokens: list[int] = []
        self.end = 0
        self.rows: mx.array | None = None
        self.target_at: int | None = 0
        self.spec = 0  # cache entries the last proposal added beyond the target's pairs
        self.ran = False

    # -------------------------------------------------------------------------- helpers

    def _known(self) -> int:
        return self.end + (0 if self.rows is None else self.rows.shape[0])

    def _forget(self, n: int) -> None:
        if n:
            caches.rollback(self.cache, n)

    def _run(self, ids, hidden: mx.array, at: int | None = None) -> mx.array:
        """The head over pairs (hidden (L, H), token ids (L,)) -> outputs (L, H); `at`: the
        position t of the first pair (h[t], s[t+1]), None past the target's states."""
        ids = ids if isinstance(ids, mx.array) else mx.array(ids, mx.uint32)
        embeddings = self.embed(ids)  # (L, H)
        if at == 0 and self.head.zero_first:
            embeddings = embeddings * (mx.arange(embeddings.shape[0]) > 0)[:, None]
        return self.head(embeddings[None], hidden[None], self.cache)[0]

    def _logits(self, g: mx.array) -> mx.array:
        logits = self.lm_head(self.head.final(g[None]))[0]
        if self.vocab is not None and logits.shape[-1] > self.vocab:
            logits = logits[: self.vocab]
        return logits

    # ------------------------------------------------------------------------ protocol

    def prefill(self, tokens, timed=False, output=None):
        new = output.hidden.get(FINAL_NORM) if output is not None else None
        fed = output.fed if output is not None else 0
        first = len(tokens) - 1 - fed  # the position of the output's first row
        common = common_prefix_len(self.tokens, tokens)
        # a pair (h[t], s[t+1]) still holds while s[0..t+1] are unchanged
        keep = min(self.end, max(common - 1, 0))
        start = self.end - self.cache[0].offset
        valid_old = min(self._known(), common)  # old rows stay right up to here
        if first <= keep:
            rows = new[keep - first :] if new is not None else None
        elif keep == self.end and valid_old >= first:
            old = self.rows[: first - self.end] if self.rows is not None else None
            parts = [a for a in (old, new) if a is not None and a.shape[0]]
            rows = mx.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else None)
        else:  # the hidden states between are gone: the head's cache starts again at `first`
            keep, rows, start = first, new, first + 1
        if keep < start:  # nothing of the cache is before `keep`
            self.cache = [KVCache()]
        else:
            self._forget(self.end - keep)
        self.end, self.rows = keep, rows
        self.tokens = list(tokens)
        self.target_at = len(tokens) - 1
        self.spec, self.ran = 0, False
        seconds = 0.0
        if timed:
            seconds = self._time_step()
        return seconds

    def _time_step(self) -> float | None:
        """One head step's seconds (the second of two: the first pays one-time costs)."""
        if self.rows is None or not self.rows.shape[0]:
            return None
        known = self._known()
        row, token = self.rows[-1:], self.tokens[known]
        seconds = None
        for _ in range(2):
            start = time.perf_counter()
            mx.eval(self._logits(self._run([token], row, known - 1)[-1]))
            seconds = time.perf_counter() - start
        self._forget(2)
        return seconds

    def catch_up(self) -> None:
        """Feed the rows gathered during a plain stretch, all but the last, in one pass."""
        if self.rows is None or self.rows.shape[0] < 2:
            return
        m = self.rows.shape[0] - 1
        self._run(self.tokens[self.end + 1 : self.end + m + 1], self.rows[:m], self.end)
        caches.eval_state(self.cache)
        self.end += m
        self.rows = self.rows[m:]

    def propose(self, k, params, key, *, processors=()):
        self.steps, self.spec, self.ran = 0, 0, False
        if k == 0 or self.rows is None or not self.rows.shape[0]:
            return mx.zeros((0,), mx.uint32), None
        known, n = self._known(), len(self.tokens)
        # the target's pairs not yet in the cache, in one pass; its last output is at `known`
        g = self._run(self.tokens[self.end + 1 : known + 1], self.rows, self.end)[-1]
        self.ran, self.steps = True, 1
        for pos in range(known + 1, n):  # tokens the target has not handed states for yet
            g = self._run(self.tokens[pos : pos + 1], g[None])[-1]
            self.spec += 1
            self.steps += 1
        keys = None if params.greedy else mx.random.split(key, k)
        drafted, qs = [], []
        for i in range(k):
            logits = self._logits(g)
            if processors:  # after the sequence + x1..xi, as the target's row i
                so_far = mx.concatenate(drafted) if drafted else []
                logits = apply_processors(processors, self.tokens, so_far, logits)
            if params.greedy:
                y = mx.argmax(logits, axis=-1, keepdims=True)
            else:
                q = probabilities(logits, params)
                y = sample(q, keys[i])[None]
                qs.append(q)
            drafted.append(y)
            if i < k - 1:
                g = self._run(y, g[None])[-1]
                self.spec += 1
                self.steps += 1
            mx.async_eval(y)  # the device starts while Python builds the next step
        return mx.concatenate(drafted), (mx.stack(qs) if qs else None)

    def commit(self, kept, output=None):
        before = len(self.tokens)
        if self.ran:  # keep the target's pairs but the last (its row stays pending)
            fed = self.rows.shape[0]
            self._forget(self.spec + 1)
            self.end += fed - 1
            self.rows = self.rows[-1:]
        self.ran, self.spec = False, 0
        self.tokens += kept
        if output is None or self.target_at is None:
            self.target_at = None  # unknown until the next prefill
            return
        first = self.target_at
        # rows of tokens now in the sequence: the unfed ones and the accepted drafts. A
        # recurrent target that went back (output.kept = 0) computed them right all the same
        valid = before - first + len(kept) - 1
        have = self._known() - first
        hidden = output.hidden.get(FINAL_NORM)
        if hidden is not None and valid > have >= 0:
            new = hidden[have:valid]
            self.rows = new if self.rows is None else mx.concatenate([self.rows, new])
        self.target_at = first + output.kept

    def settle(self) -> None:
        caches.eval_state(self.cache, *([self.rows] if self.rows is not None else []))

    def cache_bytes(self) -> int:
        rows = self.rows.nbytes if self.rows is not None else 0
        return caches.nbytes(self.cache) + rows


def target_quantization(config: dict | None) -> tuple[int | None, int]:
    """(bits, group size) of a quantized target's config; (None, 64) for a float one."""
    q = (config or {}).get("quantization")
    bits = q.get("bits") if isinstance(q, dict) else None
    if not isinstance(bits, int) or isinstance(bits, bool):
        return None, 64
    return bits, int(q.get("group_size") or 64)


def head_source(name: str) -> tuple[Path | None, str | None]:
    """A pair's head name -> (a head directory to read as it is, None) or (None, the original
    checkpoint to extract it from: a directory's absolute path or a hub id). MTP heads are not
    published as repositories: a hub id names the model's original repository."""
    from ..loading import _expand, looks_like_path

    if name.startswith("package:"):
        return Path(name), None
    path = _expand(name)
    if path.is_dir() and not _is_original(path):
        return path, None  # a head directory (or not one: read_head says what is wrong)
    if path.exists() or looks_like_path(name):
        if not path.is_dir():
            raise SpecError(f"the head {name} is not a directory")
        return None, str(path.resolve())
    return None, name


def _is_original(path: Path) -> bool:
    """A model directory of a family with an MTP layout (not a head directory)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return (
        isinstance(config, dict)
        and "head_type" not in config
        and config.get("model_type") in FAMILIES
    )


def _local_config(target: str) -> dict | None:
    """A target's config.json when it is on this machine (no network), else None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = Path(target).expanduser() / "config.json"
        if not path.is_file():
            found = try_to_load_from_cache(target, "config.json")
            path = Path(found) if isinstance(found, str) else None
        return json.loads(path.read_text(encoding="utf-8")) if path else None
    except Exception:  # a GGUF file, a bad id, a damaged file: treated as a float target
        return None


class MTPKind(DrafterKind):
    name = "mtp"
    needs_head = True
    help = (
        "the target's own multi-token-prediction layer (--head DIR from mlx-spec heads "
        "extract, or the original checkpoint: extracted once into the cache)"
    )

    @classmethod
    def resolve_head(cls, name: str, target_config: dict, progress=None) -> Path:
        """A head directory as it is; an original checkpoint's head (its directory or hub id)
        extracted once into the head cache, quantized as the target is."""
        _, source = head_source(name)
        if source is None:
            return super().resolve_head(name, target_config, progress)
        from ..commands.heads import cached_head

        bits, group_size = target_quantization(target_config)
        return cached_head(source, bits, group_size, report=progress)

    @classmethod
    def head_downloaded(cls, name: str, target: str) -> bool:
        from ..commands.heads import cache_name, cache_root, is_head

        try:
            _, source = head_source(name)
        except SpecError:
            return False
        if source is None:
            return super().head_downloaded(name, target)
        bits, group_size = target_quantization(_local_config(target))
        return is_head(cache_root() / cache_name(source, bits, group_size))

    @classmethod
    def validate(cls, config) -> None:
        if config.draft_confidence is not None:
            raise SpecError("the mtp drafter has no draft-confidence setting")

    @classmethod
    def load_head(cls, path, target, target_config: dict) -> nn.Module:
        return load_head(Path(path), target_config)

    @classmethod
    def build(cls, pair) -> MTPDrafter:
        return MTPDrafter(pair.head, pair.target, pair.vocab_size)
