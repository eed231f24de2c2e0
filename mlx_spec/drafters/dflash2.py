"""DFlash2 block drafters (z-lab, August 2026): DFlash with dynamic convolutions and a candidate
selector; read by the `dflash` kind when a head's config says DFlash2.

What differs from DFlash (dflash.py), as z-lab's `dflash/model.py` (`DFlash2DraftModel`) and its
published layout (`tests/fixtures/dflash2-{config,safetensors-header}.json`) have it:

- Each layer wraps its attention and its MLP in a two-tap dynamic depthwise causal convolution
  over the block (`layers.N.attention_conv`, `layers.N.mlp_conv`): `prepare` mixes each block
  row with the row before it (kernel `base_kernel[0]` per channel plus a per-position,
  per-channel-group weight projected from the row itself), `finish` does the same to the
  sublayer's output with `base_kernel[1]` and the second half of that projection. The context
  (the target's features) is not convolved.
- The logits are the target head's times `output_multiplier`, soft-capped at
  `final_logit_softcapping`.
- A candidate selector (`candidate_selector.{predecessor_codebook, successor_codebook,
  hidden_projection}`) draws the block left to right among each position's top `selector_top_k`
  tokens: a candidate b after the guess a scores `logit(b) + <pred(a) * proj(h_i), succ(b)>`.
  Greedy takes the best; sampled draws from those scores' distribution (`select`: the scores
  on the candidates, -inf elsewhere), and that distribution is the q handed to the verifier.
  Processors (penalties, a grammar) apply to the logits before the candidates are chosen.

Not applied: the checkpoints' sliding window (2048 for the published one): the head attends to
the whole context, as for DFlash heads (docs/drafters.md). In a batch: decode/batch_head.py's
`DFlash2Rows`, the same `select` over every row.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..core.processors import apply as apply_processors
from ..core.sampling import probabilities, sample
from ..errors import SpecError
from .dflash import DFlashArgs, DFlashDrafter, DFlashHead, DFlashLayer, is_dflash2


class DFlash2Args(DFlashArgs):
    """A DFlash2 config.json: DFlash's fields, the convolutions' and the selector's."""

    name = "DFlash2"

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        extra = cfg.get("dflash_config") or {}

        def field(key, default=None):
            value = extra.get(key, cfg.get(key, default))
            if value is None:
                raise SpecError(f"the DFlash2 config.json has no dflash_config.{key}")
            return value

        try:
            self.vocab_size = int(cfg["vocab_size"])
            self.conv_kernel_size = int(field("conv_kernel_size"))
            self.conv_group_size = int(field("conv_group_size"))
            self.selector_rank = int(field("selector_rank"))
            self.selector_top_k = int(field("selector_top_k"))
            self.output_multiplier = float(field("output_multiplier", 1.0))
            cap = extra.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
            self.softcap = float(cap) if cap else None
        except KeyError as err:
            raise SpecError(f"the DFlash2 config.json has no {err.args[0]}") from None
        except (TypeError, ValueError) as err:
            raise SpecError(f"the DFlash2 config.json has a bad field: {err}") from None
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise SpecError(
                f"DFlash2 conv_group_size {self.conv_group_size} does not divide the hidden "
                f"size {self.hidden_size}"
            )
        if self.conv_kernel_size < 1 or not 1 <= self.selector_top_k <= self.vocab_size:
            raise SpecError("the DFlash2 config.json has a bad conv_kernel_size or selector_top_k")


def convolve(x: mx.array, dynamic: mx.array, base: mx.array, group: int) -> mx.array:
    """z-lab's `_grouped_dynamic_convolve`: x (B, L, H); dynamic (B, L, K, G) per-group weights;
    base (K, H) per-channel weights; tap t reads the row t places before (zeros before row 0)."""
    B, L, H = x.shape
    blocks = x.reshape(B, L, H // group, group)  # (B, L, G, group)
    out = mx.zeros_like(blocks)
    for t in range(base.shape[0]):
        rows = blocks if t == 0 else mx.pad(blocks, ((0, 0), (t, 0), (0, 0), (0, 0)))[:, :L]
        out = out + base[t].reshape(1, 1, -1, group) * rows + dynamic[:, :, t, :, None] * rows
    return out.reshape(B, L, H)


class DynamicConv(nn.Module):
    """GroupedDynamicCausalConv: `prepare` before a sublayer, `finish` after it."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = mx.zeros((2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        B, L, H = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel, H // self.group)
        return convolve(x, dynamic[:, :, 0], self.base_kernel[0], self.group), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return convolve(x, dynamic, self.base_kernel[1], self.group)


class DFlash2Layer(DFlashLayer):
    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        shape = (args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.attention_conv = DynamicConv(*shape)
        self.mlp_conv = DynamicConv(*shape)

    def __call__(self, x, rope, offset, cache):
        y, later = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(y, rope, offset, cache), later)
        y, later = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(y), later)


class CandidateSelector(nn.Module):
    def __init__(self, args: DFlash2Args):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.successor_codebook = nn.Embedding(args.vocab_size, args.selector_rank)
        self.hidden_projection = nn.Linear(args.hidden_size, args.selector_rank, bias=False)


class DFlash2Head(DFlashHead):
    args_type = DFlash2Args
    layer_type = DFlash2Layer
    own_vocab = True  # the selector's codebooks

    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)

    matches = staticmethod(is_dflash2)  # the dflash kind reads this layout too

    def scale(self, logits: mx.array) -> mx.array:
        """`compute_logits`: the target head's logits times the multiplier, soft-capped."""
        logits = logits * self.args.output_multiplier
        cap = self.args.softcap
        return mx.tanh(logits / cap) * cap if cap else logits

    def select(self, logits: mx.array, previous: mx.array, projected: mx.array) -> mx.array:
        """One position's (processed) logits (..., vocab), the guesses before it (...,) and its
        states' projection (..., rank) -> the selector's scores on the top candidates, -inf
        elsewhere (..., vocab): what the guess is drawn from (z-lab's `CandidateSelector`)."""
        top, books = self.args.selector_top_k, self.candidate_selector
        candidates = mx.argpartition(-logits, top - 1, axis=-1)[..., :top]  # (..., top)
        pair = books.predecessor_codebook(previous) * projected  # (..., rank)
        bilinear = (books.successor_codebook(candidates) @ pair[..., None])[..., 0]
        scores = mx.take_along_axis(logits, candidates, axis=-1) + bilinear  # (..., top)
        floor = mx.full(logits.shape, -mx.inf, scores.dtype)
        return mx.put_along_axis(floor, candidates, scores, axis=-1)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        """The codebooks are published without `.weight` (z-lab's `key_mapping` adds it)."""
        weights = DFlashHead.sanitize(weights)
        books = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
        return {k + ".weight" if k in books else k: v for k, v in weights.items()}


class DFlash2Drafter(DFlashDrafter):
    """One forward of the block, then the selector's k small steps among each position's top
    candidates, each after the guess drawn before (lazy, no host sync without processors)."""

    chained = True

    def propose(self, k, params, key, *, processors=()):
        k = min(k, self.max_draft)
        self.steps = int(k > 0)
        if k <= 0:
            return mx.zeros((0,), mx.uint32), None
        head = self.head
        h = self._block_hidden(k)  # (k, hidden)
        logits = head.scale(self.lm_head(h))  # (k, vocab)
        projected = head.candidate_selector.hidden_projection(h)  # (k, rank)
        keys = None if params.greedy else mx.random.split(key, k)
        drafted, qs = [], []
        previous = mx.array(self.tokens[-1], mx.uint32)
        for i in range(k):
            row = logits[i]
            if processors:  # before the candidates are chosen (a grammar may rule some out)
                so_far = mx.concatenate(drafted) if drafted else []
                row = apply_processors(processors, self.tokens, so_far, row)
            scores = head.select(row, previous, projected[i])  # (vocab,), -inf off candidates
            if params.greedy:
                previous = mx.argmax(scores).astype(mx.uint32)
            else:
                q = probabilities(scores, params)
                previous = sample(q, keys[i]).astype(mx.uint32)
                qs.append(q)
            drafted.append(previous.reshape(1))
        return mx.concatenate(drafted), (mx.stack(qs) if qs else None)
