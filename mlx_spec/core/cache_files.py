"""Kept decoders as files: mlx-lm's `save_prompt_cache` format (the caches' states flattened
into safetensors, `[metadata, classes, scalars]` in its metadata), with one class of ours added
(`WindowedKVCache`, whose `state` leaves out its offset and window; `MarginChunkedKVCache`,
Llama 4's chunks with a margin) and deepseek_v41's
`LayerCache` (not mlx-lm's cache module's: its attributes and window size), and the identity of the
models a state belongs to. The server's disk tier (server/disk_cache.py) and the Python API's
`save_decoder` / `load_decoder` (decode/saved.py) write and read these files.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_lm_cache

from ..errors import SpecError
from . import caches

FORMAT = "mlx-spec-prompt-cache/1"


def layer_state(c):
    """A layer's (class name, state) as save_prompt_cache flattens it; WindowedKVCache's with
    what its `state` leaves out (the rows it holds, offset, dropped, window settings); a
    LayerCache's attributes and window size. A class `from_layer_state` cannot make again is
    refused (SpecError), never written as a file that does not load back."""
    if isinstance(c, mlx_lm_cache.CacheList):
        return "CacheList", [layer_state(x)[::-1] for x in c.caches]
    if type(c) is caches.WindowedKVCache:
        keys, values = caches._rows(c.keys, c.stored), caches._rows(c.values, c.stored)
        return "WindowedKVCache", (keys, values, c.offset, c.dropped, c.window, c.margin, c.slack)
    if type(c) is caches.MarginChunkedKVCache:  # (Llama 4's: its margin and slack besides)
        held = c.offset - c.start_position
        keys, values = caches._rows(c.keys, held), caches._rows(c.values, held)
        return "MarginChunkedKVCache", (keys, values, c.offset, c.start_position, c.chunk_size,
                                        c.margin, c.slack)  # fmt: skip
    if type(c) is mlx_lm_cache.KVCache and c.keys is not None and c.offset < c.keys.shape[2]:
        # its state is the whole buffer, grown 256 positions at a time: only the rows it holds
        return "KVCache", (c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset)
    if caches.compressed(c):  # (its `state` leaves out the window size)
        return "LayerCache", (*(getattr(c, n) for n in caches.COMPRESSED_FIELDS), c.window_size)
    kind = type(c)  # by exact class: a subclass may keep state its `state` leaves out
    if getattr(mlx_lm_cache, kind.__name__, None) is not kind:
        raise SpecError(f"a {kind.__name__} layer cannot be saved (a cache class mlx-spec "
                        "does not know how to read back)")  # fmt: skip
    return kind.__name__, c.state


def from_layer_state(name: str, state):
    if name == "CacheList":
        cl = mlx_lm_cache.CacheList.__new__(mlx_lm_cache.CacheList)
        cl.caches = [from_layer_state(n, s) for s, n in state]
        return cl
    if name == "WindowedKVCache":
        keys, values, offset, dropped, window, margin, slack = state
        c = caches.WindowedKVCache(int(window), int(margin), int(slack))
        c.keys, c.values, c.offset, c.dropped = keys, values, int(offset), int(dropped)
        return c
    if name == "MarginChunkedKVCache":
        keys, values, offset, start, chunk_size, margin, slack = state
        c = caches.MarginChunkedKVCache(int(chunk_size), int(margin), int(slack))
        c.keys, c.values, c.offset, c.start_position = keys, values, int(offset), int(start)
        return c
    if name == "LayerCache":
        try:  # (a model's module: loaded only here)
            from mlx_lm.models.deepseek_v41 import LayerCache
        except ImportError:
            raise ValueError("a LayerCache layer needs an mlx-lm with deepseek_v41") from None

        *fields, window_size = state
        c = LayerCache(int(window_size))
        for field, value in zip(caches.COMPRESSED_FIELDS, fields, strict=True):
            setattr(c, field, value)
        c.offset = int(c.offset)
        return c
    kind = getattr(mlx_lm_cache, name, None)
    if not (isinstance(kind, type) and issubclass(kind, mlx_lm_cache._BaseCache)):
        raise ValueError(f"unknown cache class {name!r}")
    return kind.from_state(state)


# ------------------------------------------------------------------ heads' states (disk_state)


def arrays_layer(arrays: list) -> mlx_lm_cache.ArraysCache:
    """A head's loose arrays (None allowed) as one ArraysCache layer, which the file holds."""
    layer = mlx_lm_cache.ArraysCache(len(arrays))
    layer.cache = list(arrays)
    return layer


def head_figures(figures, kind: str, *names: str) -> list:
    """The figures a head's `disk_state` gave, in the order of `names`; SpecError where they
    are another kind's or one is missing (a restore never goes on with a wrong state)."""
    if not isinstance(figures, dict) or figures.get("kind") != kind:
        got = figures.get("kind") if isinstance(figures, dict) else type(figures).__name__
        raise SpecError(f"the stored head state is a {got!r} one, not a {kind!r} one")
    missing = [n for n in names if n not in figures]
    if missing:
        raise SpecError(f"the stored {kind} state has no {missing[0]!r}")
    return [figures[n] for n in names]


def head_layers(layers: list, kinds: list, kind: str) -> None:
    """Refuse (SpecError) stored layers of other classes or another count than `kinds`."""
    got, want = [type(c).__name__ for c in layers], [k.__name__ for k in kinds]
    if got != want:
        raise SpecError(f"the stored {kind} state holds layers {got}, not {want}")


def check_kv(c, heads: int | None, dim: int | None, kind: str) -> None:
    """A stored KVCache of a head: keys and values (1, heads, >= offset, dim), or empty."""
    keys, values = c.keys, c.values
    if keys is None or values is None:
        if c.offset or keys is not values:
            raise SpecError(f"the stored {kind} cache holds {c.offset} positions and no keys")
        return
    want = (1, heads or keys.shape[1], keys.shape[2], dim or keys.shape[3])
    if keys.ndim != 4 or keys.shape != want or values.shape[:3] != want[:3]:
        raise SpecError(f"the stored {kind} cache has keys {keys.shape}, not {want}")
    if keys.shape[2] < c.offset:
        raise SpecError(f"the stored {kind} cache holds {keys.shape[2]} of {c.offset} positions")


def check_rows(a, width: int, kind: str, what: str) -> None:
    """A stored (rows, width) array of a head's (None allowed)."""
    if a is not None and (a.ndim != 2 or a.shape[1] != width):
        raise SpecError(f"the stored {kind} {what} have shape {a.shape}, not (rows, {width})")


def cache_file_parts(cache: list, metadata: dict) -> tuple[dict, dict]:
    """mlx-lm's save_prompt_cache up to the write: (arrays, metadata) of a safetensors file."""
    scalars = [""]

    def map_data(item):
        i, data = item
        if isinstance(data, mx.array):
            return item
        if isinstance(data, bool | int | float):
            scalars.append((i, "scalar"))
            return i, mx.array(data)
        if isinstance(data, str):
            scalars.append((i, "string"))
            return i, mx.array([ord(ch) for ch in data])
        if data is None:
            scalars.append((i, "none"))
            return i, mx.array([])
        raise ValueError(f"cache state is not serializable: {data!r}")

    named = [layer_state(c) for c in cache]
    arrays = dict(map(map_data, tree_flatten([s for _, s in named])))
    meta = dict(tree_flatten([metadata, [n for n, _ in named], scalars]))
    return arrays, meta


def read_cache_file(path: Path) -> tuple[list, dict]:
    """mlx-lm's load_prompt_cache (with `layer_state`'s classes): (caches, metadata)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    return caches_from_parts(arrays, meta)


def caches_from_parts(arrays: dict, meta: dict) -> tuple[list, dict]:
    """What `cache_file_parts` made (read from a file, or not written yet) -> (caches,
    metadata)."""
    arrays = dict(arrays)
    metadata, classes, scalars = tree_unflatten(list(meta.items()))
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        if kind == "scalar":
            arrays[pos] = a.item()
        elif kind == "string":
            arrays[pos] = "".join(map(chr, a.tolist()))
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"unknown scalar type {kind!r}")
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if isinstance(states, dict):  # (tree_unflatten of "0.x" keys gives a list; guard anyway)
        raise ValueError("cache states are not a list")
    return [from_layer_state(c, s) for c, s in zip(classes, states, strict=True)], metadata


def header_metadata(path: Path) -> dict:
    """A safetensors file's metadata from its header alone (no array is read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 64 << 20:
            raise ValueError("header too large")
        header = json.loads(f.read(size))
    return header.get("__metadata__", {})


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(pair) -> str:
    """A hash of what makes a kept state valid for `pair`: another model, other weights (a
    new size or modification time), another adapter or drafter never finds these files."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("mlx-spec")  # (a head shipped in the package may change with it)
    except PackageNotFoundError:
        ours = "?"
    c = pair.config
    parts = [FORMAT, ours, str(pair.speculative)]
    parts += [str(x) for x in (c.drafter, c.draft_bits, c.draft_group_size, c.dtype, c.head)]
    head = Path(c.head) if c.head and Path(c.head).exists() else None
    for path in (pair.target_path, pair.draft_path, pair.draft_adapter, head):
        if path is None:
            parts.append("-")
            continue
        path = Path(path).resolve()
        parts.append(str(path))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        for f in files + [path / "config.json"] * path.is_dir():
            try:
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
            except OSError:
                parts.append(f"{f.name}:?")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def storable(decoder) -> bool:
    """Whether a decoder's state can go to a file: between rounds (one unfed token), and a
    head reading the target's layers only with every position's features (no gap a plain
    reply left: `Decoder.hidden_gap`) and a state it stores (`Drafter.disk_state`: every
    head kind of the package stores one — EAGLE-3, DFlash, DFlash2, DSpark, MTP, Gemma 4's
    assistant; a kind that returns None keeps RAM entries only)."""
    if decoder.unfed != 1 or decoder.stale or not decoder.sequence:
        return False
    if not decoder.hidden_layers:
        return True
    return decoder.hidden_gap is None and decoder.drafter.disk_state() is not None


def decoder_file(decoder, **extra) -> tuple[dict, dict, dict]:
    """A storable decoder's file: (arrays, safetensors metadata, info): the target's layers
    then the drafter's (a draft model's cache, or a head's `disk_state`), the token sequence
    and how to split them back in `info` (with `extra`). The arrays are sliced lazily: evaluate
    them on the thread that made them."""
    draft, draft_tokens, head = [], 0, None
    if decoder.hidden_layers:
        draft, head = decoder.drafter.disk_state()
    elif decoder.drafter is not None and decoder.drafter.held_cache() is not None:
        draft, cached = decoder.drafter.held_cache()
        draft, draft_tokens = list(draft), len(cached)
    info = {"format": FORMAT, "tokens": list(decoder.sequence), "draft": len(draft),
            "draft_tokens": draft_tokens, "head": head, **extra}  # fmt: skip
    arrays, meta = cache_file_parts(list(decoder.cache) + draft, {"info": json.dumps(info)})
    return arrays, meta, info


def file_info(meta: dict) -> dict:
    """The info `decoder_file` put in a file's metadata (ValueError: not this format)."""
    info = json.loads(meta["0.info"] if "0.info" in meta else meta["info"])
    if info.get("format") != FORMAT:
        raise ValueError(f"format {info.get('format')!r}, not {FORMAT!r}")
    return info


def restore_decoder(decoder, layers: list, info: dict):
    """A fresh decoder (make_decoder) holding a file's state: the target's layers adopted, a
    draft model's cache taken over, a head's state given back to the decoder's own head
    (with the target's layers: Gemma 4's assistant reads their keys and values)."""
    split = len(layers) - int(info["draft"])
    target, draft = layers[:split], layers[split:]
    tokens = [int(t) for t in info["tokens"]]
    if info.get("head") is not None:
        decoder.drafter.restore_disk_state(draft, info["head"], target)
        decoder.adopt(tokens, target, head=decoder.drafter)
    else:
        held = (draft, tokens[: int(info["draft_tokens"])]) if draft else None
        decoder.adopt(tokens, target, held)
    decoder.settle()
    return decoder
