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

Rope pairing: Liquid AI's checkpoints say `rope_is_neox_style: false` (interleaved pairs, MLX's
"traditional"); a config that does not say gets NeoX pairing (split halves), DFlash's and the
Qwen family's default, as both peers read it (mlx-vlm 0.7.10's DSparkConfig and mlx-dspark
0.20.3's `rope_traditional`: absent means NeoX). The checkpoint's
`confidence_head.proj` (a sigmoid over [hidden, markov embedding], for DeepSpec's
confidence-scheduled early stop; off by default there, threshold 0) is not used: the
controller chooses how many guesses the target verifies. It is dropped at load, as are
`embed_tokens` / `lm_head` copies of the target's (DeepSeek's checkpoint ships them; the
target's own are used). Only the `vanilla` Markov head is read (DeepSpec's `gated` and `rnn`
variants are refused in one line).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import SpecError
from . import dflash
from .dflash import DFlashArgs, DFlashDrafter, DFlashHead

DROPPED = ("embed_tokens.", "lm_head.", "confidence_head.")  # read, not used (see above)


class DSparkArgs(DFlashArgs):
    """A DSpark config.json: DFlash's fields and the Markov head's."""

    name = "DSpark"

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        extra = cfg.get("dflash_config") or {}
        try:
            self.vocab_size = int(cfg["vocab_size"])
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
    """The low-rank bias over the previous token: markov_w2(markov_w1[previous])."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        """Token ids (...,) -> the logit bias for the position after each (..., vocab)."""
        return self.markov_w2(self.markov_w1(previous))


class DSparkHead(DFlashHead):
    """DFlash's backbone with the Markov head; the anchor's row guesses too."""

    args_type = DSparkArgs
    first_row = 0
    own_vocab = True  # the Markov tables

    def __init__(self, args: DSparkArgs):
        super().__init__(args)
        self.markov_head = VanillaMarkov(args.vocab_size, args.markov_rank)

    @staticmethod
    def sanitize(weights: dict) -> dict:
        weights = DFlashHead.sanitize(weights)
        return {k: v for k, v in weights.items() if not k.startswith(DROPPED)}


class DSparkDrafter(DFlashDrafter):
    """Drafts `block_size` tokens from one forward of the backbone, then the Markov head's
    k small steps, each on the guess just drawn (lazy: no host sync between them)."""

    chained = True

    def _step_logits(self, logits: mx.array, previous: mx.array) -> mx.array:
        return logits + self.head.markov_head(previous)[0]  # (vocab,)


def load_head(path: Path, target, target_config: dict) -> DSparkHead:
    """A DSpark directory (config.json + safetensors as published) -> the head, checked
    against the target (one-line errors)."""
    return dflash.load_head(path, target, target_config, head_type=DSparkHead)
