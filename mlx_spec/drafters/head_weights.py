"""A drafting head's directory read: its config.json and its safetensors, into its module (the
one reader DFlash-style and assistant heads share; an mlx conversion's quantized layers
quantized first, as mlx-lm does)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import SpecError


def load_head_weights(head: nn.Module, path: Path, config: dict, name: str, sanitize) -> None:
    """Every `*.safetensors` of `path` through `sanitize` into `head`, or one SpecError line
    (no files, an unreadable file, weights that do not fit the config)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecError(f"the {name} head {path} has no .safetensors weights")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except Exception as err:  # noqa: BLE001 - mlx raises bare RuntimeErrors
            raise SpecError(f"cannot read {f.name}: {err}") from None
    weights = sanitize(weights)
    quant = config.get("quantization")
    if isinstance(quant, dict):  # an mlx conversion: quantize what the checkpoint quantized
        nn.quantize(
            head,
            group_size=int(quant.get("group_size", 64)),
            bits=int(quant.get("bits", 4)),
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    try:
        head.load_weights(list(weights.items()))
    except ValueError as err:
        raise SpecError(f"the {name} head's weights do not fit its config: {err}") from None


def read_head_config(path: Path, name: str) -> dict:
    """The head's config.json as a dict, or one SpecError line."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise SpecError(f"the {name} head {path} has no config.json") from None
    except (OSError, ValueError) as err:
        raise SpecError(f"the {name} head's config.json cannot be read: {err}") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"the {name} head's config.json is not an object")
    return cfg
