"""GGUF files as a model source: convert once into the mlx-lm layout, then reuse.

The header, metadata and tensor table are read and bounds-checked in Python (`reader`) and
checked against the architecture (`validation`) before any tensor data is touched; the tensors
are then decoded from the bytes with numpy (`quants`): float tensors keep their precision,
quantized ones become MLX affine quantization (K-quants included: never a silent float16
blow-up) unless a dtype dequantizes. Each architecture maps onto mlx-lm's own model class of
its family (`architectures`: no model code here), and the tokenizer is rebuilt from
`tokenizer.ggml.*` with the pre-tokenizer the file declares (`tokenizer`). `conversion` writes
one directory; `cache` keeps one per file and dtype.
"""

from .architectures import ARCHITECTURES, SUPPORTED_ARCHITECTURES
from .cache import cache_root, converted_path, file_digest, remove_stale
from .conversion import DTYPES, convert, default_dtype
from .reader import GGUFInfo, read_gguf_info
from .tokenizer import write_tokenizer
from .validation import check_model_metadata

__all__ = [
    "ARCHITECTURES",
    "DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "GGUFInfo",
    "cache_root",
    "check_model_metadata",
    "convert",
    "converted_path",
    "default_dtype",
    "file_digest",
    "read_gguf_info",
    "remove_stale",
    "write_tokenizer",
]
