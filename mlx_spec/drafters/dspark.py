"""DSpark block drafters: a DFlash head plus a low-rank Markov head over the previous guess.

DSpark ("Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation",
DeepSeek's DeepSpec; checkpoints from Liquid AI for LFM2.5 — `LiquidAI/LFM2.5-*-DSpark` — and
DeepSeek's `deepseek-ai/dspark_qwen3_4b_block7`) is DFlash's backbone (dflash.py: the same
`fc`, `hidden_norm`, layers, `norm` and config fields, the target's embedding and head) with
two differences, both as mlx-vlm's `drafters/qwen3_dspark` and llama.cpp's `draft-dspark`
implement them:

- The block is the anchor and `block_size - 1` masks, and **every** row guesses, the anchor's
  row included: row i guesses the token i + 1 places after the anchor, so a block of
  `block_size` (the published `block_size`: 9 for LFM2.5, DSpark's gamma) drafts `block_size`
  tokens. (DFlash drops its anchor's row: `block_size - 1` guesses.)
- A Markov head `markov_head.{markov_w1 (vocab, rank) embedding, markov_w2 (vocab, rank)
  linear}` adds `markov_w2(markov_w1[previous])` to row i's logits, `previous` the guess drawn
  at i - 1 (the anchor for i = 0): the block is drawn left to right, each guess conditioned on
  the one actually drawn before it. So q at position i, what the verifier's rejection rule
  divides by, is the distribution given that guess: DSparkDrafter draws position by position
  (`DFlashDrafter.chained`) and hands over each position's q as it drew from it.

Which rows guess, and how wide the block is, as the peers read a config (mlx-vlm 0.7.10's
DSparkConfig.from_dict / DSparkDraftModel.draft_block, mlx-dspark 0.20.3's config.py):

- DeepSpec's and Liquid AI's heads (a `dflash_config`): the block is `block_size` wide and its
  anchor row guesses (row 0: `block_size` guesses).
- `dflash_config.sample_from_anchor: false` (mlx-vlm): the anchor row does not guess; the block
  is one wider, `block_size` guesses from row 1.
- `dspark_bonus_anchor: true` (mlx-vlm): `block_size` counts the anchor, so `block_size - 1`
  guesses: a block `block_size - 1` wide from row 0, or with `sample_from_anchor: false`
  `block_size` wide from row 1.
- mlx-dspark's own fields, a top-level `logits_start` or `sample_from_anchor` (0 / 1 for
  true / false): the block is `block_size` wide and the guesses start at that row.
- vLLM speculators packaging (`speculators_model_type: "dspark"`; read by mlx-dspark only): the
  backbone in `transformer_layer_config`, the target layers in `aux_hidden_state_layer_ids`
  (layer outputs, as DeepSpec's), the block `block_size` wide, the guesses from row
  `block_size - speculative_tokens`, else from `sample_from_anchor`, else from row 1 (the heads
  that predate that field reserve the anchor row).

Vocabulary: a head may draft over a reduced vocabulary (`draft_vocab_size` and a `d2t` table,
target id = draft id + d2t[draft id], as EAGLE-3; mlx-dspark): its `lm_head` and `markov_w2`
are draft-vocabulary wide, `markov_w1` (indexed by the previous, target, token) stays target
wide; the draft logits plus the Markov bias are scattered onto the target vocabulary, -inf on
every token the head cannot propose. A head that ships its own `embed_tokens` / `lm_head`
embeds the block / projects with them (both peers embed with a shipped embedding; mlx-dspark
projects with a shipped lm_head; a reduced head must); the target's are used otherwise.

Rope pairing: Liquid AI's checkpoints say `rope_is_neox_style: false` (interleaved pairs, MLX's
"traditional"); a config that does not say gets NeoX pairing (split halves), DFlash's and the
Qwen family's default, as both peers read it (mlx-vlm 0.7.10's DSparkConfig and mlx-dspark
0.20.3's `rope_traditional`: absent means NeoX). The checkpoint's
`confidence_head.proj` (a sigmoid over [hidden, markov embedding], for DeepSpec's
confidence-scheduled early stop; off by default there, threshold 0) is not used: the
controller chooses how many guesses the target verifies. It is dropped at load, as is `t2d`
(implied by `d2t`). Only the `vanilla` Markov head is read (DeepSpec's `gated` and `rnn`
variants are refused in one line).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import SpecError
from . import dflash
from .dflash import DFlashArgs, DFlashDrafter, DFlashHead

DROPPED = ("confidence_head.", "t2d")  # read, not used (see above)


def speculators_config(cfg: dict) -> dict:
    """A vLLM speculators DSpark config.json in DeepSpec's fields (as mlx-dspark translates
    it); any other config as it is. Other speculators algorithms are refused in one line."""
    spec = cfg.get("speculators_config")
    spec = spec if isinstance(spec, dict) else {}
    algorithm = cfg.get("speculators_model_type") or spec.get("algorithm")
    if algorithm is None:
        return cfg
    if algorithm != "dspark":
        raise SpecError(
            f"the head is a speculators {algorithm!r} model, not dspark "
            f"(--drafter {'eagle3' if algorithm == 'eagle3' else 'dflash'}?)"
        )
    layer = cfg.get("transformer_layer_config")
    taps = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not taps:
        missing = (
            "transformer_layer_config"
            if not isinstance(layer, dict)
            else "aux_hidden_state_layer_ids"
        )
        raise SpecError(f"the speculators DSpark config.json has no {missing}")
    out = {k: v for k, v in layer.items() if k not in ("architectures", "dflash_config")}
    keep = (
        "block_size",
        "markov_rank",
        "markov_head_type",
        "draft_vocab_size",
        "rope_is_neox_style",
    )
    out.update({k: cfg[k] for k in keep if k in cfg})
    out["dflash_config"] = {"target_layer_ids": taps, "mask_token_id": cfg.get("mask_token_id")}
    if "mask_token_id" not in cfg:
        del out["dflash_config"]["mask_token_id"]
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    block = cfg.get("block_size")
    start = 1  # the heads older than sample_from_anchor reserve the anchor row
    if isinstance(tokens, int) and isinstance(block, int) and 0 <= block - tokens < block:
        start = block - tokens
    elif isinstance(cfg.get("sample_from_anchor"), bool):
        start = 0 if cfg["sample_from_anchor"] else 1
    out["logits_start"] = start
    return out


def guessing_rows(cfg: dict, extra: dict, size: int) -> tuple[int, int]:
    """(the block row that guesses the next token, the block's width) from the config's
    `block_size` `size` (see the module's notes: each field as the peer that reads it)."""
    if "logits_start" in cfg or isinstance(cfg.get("sample_from_anchor"), bool):  # mlx-dspark
        start = cfg.get("logits_start", 0 if cfg.get("sample_from_anchor") else 1)
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < size:
            raise SpecError(f"DSpark logits_start must be a row of the block, got {start!r}")
        return start, size
    anchor = extra.get("sample_from_anchor", True)  # mlx-vlm
    if not isinstance(anchor, bool):
        raise SpecError(f"DSpark sample_from_anchor must be true or false, got {anchor!r}")
    guesses = size - 1 if cfg.get("dspark_bonus_anchor") else size
    return int(not anchor), guesses + int(not anchor)


class DSparkArgs(DFlashArgs):
    """A DSpark config.json: DFlash's fields and the Markov head's."""

    name = "DSpark"

    def __init__(self, cfg: dict):
        cfg = speculators_config(cfg)
        super().__init__(cfg)
        extra = cfg.get("dflash_config") or {}
        self.first_row, self.block_size = guessing_rows(cfg, extra, self.block_size)
        try:
            self.vocab_size = int(cfg["vocab_size"])
            draft = cfg.get("draft_vocab_size")
            self.draft_vocab_size = None if draft in (None, self.vocab_size) else int(draft)
            self.markov_rank = int(cfg.get("markov_rank", extra.get("markov_rank", 0)))
        except KeyError as err:
            raise SpecError(f"the DSpark config.json has no {err.args[0]}") from None
        except (TypeError, ValueError) as err:
            raise SpecError(f"the DSpark config.json has a bad field: {err}") from None
        if self.markov_rank < 1:
            raise SpecError(
                "the DSpark config.json has no markov_rank (a head without its Markov head "
                "is a DFlash head: --drafter dflash)"
            )
        kind = cfg.get("markov_head_type", extra.get("markov_head_type", "vanilla"))
        if kind != "vanilla":
            raise SpecError(f"only DSpark's vanilla Markov head is supported, not {kind!r}")


class VanillaMarkov(nn.Module):
    """The low-rank bias over the previous token: markov_w2(markov_w1[previous]) (w1 over the
    target's vocabulary, w2 over the head's: a reduced one for a head with d2t)."""

    def __init__(self, vocab_size: int, rank: int, out_size: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_size or vocab_size, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        """Token ids (...,) -> the logit bias for the position after each (..., vocab)."""
        return self.markov_w2(self.markov_w1(previous))


class DSparkHead(DFlashHead):
    """DFlash's backbone with the Markov head; the row that guesses first from the config (the
    anchor's, row 0, unless it says otherwise), its own embedding and output head if it ships
    them, a reduced vocabulary if it ships d2t."""

    args_type = DSparkArgs
    first_row = 0
    own_vocab = True  # the Markov tables

    def __init__(self, args: DSparkArgs):
        super().__init__(args)
        self.first_row = args.first_row
        self.markov_head = VanillaMarkov(
            args.vocab_size, args.markov_rank, args.draft_vocab_size or args.vocab_size
        )
        self.embed_tokens = None  # the head's own, when it ships them (see the module's notes)
        self.lm_head = None
        self._gather = None  # (target vocab,) -> draft id, draft_vocab where none maps

    def sanitize(self, weights: dict) -> dict:
        weights = DFlashHead.sanitize(weights)
        weights = {k: v for k, v in weights.items() if not k.startswith(DROPPED)}
        args = self.args
        d2t = weights.pop("d2t", None)
        draft = args.draft_vocab_size
        if d2t is None and draft is not None:
            raise SpecError(
                f"the DSpark head drafts over {draft} tokens (draft_vocab_size) but ships no "
                "d2t table to map them onto the target's"
            )
        if d2t is not None:
            n = d2t.shape[0] if d2t.ndim == 1 else -1
            if draft is not None and n != draft:
                raise SpecError(f"the DSpark head's d2t has shape {d2t.shape}, not ({draft},)")
            if "lm_head.weight" not in weights:
                raise SpecError("the DSpark head has a d2t table but no lm_head of its own")
            self._gather = draft_map(d2t, args.vocab_size)
            self.markov_head.markov_w2 = nn.Linear(args.markov_rank, n, bias=False)
        if "embed_tokens.weight" in weights:
            self.embed_tokens = nn.Embedding(*weights["embed_tokens.weight"].shape)
        if "lm_head.weight" in weights:
            rows = weights["lm_head.weight"].shape[0]
            want = args.vocab_size if d2t is None else d2t.shape[0]
            if rows != want:
                raise SpecError(f"the DSpark head's lm_head has {rows} rows, not {want}")
            self.lm_head = nn.Linear(args.hidden_size, rows, bias=False)
        return weights

    def widen(self, logits: mx.array) -> mx.array:
        """Logits over the head's vocabulary (..., n) -> over the target's (..., vocab): a
        reduced head's scattered through d2t, -inf where no draft token maps."""
        if self._gather is None:
            return logits
        none = mx.full((*logits.shape[:-1], 1), -mx.inf, logits.dtype)
        return mx.take(mx.concatenate([logits, none], axis=-1), self._gather, axis=-1)


def draft_map(d2t: mx.array, vocab: int) -> mx.array:
    """A d2t table (target id = draft id + d2t[draft id]) -> (vocab,) the draft id of each
    target token, len(d2t) where none maps; one SpecError line for a table that maps outside
    the target's vocabulary or two draft tokens onto one."""
    n = d2t.shape[0]
    targets = (mx.arange(n) + d2t.astype(mx.int64)).tolist()
    outside = [t for t in targets if not 0 <= t < vocab]
    if outside:
        raise SpecError(
            f"the head's d2t maps draft tokens outside the target's vocabulary of {vocab} "
            f"(e.g. to {outside[0]}): it was made for another target"
        )
    if len(set(targets)) != n:
        raise SpecError("the head's d2t maps two draft tokens to the same target token")
    gather = mx.full((vocab,), n, mx.uint32)
    gather[mx.array(targets, mx.uint32)] = mx.arange(n, dtype=mx.uint32)
    return gather


class DSparkDrafter(DFlashDrafter):
    """Drafts the block's guesses from one forward of the backbone, then the Markov head's
    k small steps, each on the guess just drawn (lazy: no host sync between them)."""

    chained = True

    def __init__(self, head: DSparkHead, target, block_size: int | None = None):
        super().__init__(head, target, block_size)
        if head.embed_tokens is not None:
            self.embed = head.embed_tokens
        if head.lm_head is not None:
            self.lm_head = head.lm_head

    def _step_logits(self, logits: mx.array, previous: mx.array) -> mx.array:
        return self.head.widen(logits + self.head.markov_head(previous)[0])  # (vocab,)


def load_head(path: Path, target, target_config: dict) -> DSparkHead:
    """A DSpark directory (config.json + safetensors as published) -> the head, checked
    against the target (one-line errors)."""
    return dflash.load_head(path, target, target_config, head_type=DSparkHead)
