"""`PairConfig`: what a pair is (target, draft model or drafter kind with its settings, dtype,
bits, adapter, draft length), frozen and validated once where it is built, from a flag, a
models.toml entry or an API call. `loading.load_pair(config)` loads it; the loaded `Pair` holds
it. What one generation asks is `decode.config.GenerationConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from .. import drafters
from ..core.policies import Auto, DraftLength, draft_length
from ..errors import SpecError
from ..models.quantize import QUANT_BITS, QUANT_GROUP_SIZES

DTYPES = ("auto", "float16", "bfloat16", "float32")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PairConfig:
    target: str  # a path, a .gguf file or a Hugging Face id
    draft: str | None = None  # a separate draft model
    # a kind in drafters.KINDS; None: "model" when there is a draft model, else the target alone
    drafter: str | None = None
    draft_bits: int | None = None  # the draft is the target re-quantized to this many bits
    draft_group_size: int = 32
    dtype: str | None = None  # dequantize GGUF files to this ("auto": the backend's best)
    draft_adapter: str | None = None  # a LoRA adapter directory for the draft (distill)
    head: str | None = None  # a drafting head's directory (kinds with needs_head: MTP, EAGLE-3)
    num_draft_tokens: DraftLength = Auto()  # policies.Fixed(k) or Auto() (ints, "auto" too)
    ngram_max: int = 3  # prompt lookup's n-gram lengths
    ngram_min: int = 1
    draft_confidence: float | None = None  # a model draft stops below it (None: off)
    name: str | None = None  # the models.toml name, if it came from there
    note: str = ""
    # where its repository names were seen published ("" where not seen; None: not said)
    seen: str | None = None
    source: Path | None = None  # the models.toml file it came from

    def __post_init__(self):
        set_ = object.__setattr__.__get__(self)  # normalise once, here (the class is frozen)
        set_("num_draft_tokens", draft_length(self.num_draft_tokens))
        has_model = self.draft is not None or self.draft_bits is not None
        if self.drafter is None and has_model:
            set_("drafter", "model")
        if not isinstance(self.target, str) or not self.target:
            raise SpecError("no target model given")
        if self.draft is not None and self.draft_bits is not None:
            raise SpecError("give a draft model or --draft-bits, not both")
        if self.draft_bits is not None and (
            not is_int(self.draft_bits) or self.draft_bits not in QUANT_BITS
        ):
            raise SpecError(
                f"draft bits must be one of {', '.join(map(str, QUANT_BITS))}, "
                f"got {self.draft_bits!r}"
            )
        if not is_int(self.draft_group_size) or self.draft_group_size not in QUANT_GROUP_SIZES:
            raise SpecError(
                f"draft group_size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, "
                f"got {self.draft_group_size!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SpecError(f"dtype must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")
        if self.draft_adapter and not has_model:
            raise SpecError("a draft adapter needs a draft model (--draft or --draft-bits)")
        # a drafter's own settings are checked whatever the kind (a later switch may use them)
        lengths = (self.ngram_min, self.ngram_max)
        if not all(map(is_int, lengths)) or not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecError(
                f"need 1 <= ngram-min <= ngram-max, got {self.ngram_min} and {self.ngram_max}"
            )
        c = self.draft_confidence
        if c is not None and (
            isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c < 1
        ):
            raise SpecError(f"draft-confidence must be in [0, 1), got {c}")
        if self.drafter is None:
            if self.head is not None:
                raise SpecError("a head needs a drafter kind that reads it (--drafter)")
            return
        kind = drafters.kind(self.drafter)
        if kind.needs_head and not self.head:
            raise SpecError(f"the {self.drafter} drafter needs a head directory (--head DIR)")
        if self.head and not kind.needs_head:
            raise SpecError(f"the {self.drafter} drafter reads no head; drop --head")
        if kind.needs_model and not has_model:
            # asking for a draft model must not quietly become plain decoding
            raise SpecError(
                f"the {self.drafter} drafter needs a draft model (--draft or --draft-bits)"
            )
        if not kind.needs_model and has_model:
            raise SpecError(
                f"the {self.drafter} drafter needs no draft model; drop --draft / --draft-bits"
            )
        k = self.num_draft_tokens
        if kind.max_draft is not None and getattr(k, "k", 0) > kind.max_draft:
            raise SpecError(
                f"the {self.drafter} drafter drafts at most {kind.max_draft} tokens a round, "
                f"got num-draft-tokens {k}"
            )
        if self.draft_confidence is not None and "draft_confidence" not in kind.settings:
            raise SpecError(f"the {self.drafter} drafter has no draft-confidence setting")
        kind.validate(self)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def kind(self) -> type[drafters.DrafterKind] | None:
        return drafters.kind(self.drafter) if self.drafter is not None else None

    def replace(self, **changes) -> PairConfig:
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)

    def needs_reload(self, other: PairConfig) -> bool:
        """Whether `other`'s loaded models cannot serve this configuration."""
        models = ("target", "draft", "draft_bits", "draft_group_size", "dtype", "draft_adapter")
        models += ("head",)
        return any(getattr(self, f) != getattr(other, f) for f in models)

    def plain(self) -> PairConfig:
        """The target alone: plain decoding through the same loop."""
        return self.replace(
            drafter=None, draft=None, draft_bits=None, draft_adapter=None, head=None
        )

    def with_drafter(self, name: str, **changes) -> PairConfig:
        """Another kind over the same models: one without a draft model drops it (and its
        adapter), one without a head its head; a fixed k chosen for the previous kind goes
        back to `auto`. `changes` go in the same step (the head a new kind needs)."""
        kind = drafters.kind(name)
        dropped = {"num_draft_tokens": Auto()} if name != self.drafter else {}
        if not kind.needs_model:
            dropped.update(draft=None, draft_bits=None, draft_adapter=None)
        if not kind.needs_head:
            dropped["head"] = None
        if "draft_confidence" not in kind.settings:
            dropped["draft_confidence"] = None
        return self.replace(**{**dropped, **changes, "drafter": name})
