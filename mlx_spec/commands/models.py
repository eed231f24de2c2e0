"""mlx-spec models: the curated pairs, and which are already downloaded."""

from __future__ import annotations


def setup_arg_parser(parser):
    pass


def describe_draft(spec) -> str:
    if spec.drafter == "ngram":
        return "(prompt lookup)"
    if spec.head is not None:  # a drafting head: MTP, EAGLE-3, DFlash
        return f"({spec.drafter} head {spec.head})"
    if spec.draft_bits is not None:
        draft = f"(target at {spec.draft_bits} bits)"
    else:
        draft = spec.draft or "(none)"
    return f"prompt lookup, then {draft}" if spec.drafter == "ngram+model" else draft


def main(args):
    from ..pairs.registry import load_registry, pair_downloaded, user_file

    registry = load_registry()
    print(f"{'pair':<20} {'k':>4}  {'downloaded':<10}  target / draft")
    for name, spec in registry.pairs.items():
        have = pair_downloaded(spec)
        k = str(spec.num_draft_tokens)
        print(f"{name:<20} {k:>4}  {'yes' if have else 'no':<10}  {spec.target}")
        print(f"{'':<38}{describe_draft(spec)}")
        if spec.note:
            print(f"{'':<38}{spec.note}")
    print(f"\nAdd or override pairs in {user_file()}")
    return 0
