"""A draft from the target's own weights, re-quantized to fewer bits.

A real technique when a family has no small sibling: the draft reads far fewer bytes per
token than the target and agrees with it often (measured on SmolLM2-135M: 3 bits agree with
float32 greedy choices on roughly half the positions; 2 bits on almost none).

MLX and mlx-lm are imported where a copy is made: `PairConfig` checks a pair's bits against
the constants here, and `mlx-spec models` validates every pair without loading either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import SpecError

if TYPE_CHECKING:
    import mlx.nn as nn

# what MLX's affine quantization accepts (mx.quantize); anything else is refused, not skipped
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
SUPPORTED_BITS = QUANT_BITS


def requantized_copy(model: nn.Module, bits: int, group_size: int = 32) -> nn.Module:
    """Quantize `model` in place (dequantizing first if needed) and return it.

    Pass a freshly loaded copy of the target: the target itself must stay untouched.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import dequantize_model

    if bits not in SUPPORTED_BITS:
        raise SpecError(f"draft bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in QUANT_GROUP_SIZES:
        raise SpecError(f"draft group size must be one of {QUANT_GROUP_SIZES}, got {group_size}")
    model = dequantize_model(model)
    # layers whose width is not a multiple of the group stay as they are (MLX cannot group
    # them); if that leaves nothing quantized, the "draft" would be the target itself
    if not any(
        hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
        for _, m in model.named_modules()
    ):
        raise SpecError(
            f"no layer of this model can be quantized with group size {group_size} "
            "(every input width must be a multiple of it)"
        )
    nn.quantize(
        model,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0
        ),
    )
    mx.eval(model.parameters())
    return model
