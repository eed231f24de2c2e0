"""`GenerationConfig`: what one generation asks (sampling, max tokens, seed, prompt template
arguments, processors, constraint, log-probabilities), frozen and validated once where it is
built. `generate.stream_rounds` and `batch.BatchDecoder.add` take it; what the pair is lives in
`pairs.config.PairConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.policies import DraftLength, draft_length
from ..core.sampling import SamplingParams, check_seed
from ..errors import SpecError
from ..pairs.config import PairConfig, is_int

SAMPLING = tuple(f.name for f in dataclasses.fields(SamplingParams))  # temperature, top_p, …
# the order positional settings have always had (the fields' order before `sampling`)
POSITIONAL = ("max_tokens", *SAMPLING, "seed", "num_draft_tokens", "use_draft", "system")
POSITIONAL += ("chat_template_kwargs", "processors", "logprobs", "schema", "grammar", "regex")
POSITIONAL += ("forced_tokens",)


@dataclass(frozen=True, init=False)
class GenerationConfig:
    """What one generation asks. The API's keyword arguments are these fields, and the
    sampling settings (temperature, top_p, top_k, min_p), which live in `sampling` only: a
    `SamplingParams`, the one home of their values and their checks."""

    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    # an int, "auto" or a policies.Fixed / Auto; None: the pair's
    num_draft_tokens: DraftLength | None = None
    use_draft: bool = True  # False: plain decoding with the same pair
    system: str | None = None  # a system message for a text or messages prompt
    chat_template_kwargs: dict | None = None  # e.g. {"enable_thinking": False} for Qwen3
    processors: tuple = ()  # processors.py: penalties, logit bias (target and draft alike)
    logprobs: int | None = None  # None: off; N >= 0: each token's and the top N
    schema: dict | str | None = None  # a JSON Schema (dict or JSON text) the reply follows
    grammar: object = None  # Lark text as llguidance reads it, or a grammar.Constraint
    regex: str | None = None
    forced_tokens: bool = True  # draft the tokens the grammar forces, for free

    def __init__(self, *args, sampling: SamplingParams | None = None, **settings):
        """`GenerationConfig(64, 0.7)` and `GenerationConfig(max_tokens=64, temperature=0.7)`
        as ever (positional in the order of POSITIONAL, the fields' order before `sampling`
        held them); a sampling keyword given with `sampling` changes just that one."""
        if len(args) > len(POSITIONAL):
            raise TypeError(f"GenerationConfig takes at most {len(POSITIONAL)} positional settings")
        for name, value in zip(POSITIONAL, args, strict=False):
            if name in settings:
                raise TypeError(f"GenerationConfig got {name} twice")
            settings[name] = value
        asked = {k: settings.pop(k) for k in SAMPLING if settings.get(k) is not None}
        for k in SAMPLING:
            settings.pop(k, None)
        sampling = sampling or SamplingParams()
        if asked:
            sampling = dataclasses.replace(sampling, **asked)
        max_tokens = settings.pop("max_tokens", 256)
        known = {f.name for f in dataclasses.fields(self)} - {"max_tokens", "sampling"}
        unknown = set(settings) - known
        if unknown:
            raise TypeError(f"unknown generation settings: {', '.join(sorted(unknown))}")
        set_ = object.__setattr__.__get__(self)
        for f in dataclasses.fields(self):
            set_(f.name, f.default)
        set_("max_tokens", max_tokens)
        set_("sampling", sampling)
        for name, value in settings.items():
            set_(name, value)
        self._check()

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def top_k(self) -> int:
        return self.sampling.top_k

    @property
    def min_p(self) -> float:
        return self.sampling.min_p

    def _check(self):
        set_ = object.__setattr__.__get__(self)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {self.sampling!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise SpecError(f"max-tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None:
            check_seed(self.seed)
        if self.num_draft_tokens is not None:
            set_("num_draft_tokens", draft_length(self.num_draft_tokens))
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise SpecError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        set_("processors", tuple(self.processors or ()))
        asked = [x for x in (self.schema, self.grammar, self.regex) if x is not None]
        if len(asked) > 1:
            raise SpecError("give one of schema, grammar or regex")

    def draft_length(self, pair_config: PairConfig) -> DraftLength:
        """The k policy this generation runs: its own override, else the pair's (the one way
        the two fields are read)."""
        return self.num_draft_tokens or pair_config.num_draft_tokens

    def forcing(self, grammar):
        """`grammar` (a stream's GrammarProcessor, or None) when its forced tokens are to be
        drafted for free, else None."""
        return grammar if self.use_draft and self.forced_tokens else None

    def replace(self, **changes) -> GenerationConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
        """`config` with keyword changes; keywords alone build one (the API's form)."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise TypeError(
                f"expected a GenerationConfig, got {type(config).__name__}: pass settings by "
                "keyword (max_tokens=...)"
            )
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)} - set(SAMPLING)
        pair_level = unknown & {f.name for f in dataclasses.fields(PairConfig)}
        if pair_level:
            raise TypeError(
                f"{', '.join(sorted(pair_level))} belongs to the pair: "
                f"pair.configured({sorted(pair_level)[0]}=...)"
            )
        if unknown:
            raise TypeError(f"unknown generation settings: {', '.join(sorted(unknown))}")
        if config is None:
            return cls(**kwargs)
        return config.replace(**kwargs) if kwargs else config
