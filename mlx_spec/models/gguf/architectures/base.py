"""What every architecture shares: llama's layout; a subclass states only what differs."""

from __future__ import annotations

import re
from typing import ClassVar

import mlx.core as mx

from ....errors import SpecError
from ..tokenizer import eos_ids
from .rope import rope_scaling

TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# the per-layer matrices (GGUF stem -> mlx-lm module): the tensors that may stay quantized
LINEAR = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Architecture:
    """One `general.architecture`, mapped onto mlx-lm's own model class of its family, for
    one file's metadata (`meta`)."""

    name: ClassVar[str]  # general.architecture
    model_type: ClassVar[str]  # the mlx-lm model_type it becomes
    blocks: ClassVar[dict[str, str]] = LINEAR | NORMS  # per-layer GGUF stem -> mlx-lm module
    biases: ClassVar[tuple[str, ...]] = ()  # the layer tensors that also carry a `.bias`
    optional: ClassVar[frozenset[str]] = frozenset({"output.weight"})  # absent: tied embeddings
    required: ClassVar[tuple[str, ...]] = ()  # more `<arch>.*` integers (>= 1) it needs

    def __init__(self, meta: dict):
        self.meta = meta

    def key(self, name: str) -> str:
        return f"{self.name}.{name}"

    def get(self, name: str, default=None):
        return self.meta.get(self.key(name), default)

    def __getitem__(self, name: str):
        return self.meta[self.key(name)]

    def head_dim(self, where: str) -> int:
        """Attention head size: attention.key_length (Qwen3, Gemma 3), else the rotary
        dimension count, else hidden / heads. Partial rotary embeddings are not part of these
        families."""
        hidden, heads = self["embedding_length"], self["attention.head_count"]
        key_length = self.get("attention.key_length")
        rope_dims = self.get("rope.dimension_count")
        head_dim = key_length if key_length is not None else rope_dims
        head_dim = hidden // heads if head_dim is None else head_dim
        if (
            not isinstance(head_dim, int)
            or isinstance(head_dim, bool)
            or head_dim < 2
            or head_dim % 2
        ):
            raise SpecError(f"{where}: the attention head size {head_dim!r} is not usable")
        for key in ("attention.value_length", "rope.dimension_count"):
            value = self.get(key, head_dim)
            if value != head_dim:
                raise SpecError(f"{where}: {self.name}.{key} is {value!r} but the heads have "
                                f"{head_dim} dimensions (unsupported)")  # fmt: skip
        return head_dim

    def mlx_name(self, gguf_name: str) -> str:
        stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if m and m.group(2) in self.blocks:
            return f"model.layers.{m.group(1)}.{self.blocks[m.group(2)]}.{suffix}"
        if stem in TENSOR_NAMES:
            return f"{TENSOR_NAMES[stem]}.{suffix}"
        raise SpecError(f"unsupported GGUF tensor {gguf_name!r}")

    @staticmethod
    def is_matrix(gguf_name: str) -> bool:
        """Tensors that become mlx-lm Linear / Embedding layers (the ones that may stay
        quantized)."""
        stem, _, suffix = gguf_name.rpartition(".")
        part = stem.rpartition(".")[2]
        return suffix == "weight" and (stem in ("token_embd", "output") or part in LINEAR)

    def sanitize(self, gguf_name: str, arrays: list[mx.array]) -> list[mx.array]:
        """One tensor as mlx-lm's model expects it: `arrays` is the float weight, or the packed
        codes, scales and biases of a quantized one (before any dtype cast). Default: as
        stored."""
        return arrays

    def config(self, rope_freqs, tied: bool) -> dict:
        """mlx-lm's config.json for the file (without its quantization table)."""
        meta, heads = self.meta, self["attention.head_count"]
        head_dim = self.head_dim("")
        return {
            "model_type": self.model_type,
            "hidden_size": self["embedding_length"],
            "num_hidden_layers": self["block_count"],
            "intermediate_size": self["feed_forward_length"],
            "num_attention_heads": heads,
            "num_key_value_heads": self.get("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": self.get("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.get("rope.freq_base", 10000.0),
            # Q/K are stored (or, for llama, restored) in the Hugging Face rotary layout
            "rope_traditional": False,
            "rope_scaling": rope_scaling(meta, self.name, rope_freqs, head_dim),
            "max_position_embeddings": self["context_length"],
            "vocab_size": len(meta["tokenizer.ggml.tokens"]),
            "tie_word_embeddings": tied,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos_ids(meta),
        }
