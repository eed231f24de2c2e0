"""`mlx-spec cache`: what the server's prompt cache keeps on disk (`serve --cache-dir`), per
model, and removing it: `ls`, `rm MODEL | --all`, `prune --max-bytes N | --older-than DAYS`."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from ..errors import SpecError
from .serve import size


def setup_arg_parser(parser):
    parser.add_argument(
        "action", choices=["ls", "rm", "prune"], help="list, remove a model's entries, prune"
    )
    parser.add_argument("model", nargs="?", help="rm: a model folder's id, as ls prints it")
    parser.add_argument("--cache-dir", type=Path, help="the folder (default: serve's default)")
    parser.add_argument("--all", action="store_true", help="rm: every model's entries")
    parser.add_argument("--max-bytes", type=size, help="prune: least recently used out first")
    parser.add_argument("--older-than", type=float, help="prune: entries unused for DAYS")


def human(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}G"


def main(args) -> int:
    from ..server.disk_cache import default_dir, prune, stored

    root = (args.cache_dir or default_dir()).expanduser()
    if root.exists() and not root.is_dir():
        raise SpecError(f"--cache-dir {root} is not a directory")
    if not root.exists():
        print(f"{root}: nothing stored")
        return 0
    if args.action == "ls":
        rows = stored(root)
        print(f"{root}: {sum(r['entries'] for r in rows)} entries, "
              f"{human(sum(r['bytes'] for r in rows))}")  # fmt: skip
        for r in rows:
            about = r["about"]
            what = about.get("name") or about.get("target") or "?"
            if about.get("drafter"):
                what += f" (drafter {about['drafter']})"
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["used"])) if r["used"] else "-"
            print(f"  {r['model']}  {r['entries']:>5} entries  {human(r['bytes']):>8}  "
                  f"{r['partitions']} key(s)  last used {used}  {what}")  # fmt: skip
        return 0
    if args.action == "rm":
        if args.all == bool(args.model):
            raise SpecError("cache rm takes a model id (see `mlx-spec cache ls`) or --all")
        folders = [p for p in root.iterdir() if p.is_dir()] if args.all else [root / args.model]
        if not args.all and (not folders[0].is_dir() or "/" in args.model or args.model in ".."):
            raise SpecError(f"no model {args.model!r} in {root} (see `mlx-spec cache ls`)")
        for folder in folders:
            shutil.rmtree(folder)
        print(f"removed {len(folders)} model folder(s) from {root}")
        return 0
    if args.max_bytes is None and args.older_than is None:
        raise SpecError("cache prune takes --max-bytes N and/or --older-than DAYS")
    if args.older_than is not None and not args.older_than >= 0:
        raise SpecError("--older-than must be a number of days, at least 0")
    cutoff = time.time() - 86400 * args.older_than if args.older_than is not None else None
    removed, total = prune(root, args.max_bytes, cutoff)
    print(f"removed {len(removed)} entries; {human(total)} left in {root}")
    return 0
