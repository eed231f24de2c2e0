"""Drafters propose tokens for the target to verify; each kind is one module here.

`KINDS` is the registry models.toml's `drafter = ...`, --drafter and the API name kinds from.
A new kind: a module with a `Drafter` subclass and its `DrafterKind`, and one line below (or
`register(Kind)` from outside the package).
"""

from __future__ import annotations

from ..errors import SpecError
from .base import Drafter, DrafterKind, TargetOutput, prefill_cache
from .dflash import DFlashDrafter, DFlashKind
from .eagle import EagleKind
from .lookup_model import LookupThenModel, LookupThenModelKind
from .model import ModelDrafter, ModelKind
from .mtp import MTPKind
from .ngram import NGramDrafter, NGramIndex, NGramKind

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

__all__ = [
    "KINDS",
    "DFlashDrafter",
    "Drafter",
    "DrafterKind",
    "LookupThenModel",
    "ModelDrafter",
    "NGramDrafter",
    "NGramIndex",
    "TargetOutput",
    "batched_kinds",
    "kind",
    "prefill_cache",
    "register",
]
