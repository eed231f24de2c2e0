"""mlx-spec models: the curated pairs, and which are already downloaded."""

from __future__ import annotations

from ..loading import is_downloaded
from ..registry import load_registry, user_file


def setup_arg_parser(parser):
    pass


def describe_draft(spec) -> str:
    if spec.draft_bits is not None:
        return f"(target at {spec.draft_bits} bits)"
    return spec.draft or "(none)"


def main(args):
    registry = load_registry()
    print(f"{'pair':<20} {'k':>2}  {'downloaded':<10}  target / draft")
    for name, spec in registry.pairs.items():
        models = [spec.target] + ([spec.draft] if spec.draft else [])
        have = all(is_downloaded(m) for m in models)
        print(
            f"{name:<20} {spec.num_draft_tokens:>2}  {'yes' if have else 'no':<10}  {spec.target}"
        )
        print(f"{'':<36}{describe_draft(spec)}")
        if spec.note:
            print(f"{'':<36}{spec.note}")
    print(f"\nAdd or override pairs in {user_file()}")
    return 0
