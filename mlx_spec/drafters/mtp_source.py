"""Where an MTP head comes from, told without MLX: a head name is a head directory or the
original checkpoint to extract one from (`head_source`), extracted heads live in a cache
(`cache_root` / `cache_name`, what `is_head` accepts), and which model types carry an MTP
layer (`FAMILIES`). The MTP kind asks these to say whether a pair's head is already here
(`mlx-spec models`) before anything loads; mtp_head.py, mtp_extract.py and mtp.py use them too.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecError
from ..models.hub import expand_path, looks_like_path

HEAD_TYPE = "mtp"


@dataclass(frozen=True)
class Family:
    """One architecture's MTP layer: its layout (`head`, the class that runs it and reads its
    tensors) and the mlx-lm module, args class and decoder layer class it is built from."""

    layout: str  # "qwen": mtp.* tensors; "nextn": model.layers.{num_hidden_layers}.*
    module: str
    args: str
    layer: str

    def classes(self):
        module = importlib.import_module(f"mlx_lm.models.{self.module}")
        return module, getattr(module, self.args), getattr(module, self.layer)


# model types whose original checkpoints carry an MTP layer mlx-lm's classes can run
FAMILIES = {
    "qwen3_5": Family("qwen", "qwen3_5", "TextModelArgs", "DecoderLayer"),
    "qwen3_5_moe": Family("qwen", "qwen3_5", "TextModelArgs", "DecoderLayer"),
    "qwen3_next": Family("qwen", "qwen3_next", "ModelArgs", "Qwen3NextDecoderLayer"),
    "deepseek_v3": Family("nextn", "deepseek_v3", "ModelArgs", "DeepseekV3DecoderLayer"),
    "glm4_moe": Family("nextn", "glm4_moe", "ModelArgs", "DecoderLayer"),
    "glm4_moe_lite": Family("nextn", "glm4_moe_lite", "ModelArgs", "Glm4MoeLiteDecoderLayer"),
}

SINGLE = "model.safetensors"  # a head's weights; a checkpoint's when it has no index


def cache_root() -> Path:
    """Where heads extracted for a pair are kept: $MLX_SPEC_CACHE/heads, else
    ~/.cache/mlx-spec/heads (beside the GGUF conversions)."""
    env = os.environ.get("MLX_SPEC_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base if env else base / "mlx-spec") / "heads"


def source_identity(source: str) -> str:
    """What the source's content is, cheaply: a directory's config and weight files (names,
    sizes, modification times); a hub id's snapshot revision on this machine ("" when none
    is). A checkpoint rewritten in place, re-downloaded or at a new revision gets another
    head: its old one drafted for other weights (0 of 26 proposals equal to the peer's)."""
    path = Path(source)
    if path.is_dir():
        parts = []
        for f in sorted([*path.glob("*.json"), *path.glob("*.safetensors")]):
            try:
                st = f.stat()
            except OSError:
                continue
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id: the extract says what is wrong
        return ""
    return Path(found).parent.name if isinstance(found, str) else ""  # snapshots/<revision>


def cache_name(source: str, bits: int | None, group_size: int) -> str:
    """One directory per source (a hub id, or a directory's absolute path), its content
    (`source_identity`) and quantization."""

    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", source.strip("/"))[-60:]
    digest = hashlib.sha256(f"{source}\n{source_identity(source)}".encode()).hexdigest()[:10]
    return f"{slug}-{digest}-{f'{bits}bit-g{group_size}' if bits else 'float'}"


def is_head(path: Path) -> bool:
    """Whether a directory is a complete head directory (what extract writes)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False

    head = isinstance(config, dict) and config.get("head_type") == HEAD_TYPE
    return head and (path / SINGLE).is_file()


def target_quantization(config: dict | None) -> tuple[int | None, int]:
    """(bits, group size) of a quantized target's config; (None, 64) for a float one."""
    q = (config or {}).get("quantization")
    bits = q.get("bits") if isinstance(q, dict) else None
    if not isinstance(bits, int) or isinstance(bits, bool):
        return None, 64
    return bits, int(q.get("group_size") or 64)


def head_source(name: str) -> tuple[Path | None, str | None]:
    """A pair's head name -> (a head directory to read as it is, None) or (None, the original
    checkpoint to extract it from: a directory's absolute path or a hub id). MTP heads are not
    published as repositories: a hub id names the model's original repository."""
    if name.startswith("package:"):
        return Path(name), None
    path = expand_path(name)
    if path.is_dir() and not is_original_checkpoint(path):
        return path, None  # a head directory (or not one: read_head says what is wrong)
    if path.exists() or looks_like_path(name):
        if not path.is_dir():
            raise SpecError(f"the head {name} is not a directory")
        return None, str(path.resolve())
    return None, name


def is_original_checkpoint(path: Path) -> bool:
    """A model directory of a family with an MTP layout (not a head directory)."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return (
        isinstance(config, dict)
        and "head_type" not in config
        and config.get("model_type") in FAMILIES
    )


def local_config(target: str) -> dict | None:
    """A target's config.json when it is on this machine (no network), else None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        path = Path(target).expanduser() / "config.json"
        if not path.is_file():
            found = try_to_load_from_cache(target, "config.json")
            path = Path(found) if isinstance(found, str) else None
        return json.loads(path.read_text(encoding="utf-8")) if path else None
    except Exception:  # a GGUF file, a bad id, a damaged file: treated as a float target
        return None
