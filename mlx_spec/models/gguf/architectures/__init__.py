"""Each GGUF architecture mlx-spec reads: one module, one class (`base.Architecture` holds the
defaults), one line in `ARCHITECTURES`. No model code: each maps onto mlx-lm's own model."""

from __future__ import annotations

from ....errors import SpecError
from .base import Architecture
from .gemma3 import Gemma3
from .llama import Llama
from .qwen2 import Qwen2
from .qwen3 import Qwen3

ARCHITECTURES: dict[str, type[Architecture]] = {
    "llama": Llama,
    "qwen2": Qwen2,
    "qwen3": Qwen3,
    "gemma3": Gemma3,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture(meta: dict, where: str) -> Architecture:
    """The architecture `general.architecture` names, for this file's metadata."""
    name = meta.get("general.architecture")
    if not isinstance(name, str) or name not in ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise SpecError(f"{where}: unsupported GGUF architecture {name!r} (supported: {supported})")
    return ARCHITECTURES[name](meta)
