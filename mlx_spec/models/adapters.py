"""LoRA adapters of a draft model in mlx-lm's layout (what `mlx-spec distill` writes)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..errors import SpecError, one_line
from .hub import expand_path
from .model_dir import check_safetensors, json_object

ADAPTER_CONFIG = "adapter_config.json"  # mlx-lm's adapter layout: `mlx_lm.load(adapter_path=...)`


ADAPTER_WEIGHTS = "adapters.safetensors"


def read_adapter_config(path: str | Path) -> tuple[Path, dict]:
    """Check an adapter directory (mlx-lm's layout) before anything is applied; one line when
    it is not one."""
    path = expand_path(str(path))
    if not path.is_dir():
        raise SpecError(f"draft adapter {path} is not a directory")
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise SpecError(f"{path} is not an adapter directory (it has no {ADAPTER_CONFIG})")
    config = json_object(config_file, ADAPTER_CONFIG)
    kind = config.get("fine_tune_type", "lora")
    lora = config.get("lora_parameters")
    layers = config.get("num_layers")
    if kind not in ("lora", "dora"):
        raise SpecError(f"{config_file}: fine_tune_type {kind!r} is not a LoRA adapter")
    if (
        not isinstance(layers, int)
        or not isinstance(lora, dict)
        or not isinstance(lora.get("rank"), int)
        or not isinstance(lora.get("scale"), int | float)
    ):
        raise SpecError(f"{config_file} needs num_layers and lora_parameters with rank and scale")
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise SpecError(f"{path} has no {ADAPTER_WEIGHTS}")
    check_safetensors(weights)
    return path, config


def apply_draft_adapter(model, adapter: str | Path, draft_bits: int | None = None) -> Path:
    """Wrap the draft's layers with the adapter's LoRA weights (mlx-lm's `load_adapters`;
    QLoRA over a quantized draft). An adapter trained for a draft quantized differently from
    this one is refused: its corrections would not fit."""
    from mlx_lm.tuner.utils import load_adapters  # (imports the tuner: only when applying)

    path, config = read_adapter_config(adapter)
    base = (
        config.get("mlx_spec", {}).get("base", {})
        if isinstance(config.get("mlx_spec"), dict)
        else {}
    )
    if "draft_bits" in base and base["draft_bits"] != draft_bits:
        want = (
            "a separate draft model"
            if base["draft_bits"] is None
            else (f"a draft re-quantized to {base['draft_bits']} bits")
        )
        have = "a separate draft model" if draft_bits is None else f"{draft_bits} bits"
        raise SpecError(f"the adapter in {path} was trained for {want}; this draft is {have}")
    try:
        load_adapters(model, str(path))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SpecError(f"cannot apply the adapter in {path}: {one_line(err)}") from None
    mx.eval(model.parameters())
    return path
