"""The conversion cache: one directory per (file digest, dtype), converted once under a file
lock, checked before reuse, partial directories of killed runs removed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from ...errors import SpecError
from ..model_dir import check_model_dir
from .conversion import convert
from .reader import read_gguf_info
from .validation import check_model_metadata


def cache_root() -> Path:
    env = os.environ.get("MLX_SPEC_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base if env else base / "mlx-spec") / "gguf"


def _cache_dir() -> Path:
    """The conversion cache, created if needed; one line when it cannot be used."""
    root = cache_root()
    name = "MLX_SPEC_CACHE" if os.environ.get("MLX_SPEC_CACHE") else "the cache directory"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(f"cannot use {name} {root}: {err.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise SpecError(f"cannot use {name} {root}: it is not writable")
    return root


def file_digest(path: Path) -> str:
    """sha256 of the file, remembered per (path, size, mtime) so big files hash once."""
    stat = path.stat()
    index_path = cache_root() / "digests.json"
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):  # a damaged index is only a cache: start again
        index = {}
    if key not in index:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        index[key] = h.hexdigest()
        tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(index))
            tmp.replace(index_path)
        except OSError:  # remembering is an optimisation; hashing again next time is fine
            tmp.unlink(missing_ok=True)
    return index[key]


def _usable(out: Path) -> bool:
    """Whether a cached conversion is complete and readable (a damaged one is redone)."""
    if not out.is_dir() or not (out / "tokenizer.json").is_file():
        return False
    try:
        check_model_dir(out)
    except (SpecError, OSError):
        return False
    return True


def _lock(path: Path, timeout: float = -1):
    from filelock import FileLock

    return FileLock(f"{path}.lock", timeout=timeout)


def remove_stale(root: Path, held: str | None = None) -> None:
    """Delete hidden partial conversions (`.<name>.<random>`) left by killed runs: a partial
    directory is stale when nobody holds its conversion's lock (`held`: the name whose lock
    this process holds, so its partial directories are stale too)."""
    from filelock import Timeout

    for tmp in root.glob(".*.*"):
        m = re.fullmatch(r"\.(.+)\.[^.]+", tmp.name)
        if not m or not tmp.is_dir():
            continue
        if m.group(1) == held:
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        try:
            with _lock(root / m.group(1), timeout=0):
                shutil.rmtree(tmp, ignore_errors=True)
        except Timeout:  # a live conversion owns it
            continue


def converted_path(gguf: Path, dtype: str | None = None, report=None) -> Path:
    """The mlx-lm directory for `gguf` (quantized as in the file, or dequantized to `dtype`),
    converting on first use (`report(line)` gets the conversion's one line; default: stderr).

    The file is checked before anything touches the cache. Conversion runs under a file lock:
    a second process converting the same file waits, then reuses the result."""
    gguf = Path(gguf)
    check_model_metadata(read_gguf_info(gguf), str(gguf))
    root = _cache_dir()
    # the name is what users' caches hold: changing it would orphan every conversion made
    out = root / f"{file_digest(gguf)[:16]}-{dtype or 'q'}"
    if _usable(out):
        return out
    with _lock(out):
        remove_stale(root, held=out.name)
        if not _usable(out):  # missing, or damaged: (re)convert
            if out.exists():
                shutil.rmtree(out)
            convert(gguf, out, dtype, report)
    return out
