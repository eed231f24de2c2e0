"""Gemma 4 assistant drafters: Google's multi-token-prediction "assistant" checkpoints.

Google ships a small drafter beside each Gemma 4 model (HF `model_type: gemma4_assistant`;
`mlx-community/gemma-4-31B-it-assistant-bf16`, `…-26B-A4B-it-assistant-bf16`, the E2B / E4B
ones). It reads the target twice over, never running a pass of its own over the context:

- **No KV cache**: each of its few decoder layers of type T (`full_attention` or
  `sliding_attention`) attends to the keys and values of the target's last layer of type T
  that computes its own (not one that shares an earlier layer's: Gemma 4's
  `num_kv_shared_layers`), as mlx-lm's `Gemma4TextModel` picks them (`kvs_by_type`). Its
  layers have queries only (`q_proj`, `q_norm`, `o_proj`).
- **One query position**: after the target committed positions 0..P-1 and its token b at P
  is known, the round's hidden state is the target's final-norm output at P-1 (the row that
  predicted b), and every draft step's query is rotated at P, b's own position (the token
  whose embedding goes in; Hugging Face's `position_ids`). A step embeds its input token
  with the *target's* embedding (times Gemma's `sqrt(hidden)`), concatenates the previous
  step's state (`[embedding, state]`), projects it (`pre_projection`, 2·backbone → hidden),
  runs the layers over the target's keys and values (every key visible: no mask), then
  `model.norm`, the logits from the drafter's own tied embedding (no soft-cap), and the next
  state `post_projection` (hidden → backbone). k steps chain on the tokens drawn.
- The keys and values: a full-attention layer's of positions 0..P-1; a sliding one's of the
  last `sliding_window - 1` positions (what the target's own next query sees besides itself;
  HF's sliding cache keeps window - 1). The pass that verified the last round names the
  target layers' caches (`hidden.kv_of`); the drafter reads them when it drafts, after the
  round's roll-back — exact after any mix of accepts and rejects, nothing copied, and no view
  of their buffers held across a pass (a held view makes the pass's write copy the buffer).
- E2B / E4B (`use_ordered_embeddings`): a centroid head (`masked_embedding`): the hidden
  state scores `num_centroids` token clusters, the `centroid_intermediate_top_k` best
  clusters' tokens (`token_ordering`) get their logits and every other token the smallest of
  those minus 1 (as HF's `Gemma4AssistantMaskedEmbedder` and mlx-vlm's `MaskedEmbedder`).
  Those full-vocabulary logits are what a guess is drawn from, so they are the q the verifier
  divides by.

Which keys and which query position (settled 2026-12-06 against transformers 5.25.0's
`gemma4_assistant` and `SinglePositionMultiTokenCandidateGenerator`, mlx-vlm 0.7.10's
`_mtp_rounds` and mlx-lm's own sliding attention): the drafter's step stands in for the target
processing b at P, so it sees what the target's layer of the same type sees from P, less b's
own key (not computed yet): full attention 0..P-1, sliding P-window+1..P-1 (mlx-lm's
RotatingKVCache and mask keep `window` keys with the query's own). The query at P as Hugging
Face rotates it; mlx-vlm rotates it at P-1 (one position off). Hugging Face's key sets are an
artefact of slicing: its sliding keys are the last window-1+n of the verify pass (n fed), cut
by `[:P+1]` from their start (a no-op past the window) and masked `|q-k| <= window`, so it
sees window+1 keys at steady state, and after a rejection the rejected guesses' rows (a full
layer one of them: `[:P+1]`); mlx-vlm sees `window` (`|q-k| < window` from P-1). None of
these can change the output (the verifier checks every guess), only acceptance.

The layers are mlx-lm's own `gemma4_text.DecoderLayer`, built from the drafter's
`text_config` with `num_kv_shared_layers = num_hidden_layers` (no key/value projections;
called with `shared_kv=` and `offset=`). Semantics after mlx-vlm's
`speculative/drafters/gemma4_assistant` and its `_mtp_rounds`.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from ..core import caches
from ..core.cache_files import arrays_layer, head_figures, head_layers
from ..core.hidden import FINAL_NORM, decoder_stack, kv_of
from ..core.processors import apply as apply_processors
from ..core.sampling import draw
from ..errors import SpecError
from .base import Drafter
from .head_weights import load_head_weights, read_head_config

NAME = "Gemma 4 assistant"
TYPES = ("full_attention", "sliding_attention")
# read, not used: the tied head's copy (tie_word_embeddings)
DROPPED = ("lm_head.",)


class AssistantArgs:
    """A gemma4_assistant config.json: the top level's fields and the layers' text_config."""

    def __init__(self, cfg: dict):
        if cfg.get("model_type") != "gemma4_assistant":
            raise SpecError(
                f"the {NAME} head's config.json says model_type {cfg.get('model_type')!r}, "
                "not 'gemma4_assistant'"
            )
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise SpecError(f"the {NAME} head's config.json has no text_config")
        try:
            self.backbone_hidden_size = int(cfg["backbone_hidden_size"])
            self.ordered = bool(cfg.get("use_ordered_embeddings", False))
            self.num_centroids = int(cfg.get("num_centroids", 2048))
            self.top_k = int(cfg.get("centroid_intermediate_top_k", 32))
            self.tied = bool(cfg.get("tie_word_embeddings", True))
            layers = int(text["num_hidden_layers"])
            self.vocab_size = int(text["vocab_size"])
            self.hidden_size = int(text["hidden_size"])
            types = text.get("layer_types")
        except KeyError as err:
            raise SpecError(f"the {NAME} head's config.json has no {err.args[0]}") from None
        except (TypeError, ValueError) as err:
            raise SpecError(f"the {NAME} head's config.json has a bad field: {err}") from None
        if not self.tied:
            raise SpecError(f"only {NAME} heads with a tied output head are supported")
        if not isinstance(types, list) or len(types) != layers or set(types) - set(TYPES):
            raise SpecError(
                f"the {NAME} head's text_config.layer_types must name {layers} layers, each "
                f"one of {', '.join(TYPES)}"
            )
        if self.ordered and (self.num_centroids < 1 or self.vocab_size % self.num_centroids):
            raise SpecError(
                f"the {NAME} head's {self.num_centroids} centroids do not divide its "
                f"vocabulary of {self.vocab_size}"
            )
        if self.ordered and not 1 <= self.top_k <= self.num_centroids:
            raise SpecError(f"the {NAME} head's centroid_intermediate_top_k is {self.top_k}")
        # what HF's Gemma4AssistantConfig.validate_architecture requires
        shared = text.get("num_kv_shared_layers") or layers
        for field, ok in (
            ("num_kv_shared_layers", shared == layers),
            ("hidden_size_per_layer_input", not text.get("hidden_size_per_layer_input")),
            ("enable_moe_block", not text.get("enable_moe_block")),
            ("use_double_wide_mlp", not text.get("use_double_wide_mlp")),
        ):
            if not ok:
                raise SpecError(
                    f"the {NAME} head's text_config.{field} is {text.get(field)!r}: an "
                    f"assistant's layers share every key and value, with plain MLPs and no "
                    "per-layer inputs"
                )
        # every layer shares the target's keys and values; no per-layer inputs
        text = {**text, "num_kv_shared_layers": layers, "hidden_size_per_layer_input": 0}
        text["use_double_wide_mlp"] = False
        text["tie_word_embeddings"] = True
        try:
            self.text = gemma4_text.ModelArgs.from_dict(text)
        except (TypeError, ValueError) as err:
            raise SpecError(f"the {NAME} head's text_config has a bad field: {err}") from None
        self.layer_types = list(types)


class MaskedEmbedder(nn.Module):
    """E2B / E4B's centroid head: logits for the tokens of the top-k clusters, the rest of
    the vocabulary the smallest of them minus 1."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.top_k, self.num_centroids = args.top_k, args.num_centroids
        self.per_centroid = args.vocab_size // args.num_centroids
        self.centroids = nn.Linear(args.hidden_size, args.num_centroids, bias=False)
        self.token_ordering = mx.zeros((args.vocab_size,), dtype=mx.int32)

    def __call__(self, h: mx.array, embed: nn.Module) -> mx.array:
        """h (..., hidden), embed the tied embedding (quantized or not) -> logits (...,
        vocab); the floor is each row's own (HF takes one over the whole batch: the same
        for one row, which is what a batch row is alone)."""
        scores = self.centroids(h)
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :]
        ordering = self.token_ordering.reshape(self.num_centroids, self.per_centroid)
        ids = ordering[top].reshape(*h.shape[:-1], -1)  # (..., top_k * per_centroid)
        rows = embed(ids)  # (..., n, hidden)
        selected = (rows @ h[..., None])[..., 0]  # (..., n)
        floor = mx.min(selected, axis=-1, keepdims=True) - 1
        vocab = self.token_ordering.shape[0]
        out = mx.broadcast_to(floor, (*h.shape[:-1], vocab)).astype(h.dtype)
        return mx.put_along_axis(out, ids, selected.astype(h.dtype), axis=-1)


class _Inner(nn.Module):
    def __init__(self, args: AssistantArgs):
        super().__init__()
        text = args.text
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [gemma4_text.DecoderLayer(text, i) for i in range(text.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=text.rms_norm_eps)


class AssistantHead(nn.Module):
    """The checkpoint's modules under its own names (model.*, pre_projection, post_projection,
    masked_embedding). `reads` ({layer type: target layer}), `window` and `embed_scale` are
    set by load_head from the target."""

    def __init__(self, args: AssistantArgs):
        super().__init__()
        self.args = args
        self.model = _Inner(args)
        self.pre_projection = nn.Linear(2 * args.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, args.backbone_hidden_size, bias=False)
        if args.ordered:
            self.masked_embedding = MaskedEmbedder(args)
        self.reads: dict[str, int] = {}
        self.window = 0
        self.embed_scale = 1.0

    def step(self, x: mx.array, kv: dict, position, masks=None) -> tuple[mx.array, mx.array]:
        """One draft step for B rows: x = [embedding, state] (B, 1, 2·backbone), kv {type:
        (keys, values)} (B, heads, S, d), `position` the queries' (an int, or (B,) per row),
        `masks` {type: additive (B, 1, 1, S)} where rows hold different keys (a batch) ->
        (logits (B, vocab), the next state (B, 1, backbone))."""
        h = self.pre_projection(x)
        for layer in self.model.layers:
            kind = layer.layer_type
            mask = masks.get(kind) if masks else None
            h, _, _ = layer(h, mask, None, shared_kv=kv[kind], offset=position)
        h = self.model.norm(h)
        embed = self.model.embed_tokens
        if self.args.ordered:
            logits = self.masked_embedding(h, embed)
        else:
            logits = embed.as_linear(h)
        return logits[:, 0], self.post_projection(h)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            if k.startswith(DROPPED):
                continue
            if k == "masked_embedding.token_ordering":
                v = v.astype(mx.int32)
            out[k] = v
        return out


# ------------------------------------------------------------------------------- the drafter


class AssistantDrafter(Drafter):
    """State between rounds: `tokens` is the sequence, `target_at` the number of positions
    the target's cache holds (the last token, at `target_at`, not yet fed); `state` the
    target's final-norm row at `target_at - 1`; `kv` {target layer: (its cache,)} — read when
    drafting, after the round's roll-back, and refused (SpecError) unless it holds exactly
    `target_at` positions — or (keys, values, first position) arrays (a fork's, a batch
    row's) holding every position below `target_at` (and maybe rejected ones after: never
    read). None: nothing to draft from until the target's next pass."""

    def __init__(self, head: AssistantHead, target, vocab: int | None = None):
        self.head = head
        stack = decoder_stack(target)
        self.embed = stack["embed_tokens"]
        self.vocab = vocab
        self.layers = dict(head.reads)  # {type: target layer}
        self.hidden_layers = (FINAL_NORM, *(kv_of(i) for i in sorted(set(self.layers.values()))))
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.target_at: int | None = 0
        self.state: mx.array | None = None
        self.kv: dict[int, tuple] = {}

    def fork(self) -> AssistantDrafter:
        """The twin holds the keys and values as they are now (views: the twin decoder's
        cache is a copy of these layers, not the layers this drafter reads)."""
        twin = copy.copy(self)  # head and embedding shared; the arrays are never written
        twin.tokens, twin.layers = list(self.tokens), dict(self.layers)
        twin.state = caches.fresh(self.state)
        twin.kv = {i: self._held(i) for i in self.kv}
        return twin

    # -------------------------------------------------------------------------- helpers

    def _take(self, output, end: int) -> None:
        """The keys and values of the pass in `output`, whose last column is position end-1:
        the target layer's cache itself where the pass names it (read when drafting, after
        the round's roll-back: no view of its buffer is held across the next pass, which
        would make that pass's write copy the whole buffer), else the arrays."""
        for i in set(self.layers.values()):
            got = output.hidden.get(kv_of(i))
            if got is None:
                raise SpecError(f"the target's pass handed no keys and values of layer {i}")
            cache = getattr(got, "cache", None)
            if cache is None:
                keys, values = got
                self.kv[i] = (keys, values, end - keys.shape[-2])
            elif isinstance(cache, KVCache) and not isinstance(cache, BatchKVCache):
                self.kv[i] = (cache,)
            else:
                raise SpecError(f"a {type(cache).__name__} layer cannot be read by the drafter")

    def _held(self, i: int) -> tuple:
        """Layer i's keys and values now (views) and the position of their first column."""
        held = self.kv[i]
        if len(held) == 3:
            return (*caches.fresh(held[:2]), held[2])
        cache = held[0]
        n = cache.size()  # (a windowed layer's: the tokens it still holds)
        keys, values = cache.keys[0, :, :n, :], cache.values[0, :, :n, :]
        return keys, values, cache.offset - n

    def _shared(self, at: int) -> dict:
        """{type: (keys, values)} (1, heads, S, d) the drafter attends to with `at` positions
        held: all of them (full attention), the last window - 1 (sliding)."""
        out = {}
        for kind, i in self.layers.items():
            if len(self.kv[i]) == 1 and self.kv[i][0].offset != at:
                raise SpecError(
                    f"the target's layer {i} holds {self.kv[i][0].offset} positions, not {at}"
                )
            keys, values, first = self._held(i)
            lo = max(0, at - (self.head.window - 1)) if kind == "sliding_attention" else 0
            if first > lo or at - first > keys.shape[-2]:
                raise SpecError(
                    f"the target's layer {i} no longer holds positions {lo}..{at - 1} "
                    f"(it holds {first}..{first + keys.shape[-2] - 1})"
                )
            out[kind] = (
                keys[None, :, lo - first : at - first],
                values[None, :, lo - first : at - first],
            )
        return out

    # ------------------------------------------------------------------------ protocol

    def prefill(self, tokens, timed=False, output=None):
        tokens = list(tokens)
        at = len(tokens) - 1  # positions the target holds
        rows = output.hidden.get(FINAL_NORM) if output is not None else None
        if rows is not None and output.fed > 0:
            self.state = rows[-1:]
            self._take(output, at)
        elif not (
            self.state is not None and self.target_at == at and self.tokens[:at] == tokens[:at]
        ):
            self.state, self.kv = None, {}  # until the target's next pass
        self.tokens, self.target_at = tokens, at
        if timed:
            return self._time_step()
        return 0.0

    def _time_step(self) -> float | None:
        """One draft step's seconds (the second of two: the first pays one-time costs)."""
        if self.state is None:
            return None
        seconds = None
        for _ in range(2):
            start = time.perf_counter()
            mx.eval(self.propose(1, _GREEDY, None)[0])
            seconds = time.perf_counter() - start
        return seconds

    def propose(self, k, params, key, *, processors=()):
        self.steps = 0
        at = self.target_at
        if k == 0 or self.state is None or at is None or len(self.tokens) != at + 1:
            return mx.zeros((0,), mx.uint32), None
        kv = self._shared(at)
        keys = None if params.greedy else mx.random.split(key, k)
        state = self.state[None]  # (1, 1, backbone)
        token = mx.array([self.tokens[at]], mx.uint32)
        drafted, qs = [], []
        for i in range(k):
            e = self.embed(token)[None] * self.head.embed_scale
            x = mx.concatenate([e.astype(state.dtype), state], axis=-1)
            logits, state = self.head.step(x, kv, at)
            logits = logits[0]
            if self.vocab is not None and logits.shape[-1] > self.vocab:
                logits = logits[: self.vocab]
            if processors:  # after the sequence + x1..xi, as the target's row i
                so_far = mx.concatenate(drafted) if drafted else []
                logits = apply_processors(processors, self.tokens, so_far, logits)
            token, q = draw(logits, params, None if keys is None else keys[i])
            if q is not None:
                qs.append(q)
            drafted.append(token)
            self.steps += 1
            mx.async_eval(token)  # the device starts while Python builds the next step
        return mx.concatenate(drafted), (mx.stack(qs) if qs else None)

    def commit(self, kept, output=None):
        before = self.target_at
        self.tokens += kept
        if output is None or before is None or not output.kept:
            # no rows (or a recurrent target's replay): nothing to draft from until a prefill
            self.target_at = None if output is None or before is None else before
            self.state, self.kv = None, {}
            return
        rows = output.hidden.get(FINAL_NORM)
        if rows is None:
            raise SpecError("the target's pass handed no final-norm rows")
        self._take(output, before + output.fed)
        self.target_at = before + output.kept
        self.state = rows[output.kept - 1 : output.kept]

    def disk_state(self) -> tuple[list, dict]:
        """The target's final-norm row at `target_at - 1` (`state`, one ArraysCache), the
        tokens, `target_at` and which target layers it reads; not their keys and values:
        those are the target cache's own content (a fork's or a batch row's copies hold the
        same positions), stored with the target's layers and read from them after a load."""
        figures = {"kind": type(self).__name__, "tokens": self.tokens,
                   "target_at": self.target_at, "kv": sorted(self.kv)}  # fmt: skip
        return [arrays_layer([self.state])], figures

    def restore_disk_state(self, layers: list, figures: dict, target: list) -> None:
        kind = type(self).__name__
        tokens, at, kv = head_figures(figures, kind, "tokens", "target_at", "kv")
        head_layers(layers, [ArraysCache], kind)
        if len(layers[0].cache) != 1:
            raise SpecError(f"the stored {kind} state is {len(layers[0].cache)} arrays, not 1")
        (state,) = layers[0].cache
        width = self.head.args.backbone_hidden_size
        if state is not None and state.shape != (1, width):
            raise SpecError(f"the stored {kind} state has shape {state.shape}, not (1, {width})")
        kv = sorted(int(i) for i in kv)
        reads = sorted(set(self.layers.values()))
        if (state is None) != (not kv) or (kv and kv != reads):
            raise SpecError(f"the stored {kind} state reads target layers {kv}, not {reads}")
        for i in kv:
            c = target[i] if i < len(target) else None
            if not isinstance(c, KVCache) or isinstance(c, BatchKVCache) or c.offset != at:
                raise SpecError(f"the target's layer {i} does not hold the stored {at} positions")
        self.tokens = [int(t) for t in tokens]
        self.target_at = None if at is None else int(at)
        self.state, self.kv = state, {i: (target[i],) for i in kv}

    def settle(self) -> None:
        arrays = [a for kv in self.kv.values() if len(kv) == 3 for a in kv[:2]]
        mx.eval(*arrays, *([self.state] if self.state is not None else []))

    def cache_bytes(self) -> int:
        # the keys and values are the target cache's own (its layers, or views), counted there
        return self.state.nbytes if self.state is not None else 0


class _Greedy:
    greedy = True


_GREEDY = _Greedy()


# ------------------------------------------------------------------------------- loading


def target_facts(target, target_config: dict) -> tuple[object, dict[str, int]]:
    """The target's gemma4_text settings and, per layer type, the last layer that computes
    its own keys and values (mlx-lm's kvs_by_type); refused for any other model."""
    stack = decoder_stack(target)
    args = (
        getattr(stack, "config", None) if isinstance(stack, gemma4_text.Gemma4TextModel) else None
    )
    if args is None:
        kind = target_config.get("model_type", type(target).__name__)
        raise SpecError(
            f"a {NAME} head drafts for a Gemma 4 target (gemma4, gemma4_text), not {kind}"
        )
    own = args.num_hidden_layers - (args.num_kv_shared_layers or 0)
    reads = {t: i for i, t in enumerate(args.layer_types[:own])}
    return args, reads


def _kv_shape(args, kind: str) -> tuple[int, int]:
    """(kv heads, head dim) of the target's layers of this type (gemma4_text.Attention)."""
    full = kind == "full_attention"
    dim = args.global_head_dim if full and args.global_head_dim else args.head_dim
    heads = args.num_key_value_heads
    if full and args.attention_k_eq_v and args.num_global_key_value_heads is not None:
        heads = args.num_global_key_value_heads
    return heads, dim


def load_head(path: Path, target, target_config: dict) -> AssistantHead:
    """A gemma4_assistant directory (config.json + safetensors as published) -> the head,
    checked against the target (one-line errors)."""
    path = Path(path)
    cfg = read_head_config(path, NAME)
    args = AssistantArgs(cfg)
    targs, reads = target_facts(target, target_config)
    if args.backbone_hidden_size != targs.hidden_size:
        raise SpecError(
            f"the {NAME} head's backbone_hidden_size is {args.backbone_hidden_size}, the "
            f"target's hidden size {targs.hidden_size}: it was made for another model"
        )
    if args.vocab_size != targs.vocab_size:
        raise SpecError(
            f"the {NAME} head's vocabulary is {args.vocab_size} tokens, the target's "
            f"{targs.vocab_size}"
        )
    head = AssistantHead(args)
    for kind in sorted(set(args.layer_types)):
        if kind not in reads:
            raise SpecError(f"the {NAME} head has {kind} layers, the target computes none")
        heads, dim = _kv_shape(targs, kind)
        layer = next(x for x in head.model.layers if x.layer_type == kind).self_attn
        if layer.head_dim != dim or layer.n_heads % heads:
            raise SpecError(
                f"the {NAME} head's {kind} layers ({layer.n_heads} heads of {layer.head_dim}) "
                f"cannot attend to the target's ({heads} key/value heads of {dim})"
            )
    load_head_weights(head, path, cfg, NAME, head.sanitize)
    head.reads = {t: reads[t] for t in sorted(set(args.layer_types))}
    head.window = int(targs.sliding_window)
    head.embed_scale = float(getattr(decoder_stack(target), "embed_scale", 1.0))
    return head
