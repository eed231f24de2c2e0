"""The trainers' settings: `Settings` (distilling a draft: LoRA) and `HeadSettings` (an
EAGLE-3 head). Kept apart from the trainers, which load MLX and mlx-lm, so that the command
line can show their defaults in `--help` without them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from ..errors import SpecError

LOSSES = ("tv", "kl")


@dataclass
class Settings:
    steps: int = 200
    batch_size: int = 4
    learning_rate: float = 1e-4
    rank: int = 8
    scale: float = 20.0  # mlx-lm's default LoRA scale
    num_layers: int = -1  # LoRA in the last N blocks (-1: all)
    loss: str = "tv"
    reply_tokens: int = 64  # tokens of each target reply
    max_length: int = 256  # longest training sequence (a prompt's start is cut beyond it)
    held_out: float = 0.2  # share of prompts never trained on
    eval_every: int = 25
    save_every: int = 25
    seed: int = 0
    temperature: float = 1.0  # the target's replies are sampled at this temperature
    k: int = 4  # draft length when measuring tokens per target pass
    eval_prompts: int = 4  # held-out prompts decoded with the pair to count tokens per pass
    max_prompts: int | None = None

    def check(self) -> None:
        if self.loss not in LOSSES:
            raise SpecError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not 0 < self.held_out < 1:
            raise SpecError(f"--held-out must be in (0, 1), got {self.held_out}")
        if self.reply_tokens >= self.max_length:
            raise SpecError("--reply-tokens must be below --max-length")
        if not self.learning_rate > 0:
            raise SpecError(f"--learning-rate must be > 0, got {self.learning_rate}")
        if self.temperature < 0:
            raise SpecError(f"--temp must be >= 0, got {self.temperature}")

    def training_key(self) -> dict:
        """What a resumed run must share with the run it continues (all but the length)."""
        return {
            k: v for k, v in asdict(self).items() if k not in ("steps", "eval_every", "save_every")
        }


@dataclasses.dataclass
class HeadSettings(Settings):
    """distill's settings (data, replies, held-out share, checkpoints) and the head's."""

    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 5e-4
    ttt_steps: int = 7  # draft steps trained (EAGLE-3: 7)
    ttt_warmup: int = 0  # the first steps train draft step 1 alone (see train_head)
    draft_vocab: int = 4096  # tokens the head can propose (the replies' most frequent)
    intermediate: int | None = None  # the head's MLP width (default: the target's)
    half: bool = True  # write float16 weights
    reply_tokens: int = 96

    def check(self) -> None:
        super().check()
        if self.ttt_steps < 1 or self.draft_vocab < 2:
            raise SpecError("--ttt-steps must be >= 1 and --draft-vocab >= 2")
