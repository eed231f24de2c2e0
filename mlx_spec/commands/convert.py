"""mlx-spec convert: a GGUF file -> an mlx-lm model directory."""

from __future__ import annotations

import time
from pathlib import Path


def setup_arg_parser(parser):
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out", help="the directory to write (must not exist yet)")
    parser.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        help="dequantize every tensor to this type (default: keep the file's precision; "
        "quantized tensors become MLX affine quantization)",
    )


def main(args):
    from ..models.gguf import convert
    from ..models.model_dir import new_output_dir

    out = new_output_dir(args.out)
    start = time.perf_counter()
    convert(Path(args.gguf), out, args.dtype, report=print)
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"wrote {out} ({size:.0f} MB) in {time.perf_counter() - start:.1f}s")
    return 0
