"""mlx-spec heads extract: a model's own MTP layer -> a head directory (drafters/mtp_extract.py
does the work). Name the result with `--drafter mtp --head DIR` or
`draft = { head = "mtp", path = "DIR" }`.
"""

from __future__ import annotations

import time


def setup_arg_parser(parser):
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("extract", help="write a model's MTP layer as a head directory")
    p.add_argument("source", metavar="REPO_OR_DIR", help="the original checkpoint (a dir or id)")
    p.add_argument("out", help="the head directory to write (must not exist yet)")
    p.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="quantize the head")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="with --bits")


def main(args):
    from ..drafters.mtp_extract import extract
    from ..models.model_dir import new_output_dir

    out = new_output_dir(args.out)
    start = time.perf_counter()
    extract(args.source, out, args.bits, args.group_size)
    size = (out / "model.safetensors").stat().st_size / 1e6
    print(f"wrote {out} ({size:.1f} MB) in {time.perf_counter() - start:.1f}s")
    return 0
