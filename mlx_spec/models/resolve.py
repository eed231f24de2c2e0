"""A model name -> a local directory mlx-lm can load: a model directory as it is, a .gguf file
converted once into the cache (gguf/), a Hugging Face id from the cache or downloaded (hub.py).
Apart from hub.py because the GGUF converter loads MLX, which hub.py's callers need not."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecError
from .gguf import converted_path, default_dtype
from .hub import expand_path, hub_snapshot, looks_like_path, package_file


def resolve_model(name: str, dtype: str | None = None, progress=None) -> Path:
    """A local model directory for a path, a .gguf file or a Hugging Face id (downloaded if
    needed). `dtype` dequantizes a GGUF file ("auto": float16 on Metal, float32 on CPU)."""
    if not name:
        raise SpecError("the model path or id is empty")
    path = package_file(name) if name.startswith("package:") else expand_path(name)
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return converted_path(
                path, default_dtype() if dtype == "auto" else dtype, report=progress
            )
        if not (path / "config.json").is_file():
            raise SpecError(f"{name} is not a model directory (it has no config.json)")
        return path
    if looks_like_path(name):
        raise SpecError(f"model path does not exist: {name}")
    return hub_snapshot(name, progress)
