"""The package's drafter kinds: what each is (the facts `PairConfig` validates against) and how
it is built, its drafter's module imported when a drafter or a head is made.

A kind's facts load without MLX or mlx-lm: every `PairConfig` is checked against its kind where
it is built, so `mlx-spec models` (every curated pair) and the chat's pair picker would
otherwise load the drafters' modules, and mlx-lm's transformers behind them (~1.2 s), to list
names. So each kind imports its module inside `build`, `load_head` and `resolve_head` — the one
module outside commands/ and the CLI that may (tests/test_layers.py). A kind written outside
the package needs none of this: one module with its Drafter and its DrafterKind, and
`drafters.register(Kind)`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecError
from . import mtp_source
from .base import DrafterKind


class ModelKind(DrafterKind):
    name = "model"
    settings = ("draft_confidence",)
    needs_model = True
    help = "the draft model"

    @classmethod
    def build(cls, pair):
        from .model import ModelDrafter

        return ModelDrafter(pair.draft, pair.vocab_size, pair.config.draft_confidence or 0.0)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"draft": pair.draft, "draft_confidence": pair.config.draft_confidence or 0.0}


class NGramKind(DrafterKind):
    name = "ngram"
    uses_history = True
    help = "prompt lookup in the context, no second model"

    @classmethod
    def build(cls, pair):
        from .ngram import NGramDrafter

        return NGramDrafter(pair.config.ngram_max, pair.config.ngram_min)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"lookup": (pair.config.ngram_max, pair.config.ngram_min)}


class LookupThenModelKind(DrafterKind):
    name = "ngram+model"
    settings = ("draft_confidence",)
    needs_model = True
    uses_history = True
    help = "lookup first, the draft model when lookup finds nothing"

    @classmethod
    def build(cls, pair):
        from .lookup_model import LookupThenModel

        return LookupThenModel(NGramKind.build(pair), ModelKind.build(pair))

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {**ModelKind.batch_drafting(pair), **NGramKind.batch_drafting(pair)}


class EagleKind(DrafterKind):
    name = "eagle3"
    needs_head = True
    help = "an EAGLE-3 head (--head DIR): drafts from three of the target's layers"

    @classmethod
    def load_head(cls, path, target, target_config):
        from .eagle import load_head

        return load_head(Path(path), target, target_config)

    @classmethod
    def build(cls, pair):
        from .eagle import EagleDrafter

        return EagleDrafter(pair.head)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"head": pair.head}


class MTPKind(DrafterKind):
    name = "mtp"
    needs_head = True
    help = (
        "the target's own multi-token-prediction layer (--head DIR from mlx-spec heads "
        "extract, or the original checkpoint: extracted once into the cache)"
    )

    @classmethod
    def resolve_head(cls, name: str, target_config: dict, progress=None) -> Path:
        """A head directory as it is; an original checkpoint's head (its directory or hub id)
        extracted once into the head cache, quantized as the target is."""
        _, source = mtp_source.head_source(name)
        if source is None:
            return super().resolve_head(name, target_config, progress)
        from .mtp_extract import cached_head

        bits, group_size = mtp_source.target_quantization(target_config)
        return cached_head(source, bits, group_size, report=progress)

    @classmethod
    def head_downloaded(cls, name: str, target: str) -> bool:
        try:
            _, source = mtp_source.head_source(name)
        except SpecError:
            return False
        if source is None:
            return super().head_downloaded(name, target)
        bits, group_size = mtp_source.target_quantization(mtp_source.local_config(target))
        return mtp_source.is_head(
            mtp_source.cache_root() / mtp_source.cache_name(source, bits, group_size)
        )

    @classmethod
    def load_head(cls, path, target, target_config: dict):
        from .mtp_head import load_head

        return load_head(Path(path), target_config)

    @classmethod
    def build(cls, pair):
        from .mtp import MTPDrafter

        return MTPDrafter(pair.head, pair.target, pair.vocab_size)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"head": pair.head}


class DFlashKind(DrafterKind):
    name = "dflash"
    needs_head = True
    help = "a DFlash or DFlash2 block-diffusion head (z-lab): one forward drafts a block"

    @classmethod
    def load_head(cls, path, target, target_config: dict):
        from .dflash import load_head
        from .dflash2 import DFlash2Head

        return load_head(path, target, target_config, variants=(DFlash2Head,))

    @classmethod
    def build(cls, pair):
        from .dflash import DFlashDrafter
        from .dflash2 import DFlash2Drafter, DFlash2Head

        drafter = DFlash2Drafter if isinstance(pair.head, DFlash2Head) else DFlashDrafter
        return drafter(pair.head, pair.target)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"head": pair.head}


class DSparkKind(DFlashKind):
    name = "dspark"
    help = "a DSpark head: a DFlash block drafter with a Markov head over the previous guess"

    @classmethod
    def load_head(cls, path, target, target_config: dict):
        from .dspark import load_head

        return load_head(path, target, target_config)

    @classmethod
    def build(cls, pair):
        from .dspark import DSparkDrafter

        return DSparkDrafter(pair.head, pair.target)


class AssistantKind(DrafterKind):
    name = "assistant"
    needs_head = True
    help = (
        "a Gemma 4 assistant (MTP) drafter (--head DIR or hub id, model_type gemma4_assistant): "
        "attends to the target's own keys and values"
    )

    @classmethod
    def load_head(cls, path, target, target_config: dict):
        from .assistant import load_head

        return load_head(path, target, target_config)

    @classmethod
    def build(cls, pair):
        from .assistant import AssistantDrafter

        return AssistantDrafter(pair.head, pair.target, pair.vocab_size)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"head": pair.head}


def _suffix_lookup(pair):
    """A batch row's lookup: a suffix drafter over its request and its key's history."""
    from .suffix import SuffixDrafter

    def row(history=None):
        return SuffixDrafter(history=history)

    return row


class SuffixKind(DrafterKind):
    name = "suffix"
    uses_history = True
    help = (
        "suffix decoding: the longest match in the request and the key's history, drafts as "
        "long as the verify cost says (past K_MAX)"
    )

    @classmethod
    def build(cls, pair):
        from .suffix import SuffixDrafter

        return SuffixDrafter()

    @classmethod
    def history_index(cls, max_tokens: int):
        from .suffix import SuffixHistory

        return SuffixHistory(max_tokens)

    @classmethod
    def batch_drafting(cls, pair) -> dict:
        return {"lookup": _suffix_lookup(pair)}


def suffix_kind(base: type[DrafterKind]) -> type[DrafterKind]:
    """`suffix+<base>`: suffix decoding where the match is long, `base`'s drafter where it is
    short or absent (the base's settings, models and head)."""

    def build(cls, pair):
        from .suffix import SuffixDrafter

        return SuffixDrafter(base.build(pair))

    def batch_drafting(cls, pair):
        # each row's lookup beside the base's draft model or head (batch_draft.py's `_lookups`)
        drafting = base.batch_drafting(pair)
        return None if drafting is None else {**drafting, "lookup": _suffix_lookup(pair)}

    return type(
        f"Suffix{base.__name__}",
        (base,),
        {
            "name": f"suffix+{base.name}",
            "uses_history": True,
            "help": f"suffix decoding where the match is long, else {base.name}",
            "build": classmethod(build),
            "batch_drafting": classmethod(batch_drafting),
            "history_index": SuffixKind.history_index,
        },
    )
