"""One GGUF file -> an mlx-lm model directory, written atomically: all of it or nothing."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...errors import SpecError, one_line
from . import quants
from .architectures import Architecture
from .reader import GGUFInfo, read_gguf_info
from .tokenizer import write_tokenizer
from .validation import check_model_metadata

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def default_dtype() -> str:
    """Float precision for a dequantized model: float16 on Metal; float32 on the CPU backend,
    where float16 matmuls are slow and compute-bound."""
    return "float16" if mx.metal.is_available() else "float32"


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


def _weights(gguf: Path, info: GGUFInfo, arch: Architecture, dtype: str | None, report: _Report):
    """The renamed and sanitized weights, the per-layer quantization table (None when
    dequantized or when nothing is quantized) and the rope_freqs factors."""
    target = DTYPES[dtype] if dtype else None
    data = np.memmap(gguf, dtype=np.uint8, mode="r")
    weights, layers, rope_freqs = {}, {}, None
    for name, (shape, type_name) in info.tensors.items():
        start, nbytes = info.spans[name]
        raw = data[start : start + nbytes]
        if name == "rope_freqs.weight":
            rope_freqs = quants.dequantize(type_name, raw, shape)
            continue
        out = arch.mlx_name(name)
        if target is None and type_name not in quants.FLOATS and arch.is_matrix(name):
            q = quants.mlx_quantized(type_name, raw, shape)
            arrays = arch.sanitize(name, list(q.arrays))
            module = out.removesuffix(".weight")
            weights[out], weights[f"{module}.scales"], weights[f"{module}.biases"] = arrays
            layers[module] = {"group_size": q.group, "bits": q.bits}
            report.add(type_name, q.what, arrays)
            continue
        (value,) = arch.sanitize(name, [quants.mlx_float(type_name, raw, shape)])
        if target is not None:
            value = value.astype(target)
        weights[out] = value
        report.add(type_name, str(value.dtype).removeprefix("mlx.core."), [value])
    if not layers:
        return weights, None, rope_freqs
    common = max(layers.values(), key=list(layers.values()).count)
    return weights, {**common, **layers}, rope_freqs


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
    arch = check_model_metadata(info, str(gguf))
    summary = _Report()
    try:
        with np.errstate(all="ignore"):  # a damaged file's NaNs are its own business
            weights, quantization, rope_freqs = _weights(gguf, info, arch, dtype, summary)
    except OSError as err:
        raise SpecError(f"cannot read GGUF file {gguf}: {err.strerror or err}") from None
    try:
        config = arch.config(rope_freqs, tied="lm_head.weight" not in weights)
    except (ValueError, TypeError, SpecError) as err:
        raise SpecError(f"{gguf}: {one_line(err)}") from None
    if quantization:
        config["quantization"] = quantization
    out = Path(out)
    _write(out, gguf, weights, config, info.meta)
    line = summary.line(gguf)
    if report is None:
        print(line, file=sys.stderr, flush=True)
    else:
        report(line)
    return out


def _write(out: Path, gguf: Path, weights: dict, config: dict, meta: dict) -> None:
    """Weights, config and tokenizer into a hidden directory beside `out`, loaded once, then
    renamed to `out`; removed again on any failure."""
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


def _check_loads(path: Path, gguf: Path) -> None:
    """Build the model from the converted files (lazily: no weights read) so a file whose
    tensors do not fit its own hyper-parameters fails here, before anything is cached."""
    from mlx_lm.utils import load_model

    try:
        load_model(path, lazy=True)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        raise SpecError(f"{gguf}: the converted model does not load: {one_line(err)}") from None
