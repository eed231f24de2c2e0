"""Qwen 3: RMS norms on each head's queries and keys."""

from __future__ import annotations

from .base import LINEAR, NORMS, QK_NORM, Architecture


class Qwen3(Architecture):
    name = model_type = "qwen3"
    blocks = LINEAR | NORMS | QK_NORM
