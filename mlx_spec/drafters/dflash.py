"""DFlash block drafters (z-lab): one forward drafts a whole block from the target's features.

A DFlash head (https://github.com/z-lab/dflash, checkpoints in the hub collection z-lab/dflash)
is a few decoder layers with no embedding and no output head of their own: they use the
target's. Its context is the target's hidden states at `dflash_config.target_layer_ids` (each
id a layer's output, 0-based, as `hidden_states[id + 1]` in transformers), concatenated in that
order, projected by `fc` and normed by `hidden_norm`. Each attention layer projects those
context features to keys and values (kept in a cache: they depend on the features only, not on
the layer's input), and its queries — the block `[last token, mask × (block_size - 1)]`,
embedded by the target — attend to the whole context and to the block itself, non-causally.
The final `norm` and the target's head turn block row i >= 1 into the guess for the token i
places after the last one: the whole block in one forward. The weights are named as z-lab
publishes them (`fc`, `hidden_norm`, `layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`,
`layers.N.mlp.{gate,up,down}_proj`, the two layer norms, `norm`); config.json is a Qwen3
config with `block_size`, `num_target_layers` and `dflash_config = {target_layer_ids,
mask_token_id}`. This follows z-lab's `dflash/model_mlx.py` (and its `model.py`).

The block is always the checkpoint's `block_size` (what the head was trained on: a shorter block
changes what the non-causal attention sees); the controller chooses how many of its guesses the
target verifies (`propose(k)` returns the first k). Guesses are drawn per position from the
processed, transformed logits: q at position i is the distribution its token was drawn from,
so rejection sampling stays exact even though the head does not condition position i on the
tokens drawn before it. Processors (penalties, the grammar mask) run position by position with
the block's earlier guesses as `proposed`, as in a model draft, so a grammar is handled too
(a host sync per drafted position under one, as for a draft model).

The context cache holds the projected features of every token of the sequence but the last,
at its position: rows come from the prefill and each verify or plain pass (`TargetOutput`), only
the ones of tokens now in the sequence, which always end just before its last token (after a
rejected round on a recurrent target too: the rows before the rejection are right); a stretch
where the drafter saw nothing (a reply decoded without it) leaves a gap, which costs guesses,
never exactness.

DSpark heads (dspark.py) are this head and drafter with two hooks: the block row that guesses
the next token (`DFlashHead.first_row`: 1 here, 0 there) and a per-position step over the guess
drawn before (`DFlashDrafter._step_logits`, `chained`: DSpark's Markov head). DFlash2 heads
(dflash2.py, read by this kind when the config says so) add their own layer and propose.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..core import caches
from ..core.cache_files import arrays_layer, check_kv, check_rows, head_figures, head_layers
from ..core.hidden import decoder_stack, layer_list
from ..core.processors import apply as apply_processors
from ..core.sampling import SamplingParams, probabilities, sample
from ..errors import SpecError
from ..models.model_dir import text_config
from .base import Drafter
from .head_weights import load_head_weights, read_head_config


class DFlashArgs:
    """The fields of a z-lab DFlash config.json the forward needs."""

    name = "DFlash"  # in error messages (DSparkArgs: "DSpark")
    neox_rope = True  # rope pairing when the config has no rope_is_neox_style (the peers' too)

    def __init__(self, cfg: dict):
        dflash = cfg.get("dflash_config") or {}
        name = self.name
        if not isinstance(dflash, dict):
            raise SpecError(f"the {name} config.json's dflash_config is not an object")
        refuse_other_layouts(cfg, dflash, name)
        try:
            self.hidden_size = int(cfg["hidden_size"])
            self.num_hidden_layers = int(cfg["num_hidden_layers"])
            self.num_attention_heads = int(cfg["num_attention_heads"])
            self.num_key_value_heads = int(
                cfg.get("num_key_value_heads") or self.num_attention_heads
            )
            self.head_dim = int(cfg.get("head_dim") or self.hidden_size // self.num_attention_heads)
            self.intermediate_size = int(cfg["intermediate_size"])
            self.rms_norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
            self.block_size = int(cfg.get("block_size") or dflash["block_size"])
            if "mask_token_id" not in dflash:
                raise KeyError("dflash_config.mask_token_id")
            self.mask_token_id = dflash["mask_token_id"]
        except KeyError as err:
            raise SpecError(f"the {name} config.json has no {err.args[0]}") from None
        except (TypeError, ValueError, ZeroDivisionError) as err:
            raise SpecError(f"the {name} config.json has a bad field: {err}") from None
        ids = dflash.get("target_layer_ids")
        if ids is None and "num_target_layers" in cfg:  # z-lab's default spread
            ids = default_layer_ids(int(cfg["num_target_layers"]), self.num_hidden_layers)
        if not isinstance(ids, list) or not ids:
            raise SpecError(f"the {name} config.json has no dflash_config.target_layer_ids")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise SpecError(f"{name} target_layer_ids must be integers, got {ids}")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int):
            raise SpecError(f"{name} mask_token_id must be an integer, got {self.mask_token_id!r}")
        self.target_layer_ids = tuple(ids)
        self.attention_bias = bool(cfg.get("attention_bias", False))
        rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope settings here
        self.rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        self.rope_scaling = scaling
        self.max_position_embeddings = cfg.get("max_position_embeddings")
        # mlx-vlm reads the pairing from `rope_is_neox_style` (split halves); MLX calls the
        # other one, interleaved pairs, "traditional"
        self.rope_traditional = not bool(cfg.get("rope_is_neox_style", self.neox_rope))


def is_dflash2(cfg: dict) -> bool:
    """DFlash2 (z-lab, 2026-08; dflash2.py) is not DFlash with other settings: its layers add
    two-tap dynamic convolutions and a candidate selector picks among each position's top
    candidates. Its config says so (architectures, selector and convolution fields)."""
    dflash = cfg.get("dflash_config")
    dflash = dflash if isinstance(dflash, dict) else {}
    arch = " ".join(str(a) for a in cfg.get("architectures") or [])
    return "DFlash2" in arch or "selector_top_k" in dflash or "conv_kernel_size" in dflash


def refuse_other_layouts(cfg: dict, dflash: dict, name: str) -> None:
    """A DFlash2 head read as DSpark, or a DSpark head (a Markov head: `markov_rank`) read as
    DFlash, is pointed at its kind in one line, not refused as weights that do not fit."""
    if name == "DSpark" and is_dflash2(cfg):
        raise SpecError("this is a DFlash2 head, not a DSpark head: use --drafter dflash")
    rank = cfg.get("markov_rank", dflash.get("markov_rank"))
    if name == "DFlash" and isinstance(rank, int) and rank > 0:
        raise SpecError("this is a DSpark head (it has a Markov head): use --drafter dspark")


def default_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """z-lab's `build_target_layer_ids`: the layers a head reads when its config names none."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [round(start + i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)]


class DFlashAttention(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        dim, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = d**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, dim, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def keys_values(self, x: mx.array, rope, offset: int) -> tuple[mx.array, mx.array]:
        """(1, L, dim) -> keys (rotated to positions offset..) and values, (1, kv, L, d)."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x: mx.array, rope, offset: int, cache: KVCache) -> mx.array:
        """The block x (1, L, dim) at positions offset.. over the cached context, unmasked."""
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=offset)
        keys, values = self.keys_values(x, rope, offset)
        if cache.offset:
            ctx_k, ctx_v = cache.keys_and_values()
            keys = mx.concatenate([ctx_k, keys], axis=2)
            values = mx.concatenate([ctx_v, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.self_attn = DFlashAttention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, rope, offset, cache):
        h = x + self.self_attn(self.input_layernorm(x), rope, offset, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """The head's own weights (no embedding, no output head: the target's are used)."""

    args_type = DFlashArgs
    layer_type = DFlashLayer
    first_row = 1  # the block row that guesses the next token (DSpark's anchor row guesses)
    own_vocab = False  # tables over the vocabulary (DSpark, DFlash2): the target's must match

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        n = len(args.target_layer_ids)
        self.fc = nn.Linear(n * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_type(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self._rope = initialize_rope(
            args.head_dim,
            args.rope_theta,
            args.rope_traditional,
            args.rope_scaling,
            args.max_position_embeddings,
        )

    def add_context(self, features: mx.array, offset: int, cache: list[KVCache]) -> None:
        """The target's concatenated features (rows, n * hidden) of positions offset.. into
        every layer's context cache."""
        ctx = self.hidden_norm(self.fc(features))[None]
        for layer, c in zip(self.layers, cache, strict=True):
            c.update_and_fetch(*layer.self_attn.keys_values(ctx, self._rope, offset))

    def __call__(self, x: mx.array, offset: int, cache: list[KVCache]) -> mx.array:
        """The embedded block (1, L, hidden) at positions offset.. -> normed hidden states."""
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, self._rope, offset, c)
        return self.norm(x)

    @classmethod
    def check_target(cls, args: DFlashArgs, tcfg: dict) -> None:
        """Refuse (one line) a head made for another model than this target config's."""
        hidden = tcfg.get("hidden_size")
        if hidden is not None and int(hidden) != args.hidden_size:
            raise SpecError(
                f"the {args.name} head's hidden size is {args.hidden_size}, the target's "
                f"{hidden}: a head for another model"
            )
        vocab = tcfg.get("vocab_size")
        if cls.own_vocab and vocab is not None and int(vocab) != args.vocab_size:
            raise SpecError(
                f"the {args.name} head's vocabulary is {args.vocab_size} tokens, the target's "
                f"{vocab}: a head for another model"
            )
        if vocab is not None and not 0 <= args.mask_token_id < int(vocab):
            raise SpecError(
                f"the {args.name} mask token {args.mask_token_id} is outside the target's "
                f"vocabulary ({vocab} tokens)"
            )

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """Published names -> this module's: some exports prefix every name with `model.`."""
        return {k.removeprefix("model."): v for k, v in weights.items()}


def short_block(name: str, least: int, size: int) -> SpecError:
    plural = "s" if least > 1 else ""
    return SpecError(f"a {name} block must hold at least {least} token{plural}, got {size}")


def target_io(target):
    """The target's token embedding and output head, as the DFlash reference binds them."""
    stack = decoder_stack(target)
    embed = stack.get("embed_tokens")
    if not isinstance(embed, nn.Module):
        raise SpecError(f"this {type(target).__name__} has no embed_tokens for a DFlash head")
    for node in (target, target.get("language_model")):
        if isinstance(node, nn.Module) and isinstance(node.get("lm_head"), nn.Module):
            return embed, node["lm_head"]
    return embed, embed.as_linear  # tied embeddings


class DFlashDrafter(Drafter):
    """Drafts `block_size - 1` tokens in one forward of the head; see the module's notes."""

    chained = False  # whether a guess depends on the guess before it (DSpark's Markov head)

    def __init__(self, head: DFlashHead, target, block_size: int | None = None):
        self.head = head
        self.embed, self.lm_head = target_io(target)
        self.block_size = block_size or head.args.block_size
        self.first_row = head.first_row
        self.max_draft = self.block_size - self.first_row
        if self.max_draft < 1:
            raise short_block(head.args.name, self.first_row + 1, self.block_size)
        self.hidden_layers = head.args.target_layer_ids
        self.mask = head.args.mask_token_id
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        self.cache = [KVCache() for _ in self.head.layers]
        self.spans: list[list[int]] = []  # [first position, rows] of the cached context
        self.pending: list[tuple[int, mx.array]] = []  # (first position, features) to add
        self.tokens: list[int] = []  # the sequence as the drafter knows it
        self.target_at: int | None = None  # the position of the next pass's first row

    def fork(self) -> DFlashDrafter:
        twin = copy.copy(self)  # the head, embedding and lm_head shared
        twin.cache = caches.copy(self.cache)
        twin.spans = [list(span) for span in self.spans]
        twin.pending = [(start, caches.fresh(rows)) for start, rows in self.pending]
        twin.tokens = list(self.tokens)
        return twin

    # ------------------------------------------------------------------ the context

    def _end(self) -> int:
        """The position after the last context row, cached or pending."""
        if self.pending:
            start, rows = self.pending[-1]
            return start + rows.shape[0]
        return self.spans[-1][0] + self.spans[-1][1] if self.spans else 0

    def _cut(self, position: int) -> None:
        """Forget the context rows at `position` and after."""
        while self.pending and self.pending[-1][0] >= position:
            self.pending.pop()
        if self.pending:
            start, rows = self.pending[-1]
            if start + rows.shape[0] > position:
                self.pending[-1] = (start, rows[: position - start])
            return
        drop = 0
        while self.spans and self.spans[-1][0] >= position:
            drop += self.spans.pop()[1]
        if self.spans and sum(self.spans[-1]) > position:
            drop += sum(self.spans[-1]) - position
            self.spans[-1][1] = position - self.spans[-1][0]
        if drop:
            for c in self.cache:
                c.trim(drop)

    def _take(self, output, count: int | None = None) -> None:
        """The target's first `count` rows (`kept`: the tokens just before the sequence's
        last one), placed to end there."""
        count = output.kept if output is not None and count is None else count
        if output is None or not count:
            return
        rows = mx.concatenate([output.hidden[i][:count] for i in self.hidden_layers], -1)
        start = len(self.tokens) - 1 - count
        self._cut(start)
        if self.pending and self._end() == start:  # contiguous: one pass adds them all
            first, before = self.pending[-1]
            self.pending[-1] = (first, mx.concatenate([before, rows]))
        else:
            self.pending.append((start, rows))

    def _flush(self) -> None:
        """Project the pending rows into the context cache (one pass per contiguous run)."""
        for start, rows in self.pending:
            self.head.add_context(rows, start, self.cache)
            if self.spans and sum(self.spans[-1]) == start:
                self.spans[-1][1] += rows.shape[0]
            else:
                self.spans.append([start, rows.shape[0]])
        self.pending = []

    # ------------------------------------------------------------------ the Drafter calls

    def prefill(self, tokens, timed=False, output=None):
        fed = output.fed if output is not None else 0
        self.tokens = list(tokens)
        # the target was fed prompt[reuse:-1]: context before `reuse` is the previous reply's
        self._cut(len(tokens) - 1 - fed)
        self._take(output)
        self.target_at = len(tokens) - 1
        if not timed:
            return 0.0
        self._flush()
        caches.eval_state(self.cache)
        seconds = None
        for _ in range(2):  # the first pays one-time costs (allocation, compilation)
            start = time.perf_counter()
            # the whole greedy draft: a chained head's (DSpark's) steps after the forward too
            mx.eval(self.propose(self.max_draft, SamplingParams(), None)[0])
            seconds = time.perf_counter() - start
        return seconds

    def _block_hidden(self, k: int) -> mx.array:
        """The head's normed states for the k positions after the last token (k, hidden)."""
        self._flush()
        block = mx.array([self.tokens[-1]] + [self.mask] * (self.block_size - 1), mx.uint32)
        h = self.head(self.embed(block[None]), len(self.tokens) - 1, self.cache)
        return h[0, self.first_row : self.first_row + k]

    def _block_logits(self, k: int) -> mx.array:
        """The head's logits for the k positions after the last token (k, vocab), lazy."""
        return self.lm_head(self._block_hidden(k))

    def _step_logits(self, logits: mx.array, previous: mx.array) -> mx.array:
        """Position i's logits given the guess before it (`previous`, (1,)): DFlash's do
        not depend on it (DSpark adds its Markov head's bias)."""
        return logits

    def propose(self, k, params, key, *, processors=()):
        k = min(k, self.max_draft)
        self.steps = int(k > 0)
        if k <= 0:
            return mx.zeros((0,), mx.uint32), None
        logits = self._block_logits(k)
        if not processors and not self.chained:
            if params.greedy:
                return mx.argmax(logits, axis=-1).astype(mx.uint32), None
            q = probabilities(logits, params)
            return sample(q, key).astype(mx.uint32), q
        # each position after the context and the block's earlier guesses (processors.py); a
        # chained head's q at i is the distribution given the guess actually drawn at i - 1
        keys = None if params.greedy else mx.random.split(key, k)
        drafted, qs = [], []
        previous = mx.array([self.tokens[-1]], mx.uint32)
        for i in range(k):
            row = self._step_logits(logits[i], previous)
            if processors:
                so_far = mx.concatenate(drafted) if drafted else []
                row = apply_processors(processors, self.tokens, so_far, row)
            if params.greedy:
                drafted.append(mx.argmax(row, axis=-1, keepdims=True).astype(mx.uint32))
            else:
                q = probabilities(row, params)
                drafted.append(sample(q, keys[i]).reshape(1).astype(mx.uint32))
                qs.append(q)
            previous = drafted[-1]
        return mx.concatenate(drafted), (mx.stack(qs) if qs else None)

    def commit(self, kept, output=None):
        before = len(self.tokens)
        self.tokens += kept
        if output is None or self.target_at is None:
            self._take(output)
            return
        # every row of a token now in the sequence (its last excluded): a recurrent target
        # that went back (output.kept = 0) computed the rows before the rejection right all
        # the same, so they are taken now, not from the pass that replays them
        first = self.target_at
        self._take(output, before - first + len(kept) - 1)
        self.target_at = first + output.kept

    def catch_up(self) -> None:
        self._flush()

    def disk_state(self) -> tuple[list, dict]:
        """The context cache (a KVCache a layer: the projected features of every position
        but the last), then the rows still to project, if any (one ArraysCache; `settle`
        projects them, so a kept decoder has none); the cached spans, the pending rows'
        positions, the tokens and `target_at` as figures. DSpark and DFlash2 keep the same."""
        layers = list(self.cache)
        if self.pending:
            layers.append(arrays_layer([rows for _, rows in self.pending]))
        figures = {"kind": type(self).__name__, "tokens": self.tokens, "spans": self.spans,
                   "pending": [start for start, _ in self.pending],
                   "target_at": self.target_at}  # fmt: skip
        return layers, figures

    def restore_disk_state(self, layers: list, figures: dict, target: list) -> None:
        kind = type(self).__name__
        tokens, spans, starts, at = head_figures(
            figures, kind, "tokens", "spans", "pending", "target_at"
        )
        extra = [ArraysCache] if starts else []
        head_layers(layers, [KVCache] * len(self.head.layers) + extra, kind)
        args = self.head.args
        cache = layers[: len(self.head.layers)]
        try:
            spans = [[int(a), int(b)] for a, b in spans]
        except (TypeError, ValueError):
            raise SpecError(f"the stored {kind} spans are not [start, rows] pairs") from None
        for c in cache:
            check_kv(c, args.num_key_value_heads, args.head_dim, kind)
            if c.offset != sum(rows for _, rows in spans):
                raise SpecError(f"the stored {kind} cache does not hold its spans' rows")
        pending = []
        if starts:
            if len(layers[-1].cache) != len(starts):
                raise SpecError(f"the stored {kind} state has {len(starts)} pending positions "
                                f"for {len(layers[-1].cache)} arrays")  # fmt: skip
            width = len(self.hidden_layers) * args.hidden_size
            for start, rows in zip(starts, layers[-1].cache, strict=True):
                if rows is None:
                    raise SpecError(f"the stored {kind} pending rows are missing")
                check_rows(rows, width, kind, "pending rows")
                pending.append((int(start), rows))
        self.cache, self.spans, self.pending = cache, spans, pending
        self.tokens = [int(t) for t in tokens]
        self.target_at = None if at is None else int(at)

    def settle(self) -> None:
        self._flush()
        caches.eval_state(self.cache)

    def cache_bytes(self) -> int:
        return caches.nbytes(self.cache)


def load_head(
    path: Path, target, target_config: dict, head_type=DFlashHead, variants=()
) -> DFlashHead:
    """A z-lab DFlash directory (or another block head's: `head_type`, DSpark's; or one of
    `variants` whose `matches(config)`, DFlash2's) -> the head, checked against the target
    (one-line errors)."""
    path = Path(path)
    config = read_head_config(path, head_type.args_type.name)
    head_type = next((v for v in variants if v.matches(config)), head_type)
    name = head_type.args_type.name
    args = head_type.args_type(config)
    least = 1 + getattr(args, "first_row", head_type.first_row)  # at least one guess
    if args.block_size < least:
        raise short_block(name, least, args.block_size)
    depth = len(layer_list(target))
    bad = [i for i in args.target_layer_ids if not 0 <= i < depth]
    if bad:
        raise SpecError(
            f"the {name} head reads target layer {bad[0]}, but the target has {depth} layers"
        )
    head_type.check_target(args, text_config(target_config))
    head = head_type(args)
    load_head_weights(head, path, config, name, head.sanitize)
    return head
