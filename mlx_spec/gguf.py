"""GGUF files as a model source: convert once into the mlx-lm layout, then reuse.

The header, metadata and tensor table are read and bounds-checked in Python (`read_gguf_info`)
before any tensor data is touched; the tensors are then decoded from the bytes with numpy
(`gguf_quants`): float tensors keep their precision, quantized ones become MLX affine
quantization (K-quants included: never a silent float16 blow-up) unless a dtype dequantizes.
Each architecture maps onto mlx-lm's own model class of its family (no model code here), and
the tokenizer is rebuilt from `tokenizer.ggml.*` with the pre-tokenizer the file declares.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import gguf_quants
from .errors import SpecError, one_line
from .model_dir import check_model_dir

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LINEAR = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# per architecture: the per-layer tensors (GGUF stem -> mlx-lm module), the layer tensors that
# also carry a `.bias`, and the mlx-lm model_type it becomes
ARCHITECTURES = {
    "llama": {
        "model_type": "llama",
        "blocks": _LINEAR | {"ffn_norm": "post_attention_layernorm"},
        "biases": (),
    },
    "qwen2": {
        "model_type": "qwen2",
        "blocks": _LINEAR | {"ffn_norm": "post_attention_layernorm"},
        "biases": ("attn_q", "attn_k", "attn_v"),
    },
    "qwen3": {
        "model_type": "qwen3",
        "blocks": _LINEAR | _QK_NORM | {"ffn_norm": "post_attention_layernorm"},
        "biases": (),
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "blocks": _LINEAR
        | _QK_NORM
        | {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        "biases": (),
    },
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# the named pre-tokenizers of byte-level BPE vocabularies (llama.cpp's llama-vocab.cpp), as the
# Hugging Face tokenizer.json of each family writes them: regexes applied one after another
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = {
    "llama3": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE],
    "smollm": [r"\p{N}", _GPT2_RE],
    "gpt2": [_GPT2_RE],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
PRE_TOKENIZERS = {
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], "qwen2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell"], "smollm"),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo"], "gpt2"),
    "default": "default",
}
# tokens that end a chat turn, added to eos_token_id when the vocabulary has them as control
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")

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
# the ggml tensor types read here: (name, weights per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
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
        meta = {}
        for _ in range(n_kv):
            key = r.string("key")
            if key in meta:
                r.fail(f"the key {key!r} appears twice")
            meta[key] = r.value(r.unpack("<I"), key)
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            r.fail(f"general.alignment {alignment!r} is not a power of two")
        table = []
        for _ in range(n_tensors):
            name = r.string("tensor name")
            n_dims = r.unpack("<I")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                r.fail(f"tensor {name!r} has {n_dims} dimensions")
            dims = [r.unpack("<Q") for _ in range(n_dims)]
            kind, offset = r.unpack("<I"), r.unpack("<Q")
            table.append((name, dims, kind, offset))
        data_start = -(-f.tell() // alignment) * alignment
    data = size - data_start
    tensors, spans = {}, {}
    for name, dims, kind, offset in table:
        if name in tensors:
            r.fail(f"the tensor {name!r} appears twice")
        if kind not in GGML_TYPES:
            known = ", ".join(t[0] for t in GGML_TYPES.values())
            r.fail(f"tensor {name!r} has a tensor type ({kind}) mlx-spec cannot read "
                   f"(supported: {known})")  # fmt: skip
        type_name, block, block_bytes = GGML_TYPES[kind]
        count = math.prod(dims)
        if min(dims) < 1 or dims[0] % block or count > data:
            r.fail(f"tensor {name!r} has an impossible shape {dims} for {type_name}")
        nbytes = count // block * block_bytes
        if offset % alignment or offset + nbytes > data:
            r.fail(f"tensor {name!r} lies outside the file's data")
        tensors[name] = (tuple(reversed(dims)), type_name)  # GGUF lists the fastest dim first
        spans[name] = (data_start + offset, nbytes)
    return GGUFInfo(meta, tensors, spans)


def _require_int(meta: dict, key: str, where: str, minimum: int = 1) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        shown = "missing" if value is None else repr(value)
        raise SpecError(f"{where}: {key} is {shown}; need an integer >= {minimum}")
    return value


def _positive(meta: dict, key: str, where: str, default: float | None = 1.0):
    value = meta.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise SpecError(f"{where}: {key} is {value!r}; need a positive number")
    return value


def _head_dim(meta: dict, arch: str, hidden: int, heads: int, where: str) -> int:
    """Attention head size: attention.key_length (Qwen3, Gemma 3), else the rotary dimension
    count, else hidden / heads. Partial rotary embeddings are not part of these families."""
    key_length = meta.get(f"{arch}.attention.key_length")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    head_dim = key_length if key_length is not None else rope_dims
    head_dim = hidden // heads if head_dim is None else head_dim
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
        raise SpecError(f"{where}: the attention head size {head_dim!r} is not usable")
    for key in ("attention.value_length", "rope.dimension_count"):
        value = meta.get(f"{arch}.{key}", head_dim)
        if value != head_dim:
            raise SpecError(f"{where}: {arch}.{key} is {value!r} but the heads have "
                            f"{head_dim} dimensions (unsupported)")  # fmt: skip
    if arch == "qwen2" and head_dim != hidden // heads:
        raise SpecError(f"{where}: qwen2 heads of {head_dim} dimensions do not divide "
                        f"{hidden} evenly into {heads} heads")  # fmt: skip
    return head_dim


def _check_tokenizer(meta: dict, where: str) -> None:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise SpecError(
            f"{where}: unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2', "
            "SentencePiece 'llama')"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpecError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings")
    types = meta.get("tokenizer.ggml.token_type")
    if (
        not isinstance(types, list)
        or len(types) != len(tokens)
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in types)
    ):
        raise SpecError(
            f"{where}: tokenizer.ggml.token_type is missing or does not match the tokens"
        )
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(
            isinstance(m, str) and " " in m.strip(" ") for m in merges
        ):
            raise SpecError(f"{where}: tokenizer.ggml.merges is missing or malformed")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            known = ", ".join(PRE_TOKENIZERS)
            raise SpecError(f"{where}: unsupported pre-tokenizer tokenizer.ggml.pre = {pre!r} "
                            f"(supported: {known})")  # fmt: skip
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if (
            not isinstance(scores, list)
            or len(scores) != len(tokens)
            or not all(isinstance(s, float | int) and math.isfinite(s) for s in scores)
        ):
            raise SpecError(f"{where}: tokenizer.ggml.scores is missing or does not match "
                            "the tokens")  # fmt: skip
    for key in ("bos", "eos", "unknown", "padding", "eot"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise SpecError(f"{where}: tokenizer.ggml.{key}_token_id is {value!r}")


def check_model_metadata(info: GGUFInfo, where: str) -> None:
    """The hyper-parameters, tokenizer and tensors a conversion needs, checked against the
    architecture before any conversion starts (so nothing half-usable is ever cached)."""
    meta = info.meta
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise SpecError(f"{where}: unsupported GGUF architecture {arch!r} (supported: {supported})")
    spec = ARCHITECTURES[arch]
    hidden = _require_int(meta, f"{arch}.embedding_length", where)
    layers = _require_int(meta, f"{arch}.block_count", where)
    ff = _require_int(meta, f"{arch}.feed_forward_length", where)
    heads = _require_int(meta, f"{arch}.attention.head_count", where)
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise SpecError(
            f"{where}: {arch}.attention.head_count_kv {kv_heads!r} does not divide "
            f"the {heads} attention heads"
        )
    _require_int(meta, f"{arch}.context_length", where)
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor"):
        _positive(meta, f"{arch}.{key}", where)
    if arch == "gemma3":
        _require_int(meta, "gemma3.attention.sliding_window", where)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise SpecError(f"{where}: unsupported {arch}.rope.scaling.type {scaling!r} "
                        "(supported: none, linear, yarn)")  # fmt: skip
    head_dim = _head_dim(meta, arch, hidden, heads, where)
    _check_tokenizer(meta, where)
    tokens = meta["tokenizer.ggml.tokens"]

    blocks = spec["blocks"]
    if layers * len(blocks) > len(info.tensors):  # before building any per-layer list
        raise SpecError(f"{where}: {arch}.block_count is {layers} but the file has only "
                        f"{len(info.tensors)} tensors")  # fmt: skip
    per_layer = [f"{part}.weight" for part in blocks] + [f"{p}.bias" for p in spec["biases"]]
    needed = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{name}" for i in range(layers) for name in per_layer
    }
    names = set(info.tensors)
    missing = sorted(needed - names, key=lambda n: (len(n), n))
    if missing:
        raise SpecError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing)")
    optional = {"output.weight"} | ({"rope_freqs.weight"} if arch == "llama" else set())
    unexpected = sorted(names - needed - optional, key=lambda n: (len(n), n))
    if unexpected:
        raise SpecError(f"{where}: unsupported GGUF tensor {unexpected[0]!r} for {arch}")
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden),
              "attn_v.weight": (kv, hidden), "attn_output.weight": (hidden, q),
              "ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden),
              "ffn_down.weight": (hidden, ff), "attn_q.bias": (q,), "attn_k.bias": (kv,),
              "attn_v.bias": (kv,), "attn_q_norm.weight": (head_dim,),
              "attn_k_norm.weight": (head_dim,)}  # fmt: skip
    vocab = len(tokens)
    expected = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
                "output.weight": (vocab, hidden),
                "rope_freqs.weight": (head_dim // 2,)}  # fmt: skip
    for i in range(layers):
        for name in per_layer:
            expected[f"blk.{i}.{name}"] = shapes.get(name, (hidden,))  # the rest: norms
    for name, (shape, _) in info.tensors.items():
        if shape != expected[name]:
            raise SpecError(f"{where}: tensor {name} has shape {shape}, expected "
                            f"{expected[name]} from the hyper-parameters")  # fmt: skip


def cache_root() -> Path:
    env = os.environ.get("MLX_SPEC_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base if env else base / "mlx-spec") / "gguf"


def default_dtype() -> str:
    """Float precision for a dequantized model: float16 on Metal; float32 on the CPU backend,
    where float16 matmuls are slow and compute-bound."""
    return "float16" if mx.metal.is_available() else "float32"


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


def _mlx_name(arch: str, gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    blocks = ARCHITECTURES[arch]["blocks"]
    if m and m.group(2) in blocks:
        return f"model.layers.{m.group(1)}.{blocks[m.group(2)]}.{suffix}"
    if stem in TENSOR_NAMES:
        return f"{TENSOR_NAMES[stem]}.{suffix}"
    raise SpecError(f"unsupported GGUF tensor {gguf_name!r}")


def _is_matrix(gguf_name: str) -> bool:
    """Tensors that become mlx-lm Linear / Embedding layers (the ones that may stay quantized)."""
    stem, _, suffix = gguf_name.rpartition(".")
    part = stem.rpartition(".")[2]
    return suffix == "weight" and (
        stem in ("token_embd", "output") or (part in _LINEAR and part != "attn_norm")
    )


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders the rows of llama's Q and K projections so each head's
    rotary pairs are adjacent (ggml's "normal" rope rotates pairs (2i, 2i+1)); this undoes it,
    giving the Hugging Face layout that mlx-lm's (non-traditional) rope expects:
    original row r = stored row index[r]."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def _rope_scaling(meta: dict, arch: str, rope_freqs: np.ndarray | None, head_dim: int):
    """mlx-lm's rope_scaling for the file: llama.cpp stores Llama 3.1+'s "llama3" scaling as
    per-dimension factors (`rope_freqs`), others as rope.scaling.* metadata."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", 1.0)
    if rope_freqs is not None:
        factors = rope_freqs.astype(np.float64)
        if not np.all(np.isfinite(factors)) or factors.min() <= 0:
            raise SpecError("rope_freqs holds factors that are not positive numbers")
        if np.all(factors == 1.0):
            return None
        return _llama3_scaling(meta, arch, factors, head_dim)
    if kind == "linear" and factor != 1.0:
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        scaling = {"type": "yarn", "factor": float(factor)}
        if isinstance(original, int) and original > 0:
            scaling["original_max_position_embeddings"] = original
        return scaling
    return None


def _llama3_scaling(meta: dict, arch: str, factors: np.ndarray, head_dim: int) -> dict:
    """Llama 3.1-3.3 all use factor f, low/high frequency factors 1 and 4 and an original
    context of 8192; when the stored factors are exactly those, say so ("llama3"); otherwise
    carry the factors themselves (mlx-lm's per-dimension factor rope, at scale 1)."""
    base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    factor = float(factors.max())
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2) / head_dim)
    low, high, old = 1.0, 4.0, 8192
    smooth = (old / wavelen - low) / (high - low)
    expect = np.where(
        wavelen < old / high,
        1.0,
        np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if np.allclose(expect, factors, rtol=1e-5, atol=0):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": old}  # fmt: skip
    context = meta[f"{arch}.context_length"]
    return {"rope_type": "longrope", "long_factor": factors.tolist(),
            "short_factor": factors.tolist(),
            "original_max_position_embeddings": context}  # fmt: skip


def _config(info: GGUFInfo, weights: dict, quantization: dict | None, rope_freqs) -> dict:
    meta = info.meta
    arch = meta["general.architecture"]
    hidden = meta[f"{arch}.embedding_length"]
    heads = meta[f"{arch}.attention.head_count"]
    layers = meta[f"{arch}.block_count"]
    head_dim = _head_dim(meta, arch, hidden, heads, "")
    config = {
        "model_type": ARCHITECTURES[arch]["model_type"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        # Q/K are stored (or, for llama, restored) in the Hugging Face rotary layout
        "rope_traditional": False,
        "rope_scaling": _rope_scaling(meta, arch, rope_freqs, head_dim),
        "max_position_embeddings": meta[f"{arch}.context_length"],
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
    }
    if arch == "gemma3":
        window = meta["gemma3.attention.sliding_window"]
        # llama.cpp: the 27B model (62 layers) scales queries by hidden/heads, the others by
        # the head size; every sixth layer is global, the others slide with base 10000
        scalar = hidden // heads if layers == 62 else head_dim
        config |= {
            "query_pre_attn_scalar": scalar,
            "sliding_window": window,
            "sliding_window_pattern": meta.get("gemma3.attention.sliding_window_pattern", 6),
            "rope_local_base_freq": 10000.0,
            "rope_theta": meta.get("gemma3.rope.freq_base", 1_000_000.0),
        }
    if quantization:
        config["quantization"] = quantization
    return config


def _eos_ids(meta: dict):
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ids = []
    for key in ("eos", "eot"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens) and i not in ids:
            ids.append(i)
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == 3}
    ids += [control[t] for t in END_OF_TURN if t in control and control[t] not in ids]
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


class _Report:
    """What conversion did to each tensor type, and the memory it takes, for one line."""

    def __init__(self):
        self.kinds: dict[str, str] = {}
        self.bytes = 0

    def add(self, type_name: str, what: str, arrays) -> None:
        self.kinds.setdefault(type_name, what)
        self.bytes += sum(a.nbytes for a in arrays)

    def line(self, gguf: Path) -> str:
        kinds = ", ".join(f"{k} -> {v}" for k, v in sorted(self.kinds.items()))
        size = gguf.stat().st_size
        return (f"{gguf.name}: {kinds}; {self.bytes / 1e6:.0f} MB in memory "
                f"(file {size / 1e6:.0f} MB, {self.bytes / size:.2f}x)")  # fmt: skip


def _weights(gguf: Path, info: GGUFInfo, dtype: str | None, report: _Report):
    """The renamed (and, for llama, un-permuted) weights, the per-layer quantization table
    (None when dequantized or when nothing is quantized) and the rope_freqs factors."""
    meta = info.meta
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    target = DTYPES[dtype] if dtype else None
    data = np.memmap(gguf, dtype=np.uint8, mode="r")
    weights, layers, rope_freqs = {}, {}, None
    for name, (shape, type_name) in info.tensors.items():
        start, nbytes = info.spans[name]
        raw = data[start : start + nbytes]
        if name == "rope_freqs.weight":
            rope_freqs = _dequantized(type_name, raw, shape)
            continue
        out = _mlx_name(arch, name)
        rows = None
        if arch == "llama" and re.fullmatch(r"blk\.\d+\.attn_[qk]\.(weight|bias)", name):
            rows = _unpermute_rows(shape[0], heads if ".attn_q." in name else kv_heads)
        quantized = type_name not in gguf_quants.FLOATS
        if target is not None or not quantized or not _is_matrix(name):
            if arch == "gemma3" and name.endswith("norm.weight"):
                # llama.cpp stores Gemma's norm weights as 1 + w; mlx-lm's norm adds the 1
                value = mx.array(_dequantized(type_name, raw, shape) - 1)
            elif quantized:
                value = mx.array(_dequantized(type_name, raw, shape))
            else:
                value = mx.array(gguf_quants.float_array(type_name, raw, shape))
                value = value.view(mx.bfloat16) if type_name == "BF16" else value
            if rows is not None:
                value = value[mx.array(rows)]
            if target is not None:
                value = value.astype(target)
            weights[out] = value
            report.add(type_name, str(value.dtype).removeprefix("mlx.core."), [value])
            continue
        packed, scales, biases, group, bits, what = _quantized(type_name, raw, shape)
        if rows is not None:
            packed, scales, biases = packed[rows], scales[rows], biases[rows]
        module = out.removesuffix(".weight")
        arrays = [mx.array(packed), mx.array(scales), mx.array(biases)]
        weights[out], weights[f"{module}.scales"], weights[f"{module}.biases"] = arrays
        layers[module] = {"group_size": group, "bits": bits}
        report.add(type_name, what, arrays)
    if not layers:
        return weights, None, rope_freqs
    common = max(layers.values(), key=list(layers.values()).count)
    return weights, {**common, **layers}, rope_freqs


def _quantized(type_name: str, raw: np.ndarray, shape: tuple[int, ...]):
    """A quantized matrix in MLX's affine format (packed uint32 codes, float16 scales and
    biases), decoded a few million weights at a time so the temporaries stay small."""
    rows, cols = shape
    block, block_bytes, _ = gguf_quants.DECODERS[type_name]
    row_bytes = cols // block * block_bytes
    step = max(1, (1 << 22) // cols)
    parts = []
    for r in range(0, rows, step):
        n = min(step, rows - r)
        affine = gguf_quants.decode(type_name, raw[r * row_bytes : (r + n) * row_bytes], (n, cols))
        if affine.group in (32, 64, 128):
            group, bits = affine.group, affine.bits
            packed = gguf_quants.pack(affine.q, bits)
            scales, biases = affine.scale.astype(np.float16), affine.bias.astype(np.float16)
        else:  # 16-weight sub-blocks: re-quantize to groups of 32, with more bits
            group, bits = gguf_quants.MLX_GROUP, gguf_quants.REQUANT_BITS[type_name]
            w, s, b = mx.quantize(mx.array(affine.dequantize()), group_size=group, bits=bits)
            packed = np.array(w)
            scales = np.array(s.astype(mx.float16))
            biases = np.array(b.astype(mx.float16))
        parts.append((packed, scales, biases))
    packed, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    exact = type_name not in gguf_quants.REQUANT_BITS
    what = f"{bits}-bit group {group}" + ("" if exact else " (re-quantized)")
    return packed, scales, biases, group, bits, what


def _dequantized(type_name: str, raw: np.ndarray, shape) -> np.ndarray:
    if type_name == "BF16":
        bits = gguf_quants.float_array(type_name, raw, shape).astype(np.uint32) << 16
        return bits.view(np.float32)
    if type_name in gguf_quants.FLOATS:
        return gguf_quants.float_array(type_name, raw, shape).astype(np.float32)
    return gguf_quants.decode(type_name, raw, shape).dequantize().reshape(shape)


def write_tokenizer(meta: dict, out: Path) -> None:
    """A Hugging Face fast tokenizer from `tokenizer.ggml.*`: byte-level BPE ('gpt2') with the
    declared pre-tokenizer, or SentencePiece ('llama': Llama 2, TinyLlama, Gemma) with byte
    fallback, its merges ranked by the scores."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise SpecError(f"unsupported GGUF tokenizer {kind!r}")
    try:
        _build_tokenizer(meta, out)
    except SpecError:
        raise
    except Exception as err:  # the tokenizers library raises bare Exceptions on bad vocabularies
        raise SpecError(
            f"cannot build the tokenizer from the GGUF metadata: {one_line(err)}"
        ) from None


def _bpe_tokenizer(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]
    # llama.cpp applies the regexes in turn, each splitting the pieces of the one before and
    # keeping the text between matches as pieces too: the tokenizers library's "isolated" split
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE[pre]]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(meta: dict, tokens: list[str], types: list[int]):
    """SentencePiece BPE as llama.cpp runs it: spaces become "▁" (with one in front unless
    add_space_prefix is false), then adjacent pieces merge, highest-scoring result first;
    characters outside the vocabulary fall back to <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta["tokenizer.ggml.scores"]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != 1 or vocab[t] != i:  # only normal tokens are merge results
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                merges.append((-scores[i], i, k, t[:k], t[k:]))
    merges.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _build_tokenizer(meta: dict, out: Path) -> None:
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if meta["tokenizer.ggml.model"] == "gpt2":
        tok = _bpe_tokenizer(meta, tokens)
    else:
        tok = _spm_tokenizer(meta, tokens, types)
    # control tokens (3) are special; user-defined ones (4, e.g. Qwen3's <think>) match whole
    pairs = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty == 3]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == 4])

    def token(key):
        i = meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    default_bos = meta["tokenizer.ggml.model"] == "llama"  # llama.cpp's default for SPM
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", default_bos) is True:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        fast.chat_template = template
    fast.save_pretrained(str(out))


def convert(gguf: Path, out: Path, dtype: str | None = None, report=None) -> Path:
    """Write the mlx-lm layout of `gguf` to `out`, atomically: all of it or nothing.

    The header, metadata and tensor table are checked in Python first, tensors are decoded
    from the checked byte ranges, and the result is loaded once before it takes its final
    name. `report` (default: print to stderr) gets one line: the format chosen for each
    tensor type and the memory the converted weights take against the file's size."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise SpecError(f"GGUF file does not exist: {gguf}")
    if dtype is not None and dtype not in DTYPES:
        raise SpecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    info = read_gguf_info(gguf)
    check_model_metadata(info, str(gguf))
    summary = _Report()
    try:
        with np.errstate(all="ignore"):  # a damaged file's NaNs are its own business
            weights, quantization, rope_freqs = _weights(gguf, info, dtype, summary)
    except OSError as err:
        raise SpecError(f"cannot read GGUF file {gguf}: {err.strerror or err}") from None
    try:
        config = _config(info, weights, quantization, rope_freqs)
    except (ValueError, TypeError, SpecError) as err:
        raise SpecError(f"{gguf}: {one_line(err)}") from None
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise SpecError(f"cannot write {out}: {err.strerror}") from None
    try:
        try:
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        except (OSError, RuntimeError) as err:
            raise SpecError(
                f"cannot write {out}: {getattr(err, 'strerror', None) or err}"
            ) from None
        write_tokenizer(info.meta, tmp)
        _check_loads(tmp, gguf)
        try:
            tmp.rename(out)
        except OSError as err:
            raise SpecError(f"cannot write {out}: {err.strerror}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    line = summary.line(gguf)
    if report is None:
        print(line, file=sys.stderr, flush=True)
    else:
        report(line)
    return out


def _check_loads(path: Path, gguf: Path) -> None:
    """Build the model from the converted files (lazily: no weights read) so a file whose
    tensors do not fit its own hyper-parameters fails here, before anything is cached."""
    from mlx_lm.utils import load_model

    try:
        load_model(path, lazy=True)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise SpecError(f"{gguf}: the converted model does not load: {one_line(err)}") from None
