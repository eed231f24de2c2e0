"""A decoder saved to a file and loaded again: a conversation's caches (the target's, the
drafter's) kept across processes, so its next turn prefills only what is new. The file is the
server's disk-tier format (core/cache_files.py: mlx-lm's save_prompt_cache layout), stamped
with the models' identity; a file of other models, another format or a damaged one is
refused in one line, never loaded.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import mlx.core as mx

from ..core.cache_files import (
    decoder_file,
    file_info,
    header_metadata,
    model_identity,
    read_cache_file,
    restore_decoder,
    storable,
)
from ..errors import SpecError
from .generate import make_decoder


def save_decoder(decoder, path) -> Path:
    """Write `decoder`'s state to `path` (a .safetensors file, written whole or not at all).
    Refused for a decoder mid-stream, one holding nothing, or one whose head lacks features
    (a reply decoded without it: `Decoder.hidden_gap`; the next drafting turn fills them)."""
    path = Path(path)
    if decoder.active:
        raise SpecError("a decoder cannot be saved while a stream is using it")
    if not storable(decoder):
        raise SpecError(
            "this decoder's state cannot be saved: it holds nothing, is mid-round, or its "
            "head lacks the features of a reply decoded without it"
        )
    if decoder.pair is None:
        raise SpecError("only a decoder made by make_decoder(pair) can be saved")
    decoder.settle()
    arrays, meta, _ = decoder_file(decoder, model=model_identity(decoder.pair))
    mx.eval(list(arrays.values()))
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex}.tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        tmp.unlink(missing_ok=True)
        raise SpecError(f"cannot write {path}: {err}") from None
    return path


def load_decoder(pair, path, seed: int | None = None):
    """A decoder for `pair` holding what `save_decoder` wrote to `path`: its next `generate`
    (`decoder=`) reuses the saved tokens as a kept decoder would."""
    path = Path(path)
    try:
        info = file_info(header_metadata(path))
    except FileNotFoundError:
        raise SpecError(f"{path} does not exist") from None
    except (OSError, ValueError, KeyError) as err:
        raise SpecError(f"{path} is not a saved decoder ({err})") from None
    if info.get("model") != model_identity(pair):
        raise SpecError(f"{path} was saved for other models (or other weights) than this pair")
    try:
        layers, _ = read_cache_file(path)
        return restore_decoder(make_decoder(pair, seed), layers, info)
    except (ValueError, RuntimeError, KeyError) as err:
        raise SpecError(f"{path} cannot be loaded: {type(err).__name__}: {err}") from None
