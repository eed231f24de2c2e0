"""GGUF files as a model source: convert once into the mlx-lm layout, then reuse.

MLX reads GGUF itself (`mx.load(path, return_metadata=True)`); Q4_0, Q4_1 and Q8_0 tensors
arrive as MLX-quantized arrays (weight, scales, biases; blocks of 32). This module renames
tensors to mlx-lm's llama layout, writes config.json with the quantization of each tensor,
and builds a Hugging Face tokenizer from the `tokenizer.ggml.*` metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import mlx.core as mx

from .errors import SpecError

GGUF_BLOCK = 32  # Q4_0 / Q4_1 / Q8_0 quantize blocks of 32 weights
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
SUPPORTED_ARCHITECTURES = ("llama",)

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
# ggml tensor types MLX's reader takes: (weights per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
GGML_MAX_DIMS = 4
MAX_NAME = 1 << 16  # bytes in a key or tensor name; real ones are < 100


class GGUFInfo:
    """What the header says, read and bounds-checked in Python: metadata (Python values)
    and the tensor table (name -> (shape, type name))."""

    def __init__(self, meta: dict, tensors: dict[str, tuple[tuple[int, ...], str]]):
        self.meta, self.tensors = meta, tensors


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
    tensors = {}
    for name, dims, kind, offset in table:
        if name in tensors:
            r.fail(f"the tensor {name!r} appears twice")
        if kind not in GGML_TYPES:
            r.fail(f"tensor {name!r} has a tensor type ({kind}) MLX cannot read")
        type_name, block, block_bytes = GGML_TYPES[kind]
        count = math.prod(dims)
        if min(dims) < 1 or dims[0] % block or count > data:
            r.fail(f"tensor {name!r} has an impossible shape {dims} for {type_name}")
        nbytes = count // block * block_bytes
        if offset % alignment or offset + nbytes > data:
            r.fail(f"tensor {name!r} lies outside the file's data")
        tensors[name] = (tuple(reversed(dims)), type_name)  # GGUF lists the fastest dim first
    return GGUFInfo(meta, tensors)


def _require_int(meta: dict, key: str, where: str, minimum: int = 1) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        shown = "missing" if value is None else repr(value)
        raise SpecError(f"{where}: {key} is {shown}; need an integer >= {minimum}")
    return value


def check_model_metadata(info: GGUFInfo, where: str) -> None:
    """The hyper-parameters, tokenizer and tensors a llama conversion needs, checked before any
    conversion starts (so nothing half-usable is ever cached)."""
    meta = info.meta
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise SpecError(f"{where}: unsupported GGUF architecture {arch!r} (supported: {supported})")
    hidden = _require_int(meta, f"{arch}.embedding_length", where)
    layers = _require_int(meta, f"{arch}.block_count", where)
    _require_int(meta, f"{arch}.feed_forward_length", where)
    heads = _require_int(meta, f"{arch}.attention.head_count", where)
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise SpecError(
            f"{where}: {arch}.attention.head_count_kv {kv_heads!r} does not divide "
            f"the {heads} attention heads"
        )
    _require_int(meta, f"{arch}.context_length", where)
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon"):
        value = meta.get(f"{arch}.{key}", 1.0)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise SpecError(f"{where}: {arch}.{key} is {value!r}; need a positive number")
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and (not isinstance(value, int) or value < 0):
            raise SpecError(f"{where}: tokenizer.ggml.{key} is {value!r}")
    head_dim = meta.get(f"{arch}.rope.dimension_count", hidden // heads)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise SpecError(f"{where}: {arch}.rope.dimension_count {head_dim!r} is not usable")
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecError(
            f"{where}: unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2')"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpecError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(
        isinstance(m, str) and " " in m.strip(" ") for m in merges
    ):
        raise SpecError(f"{where}: tokenizer.ggml.merges is missing or malformed")
    types = meta.get("tokenizer.ggml.token_type")
    if not isinstance(types, list) or len(types) != len(tokens):
        raise SpecError(
            f"{where}: tokenizer.ggml.token_type is missing or does not match the tokens"
        )
    if layers * len(BLOCK_NAMES) > len(info.tensors):  # before building any per-layer list
        raise SpecError(f"{where}: {arch}.block_count is {layers} but the file has only "
                        f"{len(info.tensors)} tensors")  # fmt: skip
    names = set(info.tensors)
    needed = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(layers) for part in BLOCK_NAMES
    }
    missing = sorted(needed - names, key=lambda n: (len(n), n))
    if missing:
        raise SpecError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing)")
    for name in names:
        stem = name.rpartition(".")[0]
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if (m and (int(m.group(1)) >= layers or m.group(2) not in BLOCK_NAMES)) or (
            not m and stem not in TENSOR_NAMES
        ):
            raise SpecError(f"{where}: unsupported GGUF tensor {name!r}")
    ff = meta[f"{arch}.feed_forward_length"]
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
              "attn_output": (hidden, q), "ffn_gate": (ff, hidden), "ffn_up": (ff, hidden),
              "ffn_down": (hidden, ff), "attn_norm": (hidden,), "ffn_norm": (hidden,)}  # fmt: skip
    expected = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,),
                "output.weight": (len(tokens), hidden)}  # fmt: skip
    expected |= {f"blk.{i}.{k}.weight": v for i in range(layers) for k, v in shapes.items()}
    for name, (shape, _) in info.tensors.items():
        if name in expected and shape != expected[name]:
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
    from .loading import check_model_dir

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


def converted_path(gguf: Path, dtype: str | None = None) -> Path:
    """The mlx-lm directory for `gguf` (quantized as in the file, or dequantized to `dtype`),
    converting on first use.

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
            convert(gguf, out, dtype)
    return out


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _mlx_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / scales / biases / bias
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{suffix}"
    if stem in TENSOR_NAMES:
        return f"{TENSOR_NAMES[stem]}.{suffix}"
    raise SpecError(f"unsupported GGUF tensor {gguf_name!r}")


def _quant_bits(weight: mx.array, scales: mx.array) -> int:
    """Bits per weight from packed shapes: weight (out, in*bits/32) uint32, scales (out, in/32)."""
    bits, rem = divmod(weight.shape[-1], scales.shape[-1])
    if rem or bits not in (2, 3, 4, 5, 6, 8):
        raise SpecError(f"unsupported GGUF quantization (shapes {weight.shape}, {scales.shape})")
    return bits


def _config(meta: dict, weights: dict, quantization: dict | None) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise SpecError(f"unsupported GGUF architecture {arch!r} (supported: {supported})")
    hidden = _scalar(meta, f"{arch}.embedding_length")
    heads = _scalar(meta, f"{arch}.attention.head_count")
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(meta, f"{arch}.block_count"),
        "intermediate_size": _scalar(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _scalar(meta, f"{arch}.rope.dimension_count", hidden // heads),
        "rms_norm_eps": _scalar(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _scalar(meta, f"{arch}.rope.freq_base", 10000.0),
        # llama.cpp stores Q/K for the interleaved ("traditional") rotary layout
        "rope_traditional": True,
        "max_position_embeddings": _scalar(meta, f"{arch}.context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    if quantization:
        config["quantization"] = quantization
    return config


def _weights(tensors: dict, dtype: str | None) -> tuple[dict, dict | None]:
    """Renamed weights, and the per-layer quantization table (None when dequantized)."""
    renamed = {_mlx_name(k): v for k, v in tensors.items()}
    layers = {}
    for name in [n for n in renamed if n.endswith(".scales")]:
        module = name.removesuffix(".scales")
        weight, scales = renamed[f"{module}.weight"], renamed[name]
        if f"{module}.biases" not in renamed:
            raise SpecError(f"unsupported GGUF quantization of {module} (no biases)")
        layers[module] = {"group_size": GGUF_BLOCK, "bits": _quant_bits(weight, scales)}
    if dtype is None:
        if not layers:
            return renamed, None
        common = max(layers.values(), key=list(layers.values()).count)
        return renamed, {**common, **layers}
    target = DTYPES[dtype]
    out = {}
    for name, value in renamed.items():
        module, _, suffix = name.rpartition(".")
        if suffix in ("scales", "biases"):
            continue
        if module in layers:
            q = layers[module]
            value = mx.dequantize(
                value,
                renamed[f"{module}.scales"],
                renamed[f"{module}.biases"],
                q["group_size"],
                q["bits"],
            )
        out[name] = value.astype(target)
    return out, None


def write_tokenizer(meta: dict, out: Path) -> None:
    """A Hugging Face fast tokenizer from `tokenizer.ggml.*` (byte-level BPE with merges)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SpecError(f"unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2')")
    try:
        _build_tokenizer(meta, out)
    except SpecError:
        raise
    except Exception as err:  # the tokenizers library raises bare Exceptions on bad vocabularies
        raise SpecError(
            f"cannot build the tokenizer from the GGUF metadata: {_first_line(err)}"
        ) from None


def _build_tokenizer(meta: dict, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # GPT-2's pre-tokenizer; SmolLM's "pre" splits digits one by one first
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in ("smollm", "qwen2", "llama-bpe"):
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]  # 3: control token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])

    def token(key):
        i = _scalar(meta, key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
    )
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        fast.chat_template = template
    fast.save_pretrained(str(out))


def convert(gguf: Path, out: Path, dtype: str | None = None) -> Path:
    """Write the mlx-lm layout of `gguf` to `out`, atomically: all of it or nothing.

    The header, metadata and tensor table are checked in Python first (MLX's native reader
    trusts them), and the result is loaded once before it takes its final name."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise SpecError(f"GGUF file does not exist: {gguf}")
    if dtype is not None and dtype not in DTYPES:
        raise SpecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    check_model_metadata(read_gguf_info(gguf), str(gguf))
    try:
        tensors, meta = mx.load(str(gguf), return_metadata=True)
    except (RuntimeError, ValueError) as err:
        raise SpecError(f"cannot read GGUF file {gguf}: {err}") from err
    weights, quantization = _weights(tensors, dtype)
    config = _config(meta, weights, quantization)
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
        write_tokenizer(meta, tmp)
        _check_loads(tmp, gguf)
        try:
            tmp.rename(out)
        except OSError as err:
            raise SpecError(f"cannot write {out}: {err.strerror}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_loads(path: Path, gguf: Path) -> None:
    """Build the model from the converted files (lazily: no weights read) so a file whose
    tensors do not fit its own hyper-parameters fails here, before anything is cached."""
    from mlx_lm.utils import load_model

    try:
        load_model(path, lazy=True)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise SpecError(f"{gguf}: the converted model does not load: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split())
