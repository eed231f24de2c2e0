"""Qwen 2 / 2.5: biases on Q, K and V; heads that divide the hidden size evenly."""

from __future__ import annotations

from ....errors import SpecError
from .base import Architecture


class Qwen2(Architecture):
    name = model_type = "qwen2"
    biases = ("attn_q", "attn_k", "attn_v")

    def head_dim(self, where: str) -> int:
        head_dim = super().head_dim(where)
        hidden, heads = self["embedding_length"], self["attention.head_count"]
        if head_dim != hidden // heads:
            raise SpecError(f"{where}: qwen2 heads of {head_dim} dimensions do not divide "
                            f"{hidden} evenly into {heads} heads")  # fmt: skip
        return head_dim
