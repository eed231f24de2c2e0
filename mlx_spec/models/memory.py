"""Will a pair fit? Weights plus KV cache against the memory this machine lets models use."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx

from ..errors import SpecError
from .model_dir import context_length, read_config, text_config, weight_files


def weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(path))


def kv_cache_bytes(config: dict, context: int, bytes_per_value: int = 2) -> int:
    """Keys and values for `context` tokens in every layer (a plain KV cache)."""
    cfg = text_config(config)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0  # an architecture this estimate does not know: count the weights only
    return 2 * layers * kv_heads * head_dim * context * bytes_per_value


def machine_memory() -> tuple[int | None, str]:
    """The memory models may use: Metal's recommended working set on a Mac with Metal, the
    physical memory elsewhere; None when it cannot be told."""
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            size = info.get("max_recommended_working_set_size")
            if size:
                return int(size), "Metal's recommended working set"
    except (AttributeError, RuntimeError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "system memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


DEFAULT_MEMORY_CONTEXT = 4096  # tokens of KV cache assumed when the caller does not say


def check_memory(
    target_path: Path,
    target_config: dict,
    draft_path: Path | None,
    draft_bits: int | None,
    context: int | None,
    shards: int = 1,
    head_path: Path | None = None,
) -> None:
    """Refuse, with the figures, a pair whose weights plus KV cache exceed the machine (a
    target split over `shards` ranks puts about a `shards`-th of it on each)."""
    available, source = machine_memory()
    if available is None:
        return
    model_context = context_length(target_config)
    tokens = context or min(model_context or DEFAULT_MEMORY_CONTEXT, DEFAULT_MEMORY_CONTEXT)
    target = weights_bytes(target_path) // shards
    kv = kv_cache_bytes(target_config, tokens) // shards
    draft = 0
    if draft_path is not None:
        draft = weights_bytes(draft_path)
        kv += kv_cache_bytes(read_config(draft_path), tokens)
    elif draft_bits is not None:
        # a full copy of the target is loaded (whole on every rank), then re-quantized
        draft = weights_bytes(target_path)
        kv *= 2
    if head_path is not None:  # a head's weights (its own KV cache is one layer's: small)
        draft += sum(f.stat().st_size for f in head_path.glob("*.safetensors"))
    need = target + draft + kv
    if need > available:
        gb = 1e9
        second = "head" if head_path is not None else "draft"
        raise SpecError(
            f"the models need about {need / gb:.1f} GB (target {target / gb:.1f} GB, "
            f"{second} {draft / gb:.1f} GB, KV cache for {tokens} tokens {kv / gb:.1f} GB) but "
            f"{source} is {available / gb:.1f} GB; use a smaller pair or --force to try anyway"
        )
