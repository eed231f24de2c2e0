"""Drafters propose tokens for the target to verify; each kind is one module here.

`KINDS` is the registry models.toml's `drafter = ...`, --drafter and the API name kinds from.
A new kind: a module with a `Drafter` subclass and its `DrafterKind`, and `register(Kind)`
(the package's own kinds are declared in kinds.py and registered below).

Importing the package loads no MLX: the kinds' facts are what a `PairConfig` is checked
against, and listing pairs needs nothing more. The drafters themselves are in their modules
(`drafters.model.ModelDrafter`, `drafters.ngram.NGramDrafter`, …), which load MLX and mlx-lm.
"""

from __future__ import annotations

from ..errors import SpecError
from .base import Drafter, DrafterKind, TargetOutput
from .kinds import (
    AssistantKind,
    DFlashKind,
    DSparkKind,
    EagleKind,
    LookupThenModelKind,
    ModelKind,
    MTPKind,
    NGramKind,
    SuffixKind,
    suffix_kind,
)

KINDS: dict[str, type[DrafterKind]] = {}


def register(kind: type[DrafterKind]) -> type[DrafterKind]:
    """Add a kind to the registry (usable as a class decorator)."""
    if not kind.name:
        raise SpecError(f"drafter kind {kind.__name__} has no name")
    KINDS[kind.name] = kind
    return kind


def kind(name: str) -> type[DrafterKind]:
    if name not in KINDS:
        raise SpecError(f"drafter must be one of {', '.join(KINDS)}, got {name!r}")
    return KINDS[name]


def batched_kinds() -> list[str]:
    """The kinds a batch drafts with (those that say how: `DrafterKind.batch_drafting`)."""
    return [n for n, k in KINDS.items() if k.batch_drafting.__func__ is not _UNBATCHED]


_UNBATCHED = DrafterKind.batch_drafting.__func__

register(ModelKind)
register(NGramKind)
register(LookupThenModelKind)
register(EagleKind)
register(MTPKind)
register(DFlashKind)
register(DSparkKind)
register(AssistantKind)
register(SuffixKind)
for _base in (ModelKind, EagleKind, MTPKind, DFlashKind, DSparkKind, AssistantKind):
    register(suffix_kind(_base))

__all__ = ["KINDS", "Drafter", "DrafterKind", "TargetOutput", "batched_kinds", "kind", "register"]
