"""Load a pair: resolve its models (models.hub), check that it fits (models.memory) and that the
draft's vocabulary is the target's, load the weights, the tokenizer, an adapter (models.adapters)
and a drafting head. `pair_config` is the one place flags and API keywords become a `PairConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.utils import load_model, load_tokenizer

from ..core.caches import make_cache
from ..core.policies import DraftLength
from ..errors import SpecError, one_line
from ..models import distributed
from ..models.adapters import apply_draft_adapter, read_adapter_config
from ..models.memory import check_memory
from ..models.model_dir import context_length, read_config, text_config
from ..models.quantize import requantized_copy
from ..models.resolve import resolve_model
from ..runtime import cpu_attention
from ..runtime.threads import materialize
from .config import PairConfig
from .registry import load_registry


@dataclass
class Pair:
    """A loaded pair: the models, the target's tokenizer, and the `PairConfig` it came from."""

    config: PairConfig
    target: object  # mlx_lm model
    draft: object | None
    tokenizer: object  # mlx_lm TokenizerWrapper (the target's)
    target_path: Path | None = None
    draft_path: Path | None = None
    target_config: dict | None = None
    draft_adapter: Path | None = None  # the adapter applied to the draft, resolved
    head: object = None  # a drafting head (the kind's load_head), for kinds with needs_head
    link: object = None  # distributed.Link: the target is sharded over a group (None: alone)

    @property
    def speculative(self) -> bool:
        return self.config.speculative

    @property
    def vocab_size(self) -> int | None:
        """Rows of the target's embedding: token ids must stay below it."""
        value = text_config(self.target_config or {}).get("vocab_size")
        return value if isinstance(value, int) else None

    @property
    def context_length(self) -> int | None:
        return context_length(self.target_config or {})

    def configured(self, **changes) -> Pair:
        """The same loaded models under drafter settings that need no reload (draft_confidence,
        ngram_max / ngram_min, num_draft_tokens, or a kind the loaded models can serve)."""
        drafter = changes.pop("drafter", self.config.drafter)
        if drafter != self.config.drafter:
            config = self.config.with_drafter(drafter, **changes)
        else:
            config = self.config.replace(**changes)
        if config.needs_reload(self.config):
            raise SpecError("these settings need other models: load the pair again")
        return dataclasses.replace(self, config=config)


def first_vocab_difference(target_vocab: dict, draft_vocab: dict) -> str | None:
    """Compare token->id maps; describe the first id where they disagree, if any."""
    if target_vocab == draft_vocab:
        return None
    by_id_t = {i: t for t, i in target_vocab.items()}
    by_id_d = {i: t for t, i in draft_vocab.items()}
    for i in sorted(set(by_id_t) | set(by_id_d)):
        t, d = by_id_t.get(i), by_id_d.get(i)
        if t != d:
            return f"token id {i} is {t!r} in the target and {d!r} in the draft"
    return "the two vocabularies map the same ids to different tokens"


def _load_tokenizer(path: Path, config: dict):
    try:
        return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    # the tokenizers library raises bare Exceptions on a broken tokenizer.json, and transformers
    # reads config.json here too (dividing by its head count, validating its fields)
    except Exception as err:
        reason = one_line(err, reason=True)
        raise SpecError(f"cannot load the tokenizer in {path}: {reason}") from None


def _load_model(path: Path, lazy: bool = False):
    """mlx-lm's loader, with what a checked directory can still get wrong (weights that do not
    fit the architecture, bad config values) as one line."""
    try:
        model, _ = load_model(path, lazy=lazy)
    except (
        ValueError, TypeError, KeyError, AttributeError, RuntimeError, ArithmeticError,
        AssertionError,  # (mlx-lm checks some config values with assert: vocab_size 0)
    ) as err:  # fmt: skip
        raise SpecError(f"cannot load the model in {path}: {one_line(err)}") from None
    return model


NO_ADAPTER = ""  # load_pair(draft_adapter=NO_ADAPTER): the bare draft, whatever the pair names


def _draft_model(target_path: Path, draft_path: Path | None, bits: int | None, group_size: int):
    if draft_path is not None:
        return _load_model(draft_path)
    if bits is None:
        return None
    return requantized_copy(_load_model(target_path), bits, group_size)


def load_draft_model(pair: Pair):
    """A fresh copy of the pair's draft model, without any adapter (what distill trains)."""
    c = pair.config
    model = _draft_model(pair.target_path, pair.draft_path, c.draft_bits, c.draft_group_size)
    if model is None:
        raise SpecError("this pair has no draft model")
    materialize(model)
    return model


def pair_config(
    name: str | None = None,
    *,
    target: str | None = None,
    draft: str | None = None,
    drafter: str | None = None,
    draft_bits: int | None = None,
    dtype: str | None = None,
    draft_adapter: str | Path | None = None,
    num_draft_tokens: int | str | DraftLength | None = None,
    skip_draft: bool = False,
    ngram_max: int | None = None,
    ngram_min: int | None = None,
    draft_confidence: float | None = None,
    head: str | None = None,
) -> PairConfig:
    """A pair by its name in models.toml with these changes, or from explicit target/draft
    paths or ids (`draft=None`: plain decoding through the same loop). The one place flags
    and API keywords become a `PairConfig`:

    `drafter` another kind over the pair's models (one without a draft model drops it);
    `skip_draft` the target alone (--no-draft); `draft_adapter` None keeps the pair's,
    NO_ADAPTER ("") none; `num_draft_tokens` None keeps the pair's k if the kind is its own.
    """
    if name is not None and target is not None:
        raise SpecError("give a pair name or a target, not both")
    if draft_adapter and skip_draft:  # asked for, and nothing to apply it to
        raise SpecError("a draft adapter needs a draft model (--draft or --draft-bits)")
    models = {"dtype": dtype or None, "head": head, "draft_bits": draft_bits}
    models = {k: v for k, v in models.items() if v is not None}
    if draft_adapter is not None:
        models["draft_adapter"] = str(draft_adapter) or None
    if name is not None:
        config = load_registry().get_pair(name)
        if draft_bits is not None and config.draft is not None:
            raise SpecError("give a draft model or --draft-bits, not both")
    elif target is None:
        raise SpecError("no target model given")
    else:  # built whole: its kind needs its models at once (skip_draft: dropped below)
        config = PairConfig(target, draft, **({} if skip_draft else {"drafter": drafter, **models}))
        models = {}
    # the kind and the models it needs change in one step, checked once together
    if skip_draft:
        config = config.plain().replace(**({"dtype": dtype} if dtype else {}))
    elif drafter is not None and drafter != config.drafter:
        config = config.with_drafter(drafter, **models)
    elif models:
        config = config.replace(**models)
    changes = {
        "num_draft_tokens": num_draft_tokens,
        "ngram_max": ngram_max,
        "ngram_min": ngram_min,
        "draft_confidence": draft_confidence,
    }
    changes = {k: v for k, v in changes.items() if v is not None}
    return config.replace(**changes) if changes else config


def load_pair(
    config: PairConfig | str | None = None,
    *,
    progress=None,
    force: bool = False,
    context: int | None = None,
    group=None,
    **changes,
) -> Pair:
    """Load a pair: a `PairConfig`, or a name in models.toml and/or the keywords of
    `pair_config` (target=, draft=, drafter=, draft_bits=, dtype=, draft_adapter=,
    num_draft_tokens=, skip_draft=, ngram_max=, ngram_min=, draft_confidence=).

    `progress(message)` is called at each stage (the chat app shows it). Before loading, the
    weights plus the KV cache for `context` tokens (default: up to 4096) are compared with the
    machine's memory; `force=True` loads anyway. `group`: an `mx.distributed` group to split
    the target over, tensor-parallel (the draft is loaded whole on every rank); default: the
    group `mlx.launch` started, if any. A group of one loads as usual.
    """
    if not isinstance(config, PairConfig):
        config = pair_config(config, **changes)
    elif changes:
        raise TypeError("give a PairConfig or pair settings, not both (config.replace(...))")
    group = group if group is not None else distributed.world()
    if group is not None and group.size() == 1:
        group = None
    report = progress or (lambda _: None)
    if config.draft_adapter:
        read_adapter_config(config.draft_adapter)  # a bad directory fails before any load

    report(f"Finding {config.target}…")
    target_path = resolve_model(config.target, config.dtype, progress)
    draft_path = None
    if config.draft is not None:
        report(f"Finding {config.draft}…")
        draft_path = resolve_model(config.draft, config.dtype, progress)
    report("Checking the vocabularies…")
    target_config = read_config(target_path)
    tokenizer = _load_tokenizer(target_path, target_config)
    if draft_path is not None:
        draft_tokenizer = _load_tokenizer(draft_path, read_config(draft_path))
        diff = first_vocab_difference(tokenizer.get_vocab(), draft_tokenizer.get_vocab())
        if diff is not None:
            raise SpecError(f"draft and target vocabularies differ: {diff}")

    head_path = None
    if config.head:  # the kind's: an MTP head may be extracted here from its original
        head_path = config.kind.resolve_head(config.head, target_config, progress)
    if not force:
        shards = group.size() if group is not None else 1
        check_memory(
            target_path, target_config, draft_path, config.draft_bits, context, shards, head_path
        )

    cpu_attention.install()  # MLX's CPU softmax is scalar (runtime/cpu_attention.py)
    report("Loading the target weights…")
    link = None
    if group is None:
        target_model = _load_model(target_path)
    else:  # lazily: each rank reads only its slice of the weights
        target_model = _load_model(target_path, lazy=True)
        link = distributed.sharded(target_model, target_config, group)
    if draft_path is not None or config.draft_bits is not None:
        report("Loading the draft weights…")
    draft_model = _draft_model(target_path, draft_path, config.draft_bits, config.draft_group_size)
    adapter_path = None
    if draft_model is not None and config.draft_adapter:
        report("Applying the draft adapter…")
        adapter_path = apply_draft_adapter(draft_model, config.draft_adapter, config.draft_bits)
    if draft_model is not None:  # refused now, not at the first round
        make_cache(target_model, "target")
        make_cache(draft_model, "draft")
    head = None
    if head_path is not None:
        report("Loading the drafting head…")
        make_cache(target_model, "target")  # a head's rounds roll the target back too
        head = config.kind.load_head(head_path, target_model, target_config)
    materialize(target_model, draft_model, head)  # usable from any thread (threads.py)
    return Pair(
        config,
        target=target_model,
        draft=draft_model,
        tokenizer=tokenizer,
        target_path=target_path,
        draft_path=draft_path,
        target_config=target_config,
        draft_adapter=adapter_path,
        head=head,
        link=link,
    )
