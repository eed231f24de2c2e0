"""What mlx-lm will read from a model directory, checked in Python before MLX sees it.

Both `pairs.loading` (every model it loads) and `gguf` (a cached conversion before it is
reused) check directories here, so neither has to import the other.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from mlx_lm.utils import load_config

from ..errors import SpecError, one_line

# safetensors dtypes and their sizes in bytes (the format's own names)
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
SAFETENSORS_HEADER_LIMIT = 100 << 20  # the format's own limit on the JSON header


def json_object(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise SpecError(f"{path} is not a readable {what}: {one_line(err, reason=True)}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def check_safetensors(path: Path) -> int:
    """Check a .safetensors file's header and tensor table against its size, in Python, before
    MLX's native reader sees it; return the file size."""
    size = path.stat().st_size
    where = f"broken weights file {path}"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SpecError(f"{where}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(SAFETENSORS_HEADER_LIMIT, size - 8):
            raise SpecError(f"{where}: header length {n} exceeds the file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise SpecError(f"{where}: the header is not JSON") from None
    if not isinstance(header, dict):
        raise SpecError(f"{where}: the header is not a JSON object")
    data = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (
                dtype in SAFETENSORS_DTYPES
                and isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                and all(isinstance(o, int) and not isinstance(o, bool) for o in (start, end))
                and 0 <= start <= end <= data
                and end - start == math.prod(shape) * SAFETENSORS_DTYPES[dtype]
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise SpecError(f"{where}: tensor {name!r} has a bad entry or lies outside the file")
    return size


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("model*.safetensors"))  # what mlx_lm.load_model reads


def check_model_dir(path: Path) -> dict:
    """Everything mlx-lm will read from a model directory, checked first so bad files give
    one line, not a traceback or a crash inside MLX: config.json, the model type, weights."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecError(f"{path} is not a model directory (it has no config.json)")
    config = json_object(config_file, "config.json")
    generation = path / "generation_config.json"
    if generation.exists():
        try:
            data = json.loads(generation.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            data = {}  # mlx-lm skips an unreadable one too
        if not isinstance(data, dict):
            raise SpecError(f"{generation} must hold a JSON object, not {type(data).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SpecError(f"{config_file} has no model_type")
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except (ValueError, ImportError, KeyError, TypeError, AttributeError):
        raise SpecError(
            f"{config_file}: model_type {model_type!r} is not supported by mlx-lm"
        ) from None
    files = weight_files(path)
    if not files:
        raise SpecError(f"{path} has no weights (no model*.safetensors file)")
    for file in files:
        check_safetensors(file)
    return config


def text_config(config: dict) -> dict:
    """The language model's settings: a multimodal checkpoint (Gemma 3, Qwen3.5, Mistral 3)
    keeps them under text_config; its keys win over the top level's."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def new_output_dir(name: str) -> Path:
    """A directory a command is to create: refused, before any work, when it exists or its
    nearest existing parent is a file or read-only (a missing parent is created)."""
    import os

    out = Path(name)
    if out.exists():
        raise SpecError(f"{out} already exists; choose a new directory")
    parent = out.absolute().parent
    for folder in (parent, *parent.parents):
        if folder.exists():
            if not folder.is_dir():
                raise SpecError(f"cannot write {out}: {folder} is not a directory")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise SpecError(f"cannot write {out}: {folder} is not writable")
            break
    return out


def context_length(config: dict) -> int | None:
    cfg = text_config(config)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def read_config(path: Path) -> dict:
    """config.json with generation_config.json's stop ids merged in, as mlx-lm reads it
    (Qwen3 declares <|endoftext|> there only)."""
    check_model_dir(path)
    return load_config(path)
