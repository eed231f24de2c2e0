"""The GGUF binary format: header, metadata and tensor table, read and bounds-checked in
Python (no native code) before any tensor data is touched."""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from ...errors import SpecError
from .quants import GGML_TYPES

# GGUF metadata value types: struct format of the scalars; 8 = string, 9 = array
GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
GGUF_STRING, GGUF_ARRAY = 8, 9
GGML_MAX_DIMS = 4
MAX_NAME = 1 << 16  # bytes in a key or tensor name; real ones are < 100


class GGUFInfo:
    """What the header says, read and bounds-checked in Python: metadata (Python values),
    the tensor table (name -> (shape, type name)) and where each tensor's bytes lie
    (name -> (offset from the start of the file, length))."""

    def __init__(
        self,
        meta: dict,
        tensors: dict[str, tuple[tuple[int, ...], str]],
        spans: dict[str, tuple[int, int]] | None = None,
    ):
        self.meta, self.tensors, self.spans = meta, tensors, spans or {}


class _Reader:
    def __init__(self, f, size: int, where: str):
        self.f, self.size, self.where = f, size, where

    def fail(self, what: str):
        raise SpecError(f"{self.where} is not a valid GGUF file: {what}")

    def remaining(self) -> int:
        return self.size - self.f.tell()

    def read(self, n: int) -> bytes:
        if n > self.remaining():
            self.fail("it is truncated")
        return self.f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q")
        if n > self.remaining() or (what != "value" and n > MAX_NAME):
            self.fail(f"a {what} string of {n} bytes does not fit in the file")
        try:
            return self.read(n).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"a {what} string is not UTF-8")

    def value(self, kind: int, key: str, depth: int = 0):
        if kind in GGUF_SCALARS:
            return self.unpack(GGUF_SCALARS[kind])
        if kind == GGUF_STRING:
            return self.string("value")
        if kind == GGUF_ARRAY and depth == 0:
            inner, n = self.unpack("<I"), self.unpack("<Q")
            least = struct.calcsize(GGUF_SCALARS[inner]) if inner in GGUF_SCALARS else 8
            if inner == GGUF_ARRAY:
                self.fail(f"{key} is an array of arrays")
            if n * least > self.remaining():
                self.fail(f"{key} claims {n} items, more than the file holds")
            if inner in GGUF_SCALARS:  # one read and one unpack: fast for big tables
                fmt = GGUF_SCALARS[inner]
                return list(struct.unpack(f"<{n}{fmt[1]}", self.read(n * least)))
            return [self.value(inner, key, depth + 1) for _ in range(n)]
        self.fail(f"{key} has an unknown value type {kind}")

    def metadata(self, n_kv: int) -> dict:
        meta = {}
        for _ in range(n_kv):
            key = self.string("key")
            if key in meta:
                self.fail(f"the key {key!r} appears twice")
            meta[key] = self.value(self.unpack("<I"), key)
        return meta

    def tensor_entry(self) -> tuple[str, list[int], int, int]:
        name = self.string("tensor name")
        n_dims = self.unpack("<I")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            self.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = [self.unpack("<Q") for _ in range(n_dims)]
        kind, offset = self.unpack("<I"), self.unpack("<Q")
        return name, dims, kind, offset


def read_gguf_info(path: Path) -> GGUFInfo:
    """Parse and check a GGUF header, metadata and tensor table without any native code:
    every count and offset is compared with the file size, so a hostile or damaged file gives
    one SpecError here instead of a crash in MLX's reader."""
    where = str(path)
    try:
        f = open(path, "rb")
    except OSError as err:
        raise SpecError(f"cannot read GGUF file {path}: {err.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, size, where)
        if size < 24 or f.read(4) != b"GGUF":
            r.fail("no GGUF header")
        version = r.unpack("<I")
        if version not in (2, 3):
            r.fail(f"unsupported version {version} (supported: 2, 3)")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        # a key/value takes at least 8+4+1 bytes, a tensor entry at least 8+4+8+4+8
        if n_kv * 13 > r.remaining() or n_tensors * 32 > r.remaining():
            r.fail(f"it claims {n_tensors} tensors and {n_kv} metadata entries")
        meta = r.metadata(n_kv)
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            r.fail(f"general.alignment {alignment!r} is not a power of two")
        table = [r.tensor_entry() for _ in range(n_tensors)]
        data_start = -(-f.tell() // alignment) * alignment
    tensors, spans = _locate(r, table, data_start, alignment)
    return GGUFInfo(meta, tensors, spans)


def _locate(r: _Reader, table: list, data_start: int, alignment: int):
    """Each tensor's shape (as MLX sees it) and type, and its byte range, checked against the
    data the file holds."""
    data = r.size - data_start
    tensors, spans = {}, {}
    for name, dims, kind, offset in table:
        if name in tensors:
            r.fail(f"the tensor {name!r} appears twice")
        if kind not in GGML_TYPES:
            known = ", ".join(t.name for t in GGML_TYPES.values())
            r.fail(f"tensor {name!r} has a tensor type ({kind}) mlx-spec cannot read "
                   f"(supported: {known})")  # fmt: skip
        ggml = GGML_TYPES[kind]
        count = math.prod(dims)
        if min(dims) < 1 or dims[0] % ggml.block or count > data:
            r.fail(f"tensor {name!r} has an impossible shape {dims} for {ggml.name}")
        nbytes = count // ggml.block * ggml.nbytes
        if offset % alignment or offset + nbytes > data:
            r.fail(f"tensor {name!r} lies outside the file's data")
        tensors[name] = (tuple(reversed(dims)), ggml.name)  # GGUF lists the fastest dim first
        spans[name] = (data_start + offset, nbytes)
    return tensors, spans
