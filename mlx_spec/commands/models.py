"""mlx-spec models: the curated pairs, and which are already downloaded (`--check`: each
target, draft and head in the local cache or not, no network)."""

from __future__ import annotations


def setup_arg_parser(parser):
    parser.add_argument(
        "--check",
        action="store_true",
        help="tell, for each pair, which of its target, draft and head are in the local cache "
        "(offline) and where its repository names were seen published",
    )


def describe_draft(spec, drafter: str | None = None) -> str:
    drafter = drafter or spec.drafter
    if drafter == "ngram":
        return "(prompt lookup)"
    if drafter == "suffix":
        return "(suffix decoding)"
    if drafter and drafter.startswith("suffix+"):
        return "suffix decoding, then " + describe_draft(spec, drafter.removeprefix("suffix+"))
    if spec.head is not None:  # a drafting head: MTP, EAGLE-3, DFlash
        return f"({drafter} head {spec.head})"
    if spec.draft_bits is not None:
        draft = f"(target at {spec.draft_bits} bits)"
    else:
        draft = spec.draft or "(none)"
    return f"prompt lookup, then {draft}" if drafter == "ngram+model" else draft


def describe_seen(spec) -> str | None:
    """Whether the pair's repository names were seen published (None: a pair that does not
    say, as a user's own pair)."""
    if spec.seen is None:
        return None
    return f"names seen published: {spec.seen}" if spec.seen else "names not seen published"


def main(args):
    from ..pairs.registry import load_registry, pair_parts, user_file

    registry = load_registry()
    if getattr(args, "check", False):
        return check(registry)
    print(f"{'pair':<20} {'k':>4}  {'downloaded':<10}  target / draft")
    for name, spec in registry.pairs.items():
        have = all(cached for _, _, cached in pair_parts(spec))
        k = str(spec.num_draft_tokens)
        print(f"{name:<20} {k:>4}  {'yes' if have else 'no':<10}  {spec.target}")
        print(f"{'':<38}{describe_draft(spec)}")
        if spec.note:
            print(f"{'':<38}{spec.note}")
    print(f"\nAdd or override pairs in {user_file()}")
    return 0


def check(registry) -> int:
    """One line per part of each pair: in the local cache or not; offline."""
    from ..pairs.registry import pair_parts

    complete = 0
    for name, spec in registry.pairs.items():
        parts = pair_parts(spec)
        complete += all(cached for _, _, cached in parts)
        print(name)
        for part, model, cached in parts:
            print(f"  {part:<13} {'cached' if cached else 'missing':<8} {model}")
        seen = describe_seen(spec)
        if seen:
            print(f"  {seen}")
    print(f"\n{complete} of {len(registry.pairs)} pairs have everything in the local cache")
    return 0
