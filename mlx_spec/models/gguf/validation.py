"""What a conversion needs from a file, checked against its architecture before any
conversion starts (so nothing half-usable is ever cached): hyper-parameters, tokenizer
metadata, and every tensor's presence and shape."""

from __future__ import annotations

from ...errors import SpecError
from . import tokenizer
from .architectures import Architecture, architecture
from .architectures.rope import SCALING_TYPES
from .reader import GGUFInfo


def require_int(meta: dict, key: str, where: str, minimum: int = 1) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        shown = "missing" if value is None else repr(value)
        raise SpecError(f"{where}: {key} is {shown}; need an integer >= {minimum}")
    return value


def positive(meta: dict, key: str, where: str, default: float | None = 1.0):
    value = meta.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise SpecError(f"{where}: {key} is {value!r}; need a positive number")
    return value


def check_model_metadata(info: GGUFInfo, where: str) -> Architecture:
    """The hyper-parameters, tokenizer and tensors a conversion needs, checked against the
    architecture before any conversion starts; the architecture, for this file."""
    arch = architecture(info.meta, where)
    _check_hyperparameters(arch, where)
    tokenizer.check_metadata(info.meta, where)
    _check_tensors(arch, info, where)
    return arch


def _check_hyperparameters(arch: Architecture, where: str) -> None:
    meta, key = arch.meta, arch.key
    for name in ("embedding_length", "block_count", "feed_forward_length"):
        require_int(meta, key(name), where)
    heads = require_int(meta, key("attention.head_count"), where)
    kv_heads = arch.get("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise SpecError(
            f"{where}: {key('attention.head_count_kv')} {kv_heads!r} does not divide "
            f"the {heads} attention heads"
        )
    require_int(meta, key("context_length"), where)
    for name in ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor"):
        positive(meta, key(name), where)
    for name in arch.required:
        require_int(meta, key(name), where)
    scaling = arch.get("rope.scaling.type", "none")
    if scaling not in SCALING_TYPES:
        raise SpecError(f"{where}: unsupported {key('rope.scaling.type')} {scaling!r} "
                        f"(supported: {', '.join(SCALING_TYPES)})")  # fmt: skip
    arch.head_dim(where)


def _expected_shapes(arch: Architecture, per_layer: list[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor name the file may hold -> the shape its hyper-parameters give it."""
    hidden, ff = arch["embedding_length"], arch["feed_forward_length"]
    heads = arch["attention.head_count"]
    head_dim = arch.head_dim("")
    q, kv = heads * head_dim, arch.get("attention.head_count_kv", heads) * head_dim
    shapes = {"attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden),
              "attn_v.weight": (kv, hidden), "attn_output.weight": (hidden, q),
              "ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden),
              "ffn_down.weight": (hidden, ff), "attn_q.bias": (q,), "attn_k.bias": (kv,),
              "attn_v.bias": (kv,), "attn_q_norm.weight": (head_dim,),
              "attn_k_norm.weight": (head_dim,)}  # fmt: skip
    vocab = len(arch.meta["tokenizer.ggml.tokens"])
    expected = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
                "output.weight": (vocab, hidden),
                "rope_freqs.weight": (head_dim // 2,)}  # fmt: skip
    for i in range(arch["block_count"]):
        for name in per_layer:
            expected[f"blk.{i}.{name}"] = shapes.get(name, (hidden,))  # the rest: norms
    return expected


def _check_tensors(arch: Architecture, info: GGUFInfo, where: str) -> None:
    layers = arch["block_count"]
    if layers * len(arch.blocks) > len(info.tensors):  # before building any per-layer list
        raise SpecError(f"{where}: {arch.key('block_count')} is {layers} but the file has only "
                        f"{len(info.tensors)} tensors")  # fmt: skip
    per_layer = [f"{part}.weight" for part in arch.blocks] + [f"{p}.bias" for p in arch.biases]
    needed = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{name}" for i in range(layers) for name in per_layer
    }
    names = set(info.tensors)
    missing = sorted(needed - names, key=lambda n: (len(n), n))
    if missing:
        raise SpecError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing)")
    unexpected = sorted(names - needed - arch.optional, key=lambda n: (len(n), n))
    if unexpected:
        raise SpecError(f"{where}: unsupported GGUF tensor {unexpected[0]!r} for {arch.name}")
    expected = _expected_shapes(arch, per_layer)
    for name, (shape, _) in info.tensors.items():
        if shape != expected[name]:
            raise SpecError(f"{where}: tensor {name} has shape {shape}, expected "
                            f"{expected[name]} from the hyper-parameters")  # fmt: skip
