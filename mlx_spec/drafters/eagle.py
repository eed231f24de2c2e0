"""EAGLE-3 heads as published: one decoder layer that drafts from three of the target's layers.

A head reads the target's hidden states at a low, a middle and a high layer, fuses them with
`fc` (3H -> H) and runs one decoder layer whose attention takes [input_layernorm(embed(token));
hidden_norm(fused)] (2H wide), with its own KV cache. Entry j of that cache pairs the target's
features after token j with the embedding of token j+1; its output, through `norm` and a
reduced-vocabulary `lm_head`, predicts token j+2. Drafting k > 1 chains: the head's own output
stands in for the target's features of the token it just drafted. Draft ids map to the
target's as `target = draft + d2t[draft]`.

Two layouts load (references: SafeAILab/EAGLE `cnets.py`, SpecForge `llama3_eagle.py`, vLLM
`llama_eagle3.py`, vllm-project/speculators `models/eagle3`):

- EAGLE / SpecForge: config.json of a `LlamaForCausalLMEagle3`; weights `fc`, `midlayer.*`,
  `norm`, `lm_head`, `d2t`, `t2d` and, when shipped, `embed_tokens` (else the target's).
- speculators: config.json with `speculators_model_type: "eagle3"` and the layer settings in
  `transformer_layer_config`; weights `layers.0.*` (and further `layers.N.*`, plain decoder
  layers), optional `input_norm` before `fc`; with `tie_word_embeddings` and no `lm_head`
  (the full vocabulary), the embedding is the output head (as mlx-vlm reads it).

Refused in one line each, naming the variant: EAGLE-1 / EAGLE-2 heads (`layers.0.*`, no
`midlayer`), speculators models of another algorithm (`eagle`, `dspark`, ...), EAGLE-3 heads
with a Qwen3-style layer (`q_norm`), PyTorch-only weights.

Rope: as SpecForge's `get_rope_config` reads it (the reference that trains these heads):
transformers 5's `rope_parameters` first, else `rope_theta` / `rope_scaling`, and a scaling
block is applied (SpecForge builds its Llama3 / YaRN / linear / dynamic rotary embedding from
it). mlx-vlm 0.7.10 builds a plain RoPE and ignores it; EAGLE's `cnets.py` knows linear and
dynamic only. The embedding: the head's own when it ships one (EAGLE's `cnets.py` and SpecForge
embed with the head's `embed_tokens`, a frozen copy of the target's unless trained with
`embed_requires_grad`); mlx-vlm swaps in the target's whenever the shapes agree.

Which layers, the capture convention: the formats name the three layers differently, by one.
SpecForge and SGLang (`eagle_config.eagle_aux_hidden_state_layer_ids`) name a layer whose
*output* is read (SGLang captures the input of layer id+1); vLLM and speculators (a top-level
`eagle_aux_hidden_state_layer_ids`) name a layer whose *input* is read, the output of layer
id-1. With no ids, both read the inputs of layers 2, N/2 and N-3 of the target (EAGLE's own
`modeling_llama_kv.py`; mlx-vlm 0.7.10 takes N from the head's own `num_hidden_layers`, 1,
and reads layers 1, 0, 0). All are
mapped here to `hidden.capturing`'s layer-output ids (`capture_layers`).

Over 600 lines: the head, the reading of every published layout and config variant (the
refusals naming each), and the drafter's state across rounds, forks, batch rows and the disk
tier are one format's; split, each part would reach into the others' fields.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.utils import common_prefix_len

from ..core import caches
from ..core.cache_files import arrays_layer, check_kv, check_rows, head_figures, head_layers
from ..core.hidden import decoder_stack
from ..core.processors import apply as apply_processors
from ..core.sampling import draw
from ..errors import SpecError
from ..models.model_dir import json_object, text_config
from .base import Drafter

CHUNK = 2048  # rows of a prompt fed to the head at once (bounds the prefill's peak memory)


# ----------------------------------------------------------------------------- the head


def capture_layers(config: dict, target_layers: int) -> tuple[int, int, int]:
    """The three target layers a head reads, as layer-output ids (`hidden.capturing`)."""
    nested = config.get("eagle_config")
    nested = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if nested is not None:  # SpecForge / SGLang: the layer whose output is read
        ids, outputs = nested, True
    elif top is not None:  # vLLM / speculators: the layer whose input is read
        ids, outputs = top, False
    else:  # EAGLE's default in every engine: the inputs of layers 2, N/2, N-3
        ids, outputs = [2, target_layers // 2, target_layers - 3], False
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise SpecError(f"an EAGLE-3 head reads three target layers, not {ids!r}")
    layers = tuple(ids) if outputs else tuple(i - 1 for i in ids)
    for named, layer in zip(ids, layers, strict=True):
        if not 0 <= layer < target_layers:
            what = "output" if outputs else "input"
            raise SpecError(
                f"the head reads the {what} of layer {named}, which a target of "
                f"{target_layers} layers cannot hand (it needs layers 0..{target_layers - 1})"
            )
    return layers


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope base, scaling) as SpecForge's `get_rope_config` reads them: transformers 5's
    `rope_parameters` (base and scaling in one block) first, else `rope_theta` and
    `rope_scaling`. A scaling block is applied (SpecForge's Llama3, YaRN, linear, dynamic
    rotary embeddings; the head was trained with it), not ignored as mlx-vlm does."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and cfg.get("rope_scaling") is None:
        kind = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return float(theta), (params if kind != "default" else None)
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def _layer_args(cfg: dict, hidden: int) -> llama.ModelArgs:
    heads = int(cfg["num_attention_heads"])
    theta, scaling = rope_settings(cfg)
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=1,
        intermediate_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab_size=int(cfg.get("vocab_size") or 0),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


class FirstLayer(nn.Module):
    """EAGLE-3's decoder layer: attention over [input_layernorm(embedding); hidden_norm(h)]
    (2H in, H out), mlx-lm's llama attention and MLP."""

    def __init__(self, cfg: dict, norm_before_residual: bool):
        super().__init__()
        hidden = int(cfg["hidden_size"])
        args = _layer_args(cfg, hidden)
        wide = _layer_args(cfg, 2 * hidden)  # q, k, v read 2H; o_proj writes H
        self.self_attn = llama.Attention(wide)
        bias = bool(cfg.get("attention_bias", False))
        self.self_attn.o_proj = nn.Linear(args.num_attention_heads * args.head_dim, hidden, bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def __call__(self, embeds, h, mask, cache):
        if self.norm_before_residual:
            h = residual = self.hidden_norm(h)
        else:
            residual, h = h, self.hidden_norm(h)
        x = mx.concatenate([self.input_layernorm(embeds), h], axis=-1)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Embed:
    """The target's embedding, held outside the head's parameter tree (not counted twice)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, tokens):
        return self.module(tokens)


class TiedHead(Embed):
    """An embedding as the output head (a speculators head with tie_word_embeddings and no
    lm_head of its own, as mlx-vlm reads it): the head's own embedding, else the target's."""

    def __call__(self, x):
        return self.module.as_linear(x)


class Eagle3Head(nn.Module):
    def __init__(
        self, cfg: dict, target_hidden: int, draft_vocab: int, fc_bias: bool, tied: bool = False
    ):
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.hidden_size = hidden
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=fc_bias)
        self.midlayer = FirstLayer(cfg, bool(cfg.get("norm_before_residual", False)))
        extra = int(cfg.get("num_hidden_layers") or 1) - 1  # speculators: more plain layers
        self.layers = [llama.TransformerBlock(_layer_args(cfg, hidden)) for _ in range(extra)]
        self.norm = nn.RMSNorm(hidden, eps=float(cfg.get("rms_norm_eps", 1e-6)))
        if not tied:  # else the embedding, set at load (TiedHead)
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.input_norm = None  # speculators' norm_before_fc (gpt-oss heads): set at load
        self.layers_read: tuple = ()  # target layer-output ids, set at load
        self._to_target = None  # (draft_vocab,) target ids
        self._gather = None  # (target vocab,) -> draft id, or draft_vocab where none maps
        self.embed = None

    def make_cache(self) -> list:
        return [KVCache() for _ in range(1 + len(self.layers))]

    def fuse(self, hidden: dict) -> mx.array:
        """The target's three captured layers (rows, H each) -> fused features (rows, H)."""
        return self.fuse_joined(mx.concatenate([hidden[i] for i in self.layers_read], axis=-1))

    def fuse_joined(self, x: mx.array) -> mx.array:
        """The three layers already side by side (..., 3H) -> fused features (..., H)."""
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x.astype(self.fc.weight.dtype))

    def __call__(self, h: mx.array, tokens: mx.array, cache: list) -> mx.array:
        """Entries (features h (rows, H), the next tokens (rows,)) -> the head's output
        (rows, H), extending `cache`; the output is the next entry's features when chaining."""
        embeds = self.embed(tokens[None]).astype(h.dtype)
        x = h[None]
        mask = create_attention_mask(x, cache[0])
        x = self.midlayer(embeds, x, mask, cache[0])
        for layer, c in zip(self.layers, cache[1:], strict=True):
            x = layer(x, mask, c)
        return x[0]

    def rows(self, h: mx.array, tokens: mx.array, cache: list) -> mx.array:
        """Batched entries (a batch's rows, batch.py): features h (B, N, H), the next tokens
        (B, N) -> the head's output (B, N, H), extending `cache` (mlx-lm's BatchKVCache: its
        mask hides each row's left padding)."""
        embeds = self.embed(tokens).astype(h.dtype)
        mask = create_attention_mask(h, cache[0])
        x = self.midlayer(embeds, h, mask, cache[0])
        for layer, c in zip(self.layers, cache[1:], strict=True):
            x = layer(x, mask, c)
        return x

    def rows_logits(self, g: mx.array) -> mx.array:
        """`logits` over a batch's rows: (B, H) -> (B, target vocab)."""
        draft = self.lm_head(self.norm(g)).astype(mx.float32)
        none = mx.full((*draft.shape[:-1], 1), -mx.inf, mx.float32)
        return mx.take(mx.concatenate([draft, none], axis=-1), self._gather, axis=-1)

    def logits(self, g: mx.array) -> mx.array:
        """The head's output (H,) -> logits over the target's vocabulary: the draft
        vocabulary's logits scattered through d2t, -inf for every token it cannot propose."""
        draft = self.lm_head(self.norm(g)).astype(mx.float32)
        padded = mx.concatenate([draft, mx.array([-mx.inf], mx.float32)])
        return padded[self._gather]


def _load_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise SpecError(
                f"the head {path} ships PyTorch weights only; convert them to safetensors "
                "(e.g. safetensors.torch.save_file) first"
            )
        raise SpecError(f"the head {path} has no weights (no *.safetensors file)")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except (OSError, RuntimeError, ValueError) as err:
            raise SpecError(f"{file} is not readable safetensors: {err}") from None
    return weights


def _rename(weights: dict, speculators: bool) -> dict:
    """Published names -> this module's: `midlayer.*` (speculators: `layers.0.*`), further
    speculators layers `layers.N.*` -> `layers.(N-1).*`; a `model.` prefix dropped."""
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if speculators and key.startswith("layers."):
            index, rest = key[len("layers.") :].split(".", 1)
            key = f"midlayer.{rest}" if index == "0" else f"layers.{int(index) - 1}.{rest}"
        out[key] = value
    return out


def _float32(w: mx.array) -> mx.array:
    return w.astype(mx.float32) if w.dtype in (mx.float16, mx.bfloat16) else w


def load_head(path: Path, target, target_config: dict) -> Eagle3Head:
    if not (path / "config.json").is_file():
        raise SpecError(f"the head {path} has no config.json")
    config = json_object(path / "config.json", "config.json")
    speculators = "speculators_model_type" in config or "transformer_layer_config" in config
    cfg = config.get("transformer_layer_config", config) if speculators else config
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}/config.json: transformer_layer_config must be an object")
    if speculators and config.get("speculators_model_type", "eagle3") != "eagle3":
        raise SpecError(
            f"the head {path} is a speculators {config['speculators_model_type']!r} model, "
            "not eagle3"
        )
    cfg = {**cfg, **{k: config[k] for k in ("norm_before_residual",) if k in config}}
    tcfg = text_config(target_config)
    target_layers = int(tcfg["num_hidden_layers"])
    target_hidden = int(config.get("target_hidden_size") or tcfg["hidden_size"])
    vocab = int(tcfg["vocab_size"])
    weights = _rename(_load_weights(path), speculators)
    try:
        hidden = int(cfg["hidden_size"])
        refuse_other_eagles(path, weights, speculators)
        tied = "lm_head.weight" not in weights and bool(
            cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        )
        if tied:
            draft_vocab = int(config.get("draft_vocab_size") or vocab)
            if draft_vocab != vocab or "d2t" in weights:
                raise SpecError(
                    f"the head {path} ties its output head to the embedding but drafts over "
                    f"{draft_vocab} tokens, not the target's {vocab}"
                )
        elif "lm_head.weight" not in weights:
            raise KeyError("lm_head.weight")
        else:
            draft_vocab = int(weights["lm_head.weight"].shape[0])
        bias = "fc.bias" in weights
        head = Eagle3Head(cfg, target_hidden, draft_vocab, fc_bias=bias, tied=tied)
    except KeyError as err:
        raise SpecError(f"the head {path} lacks {err.args[0]} (is it an EAGLE-3 head?)") from None
    head.layers_read = capture_layers(config, target_layers)
    if "input_norm.weight" in weights:
        head.input_norm = nn.RMSNorm(3 * target_hidden, eps=float(cfg.get("rms_norm_eps", 1e-6)))
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)  # implied by d2t
    embed = weights.pop("embed_tokens.weight", None)
    for key in [k for k in weights if k.startswith(("verifier_", "embed_tokens."))]:
        weights.pop(key)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise SpecError(f"the head {path} does not fit its config.json: {err}") from None
    if not mx.metal.is_available():  # the CPU backend's half-precision matmuls are slow
        head.update(tree_map(_float32, head.parameters()))  # (measured: a step 2.6x faster)
    # the vocabulary check: every draft id must land on a token of the target
    ids = mx.arange(draft_vocab)
    if d2t is not None:
        if d2t.shape != (draft_vocab,):
            raise SpecError(f"the head's d2t has shape {d2t.shape}, not ({draft_vocab},)")
        ids = ids + d2t.astype(mx.int64)
    elif draft_vocab != vocab:
        raise SpecError(f"the head drafts {draft_vocab} tokens but has no d2t to map them")
    targets = ids.tolist()
    outside = [t for t in targets if not 0 <= t < vocab]
    if outside:
        raise SpecError(
            f"the head's d2t maps draft tokens outside the target's vocabulary of {vocab} "
            f"(e.g. to {outside[0]}): it was made for another target"
        )
    if len(set(targets)) != len(targets):
        raise SpecError("the head's d2t maps two draft tokens to the same target token")
    head._to_target = mx.array(targets, mx.uint32)
    gather = mx.full((vocab,), draft_vocab, mx.uint32)
    gather[head._to_target] = mx.arange(draft_vocab, dtype=mx.uint32)
    head._gather = gather
    if embed is not None:
        if embed.shape[1] != hidden:
            raise SpecError(f"the head's embedding is {embed.shape[1]} wide, not {hidden}")
        module = nn.Embedding(embed.shape[0], hidden)
        module.weight = embed
        head.embedding = module  # the head's own: part of its weights
        head.embed = Embed(module)
    else:
        stack = decoder_stack(target)
        module = stack.get("embed_tokens")
        if not isinstance(module, nn.Module):
            raise SpecError("the head ships no embedding and the target's cannot be found")
        if int(tcfg["hidden_size"]) != hidden:
            raise SpecError(
                f"the head is {hidden} wide and ships no embedding; the target's is "
                f"{tcfg['hidden_size']} wide"
            )
        head.embed = Embed(module)
    if tied:
        head.lm_head = TiedHead(module)
    head.eval()
    return head


def refuse_other_eagles(path: Path, weights: dict, speculators: bool) -> None:
    """One line for the EAGLE heads that are not EAGLE-3 as read here: EAGLE-1 / EAGLE-2
    (`layers.0.*` and an `fc` over [embedding; features], 2H -> H, no `midlayer`; SafeAILab's
    EAGLE and EAGLE-2 checkpoints) and EAGLE-3 heads with a Qwen3-style layer (q_norm)."""
    if any(k.startswith("midlayer.self_attn.q_norm") for k in weights):
        raise SpecError(f"the head {path} has a Qwen3-style layer (q_norm): not supported")
    if not speculators and not any(k.startswith("midlayer.") for k in weights):
        if any(k.startswith("layers.0.") for k in weights):
            raise SpecError(
                f"the head {path} is an EAGLE-1 / EAGLE-2 head (layers.0.*, no midlayer): "
                "only EAGLE-3 heads are supported"
            )


# ----------------------------------------------------------------------------- the drafter


class EagleDrafter(Drafter):
    """Between rounds: the target's features are known for positions 0..H-1 of `tokens`
    (H = `self.rows`), usually all but the last token. The head's cache holds the entries
    0..c-1 (c = `self.entries`), each made from the target's own features; `pending` holds
    the fused features of positions c..H-1, fed (batched) at the next proposal, and `last` the
    head's output at entry c-1, from which the next token is predicted. A proposal's chained
    entries (the head's own features for tokens it drafted) are forgotten at commit; the
    features of a rejected round's kept tokens on a recurrent target come from the pass that
    verified them (valid before the rejection), not from the one that replays them."""

    def __init__(self, head: Eagle3Head):
        self.head = head
        self.hidden_layers = head.layers_read
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.make_cache()
        self.tokens: list[int] = []
        self.rows = 0
        self.entries = 0
        self.pending: mx.array | None = None  # (rows - entries, H)
        self.last: mx.array | None = None  # (H,) the head's output at entry entries-1
        self.last_fused: mx.array | None = None  # (H,) the fused features at entries-1
        # the position of the next pass's first row (a recurrent target's replay comes first;
        # None: unknown until the next prefill)
        self.target_at: int | None = None

    def fork(self) -> EagleDrafter:
        twin = copy.copy(self)  # the head shared; rows, entries: ints
        twin.cache = caches.copy(self.cache)
        twin.tokens = list(self.tokens)
        twin.pending, twin.last, twin.last_fused = caches.fresh(
            (self.pending, self.last, self.last_fused)
        )
        return twin

    # -- feeding the target's features

    def _take(self, output, count: int, start: int = 0) -> None:
        if count <= 0:
            return
        rows = {i: output.hidden[i][start : start + count] for i in self.hidden_layers}
        self._append(self.head.fuse(rows))

    def _append(self, fused: mx.array) -> None:
        self.pending = fused if self.pending is None else mx.concatenate([self.pending, fused])
        self.rows += fused.shape[0]

    def _feed(self) -> None:
        """Make entries of every pending row (the tokens after each are known)."""
        if self.pending is None:
            return
        for start in range(0, self.pending.shape[0], CHUNK):
            rows = self.pending[start : start + CHUNK]
            first = self.entries + 1  # entry j pairs features j with token j+1
            tokens = mx.array(self.tokens[first : first + rows.shape[0]], mx.uint32)
            out = self.head(rows, tokens, self.cache)
            self.entries += rows.shape[0]
            self.last, self.last_fused = out[-1], rows[-1]
            if start + CHUNK < self.pending.shape[0]:
                mx.eval(self.last, self._cache_arrays())
        self.pending = None

    def _forget(self) -> None:
        """Drop the proposal's chained entries: the cache holds the real entries only."""
        extra = self.cache[0].offset - self.entries
        if extra > 0:
            for c in self.cache:
                c.trim(extra)

    def prefill(self, tokens, timed=False, output=None):
        fed = output.fed if output is not None else 0
        reuse = len(tokens) - 1 - fed  # the target handed features from this position on
        same = common_prefix_len(self.tokens, tokens)
        keep = max(min(self.rows, same, reuse), 0)  # positions whose features still hold
        entries = max(min(self.entries, keep, same - 1), 0)  # entries whose next token holds
        # the features of positions entries..reuse-1, to be fed again or for the first time
        parts, pos = [], entries
        if pos < keep and pos == self.entries - 1 and self.last_fused is not None:
            parts.append(self.last_fused[None])  # the last entry, its next token changed
            pos += 1
        if pos < keep and pos >= self.entries and self.pending is not None:
            parts.append(self.pending[pos - self.entries : keep - self.entries])
            pos = keep
        if pos < reuse:  # features no longer at hand (a turn the target decoded alone):
            # zeros, so positions stay aligned; the head drafts worse there, never wrongly
            parts.append(mx.zeros((reuse - pos, self.head.hidden_size), self.head.fc.weight.dtype))
        self._forget()
        for c in self.cache:
            c.trim(c.offset - entries)
        if entries < self.entries:
            self.last = self.last_fused = None  # of an entry now gone
        self.entries = self.rows = entries
        self.pending, self.tokens = None, list(tokens)
        for part in parts:
            self._append(part)
        self._take(output, fed)
        self.target_at = len(tokens) - 1
        self._feed()
        seconds = 0.0
        if timed and self.last is not None:  # one draft step, timed as prefill_cache does
            for _ in range(2):  # the first pays the one-time costs of the shape
                start = time.perf_counter()
                g = self.head(self.last[None], mx.array(tokens[-1:], mx.uint32), self.cache)
                mx.eval(self.head.logits(g[0]))
                seconds = time.perf_counter() - start
                self._forget()
        return seconds

    def catch_up(self) -> None:
        self._feed()
        if self.last is not None:
            mx.eval(self.last, self._cache_arrays())

    # -- a round

    def propose(self, k, params, key, *, processors=()):
        self.steps = 0
        if k == 0:
            return mx.zeros((0,), mx.uint32), None
        self._feed()
        if self.last is None:  # nothing known yet (a one-token prompt): draft nothing
            return mx.zeros((0,), mx.uint32), None
        g = self.last
        # tokens a recurrent target is replaying have no features yet: chain through them
        for token in self.tokens[self.entries + 1 :]:
            g = self.head(g[None], mx.array([token], mx.uint32), self.cache)[0]
            self.steps += 1
        keys = None if params.greedy else mx.random.split(key, k)
        context = self.tokens if processors else None
        drafted, qs = [], []
        for i in range(k):
            if i > 0:  # the head's own output is the features of the token it drafted
                g = self.head(g[None], drafted[-1], self.cache)[0]
            logits = self.head.logits(g)
            if processors:
                so_far = mx.concatenate(drafted) if drafted else []
                logits = apply_processors(processors, context, so_far, logits)
            self.steps += 1
            y, q = draw(logits, params, None if keys is None else keys[i])
            if q is not None:
                qs.append(q)
            mx.async_eval(y)
            drafted.append(y)
        return mx.concatenate(drafted), (mx.stack(qs) if qs else None)

    def commit(self, kept, output=None):
        self._forget()
        before = len(self.tokens)
        self.tokens += kept
        if output is None or self.target_at is None:
            self.target_at = None  # unknown until the next prefill
            return
        first = self.target_at
        # rows of tokens now in the sequence (its last but one at most), of which the head has
        # the first `have`: a recurrent target that went back (output.kept = 0) computed them
        # right all the same (the rows before the rejection), so they are taken now, not
        # from the pass that replays them
        valid, have = before - first + len(kept) - 1, self.rows - first
        if valid > have >= 0:
            self._take(output, valid - have, have)
        self.target_at = first + output.kept

    def disk_state(self) -> tuple[list, dict]:
        """The head's KV cache, then one ArraysCache of (pending, last, last_fused)."""
        figures = {"kind": type(self).__name__, "tokens": self.tokens, "rows": self.rows,
                   "entries": self.entries, "target_at": self.target_at}  # fmt: skip
        return [*self.cache, arrays_layer([self.pending, self.last, self.last_fused])], figures

    def restore_disk_state(self, layers: list, figures: dict, target: list) -> None:
        kind = type(self).__name__
        figures = {"kind": kind, **figures}  # (files written before the figures named it)
        tokens, rows, entries, at = head_figures(
            figures, kind, "tokens", "rows", "entries", "target_at"
        )
        head_layers(layers, [KVCache] * len(self.cache) + [ArraysCache], kind)
        *cache, extra = layers
        for c in cache:
            check_kv(c, None, None, kind)
        if len(extra.cache) != 3:
            raise SpecError(f"the stored {kind} features are {len(extra.cache)} arrays, not 3")
        pending, last, last_fused = extra.cache
        width = self.head.hidden_size
        check_rows(pending, width, kind, "pending features")
        for a in (last, last_fused):
            if a is not None and a.shape != (width,):
                raise SpecError(f"the stored {kind} features have shape {a.shape}, not ({width},)")
        if any(c.offset != int(entries) for c in cache):
            raise SpecError(f"the stored {kind} cache does not hold its {entries} entries")
        self.cache = cache
        self.pending, self.last, self.last_fused = pending, last, last_fused
        self.tokens = [int(t) for t in tokens]
        self.rows, self.entries = int(rows), int(entries)
        self.target_at = None if at is None else int(at)

    def _cache_arrays(self) -> list:
        return [a for c in self.cache if c.keys is not None for a in (c.keys, c.values)]

    def settle(self) -> None:
        arrays = [a for a in (self.pending, self.last, self.last_fused) if a is not None]
        mx.eval(arrays, self._cache_arrays())

    def cache_bytes(self) -> int:
        pending = [self.pending] if self.pending is not None else []
        return sum(a.nbytes for a in self._cache_arrays() + pending)
