"""An MTP head out of its original checkpoint (`mlx-spec heads extract`, and `--drafter mtp`
given a checkpoint instead of a head directory).

The layer is `mtp.*` in Qwen3.5 / Qwen3-Next checkpoints, `model.layers.{num_hidden_layers}.*`
in DeepSeek-V3 / GLM-4.5 ones. Only the shards that hold it are read (the safetensors index
says which); from the hub, only those are downloaded. The head directory holds
model.safetensors (the head's weights in mlx-lm's convention, quantized when asked) and
config.json (the target's settings the head needs). Heads extracted for a pair are kept in a
cache beside the GGUF conversions.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from filelock import FileLock
from mlx.utils import tree_flatten

from ..errors import SpecError
from ..models.hub import looks_like_path
from ..models.model_dir import check_safetensors, json_object
from . import mtp_head
from .mtp_source import HEAD_TYPE, SINGLE, cache_name, cache_root, is_head

INDEX = "model.safetensors.index.json"


def _hub(repo_id: str, patterns: list[str]) -> Path:
    """The snapshot folder of a hub repository holding `patterns`: from the local cache, or
    downloaded (only those files)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    def present(folder: Path) -> bool:
        return all(any(folder.glob(p)) for p in patterns)

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        if present(folder):
            return folder
    except HFValidationError:
        raise SpecError(f"{repo_id} is neither a directory nor a Hugging Face id") from None
    except Exception:  # not in the cache
        pass
    hint = f"download it on a connected machine with `hf download {repo_id}`"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise SpecError(f"{repo_id} is not downloaded and HF_HUB_OFFLINE is set; {hint}")
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # network, auth, missing repo: all mean "cannot get it"
        raise SpecError(
            f"{repo_id} is not downloaded and the hub could not provide it "
            f"({type(err).__name__}); {hint}"
        ) from None
    if not present(folder):
        raise SpecError(f"{repo_id} has no {' or '.join(patterns)}")
    return folder


def _tensor_names(path: Path) -> list[str]:

    check_safetensors(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def locate(source: str) -> tuple[Path, dict, list[Path], list[str]]:
    """The checkpoint's folder, config, the shards holding its MTP layer and their names."""

    path = Path(source).expanduser()
    local = path.exists()
    if not local and looks_like_path(source):
        raise SpecError(f"{source} does not exist")
    if local and not path.is_dir():
        raise SpecError(f"{source} is not a directory")
    folder = path if local else _hub(source, ["config.json"])
    if not (folder / "config.json").is_file():
        raise SpecError(f"{source} is not a model directory (it has no config.json)")
    config = json_object(folder / "config.json", "config.json")
    head = mtp_head.HEADS[
        mtp_head.family(config).layout
    ]  # refused here, before any weights are read

    def ours(key: str) -> bool:
        return head.tensor_name(key, config) is not None

    if not local:
        try:
            folder = _hub(source, ["config.json", INDEX])
        except SpecError:
            folder = _hub(source, ["config.json", SINGLE])
    if (folder / INDEX).is_file():
        weight_map = json_object(folder / INDEX, INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise SpecError(f"{INDEX} in {source} has no weight_map")
        names = [k for k in weight_map if ours(k)]
        files = sorted({str(weight_map[k]) for k in names})
    elif (folder / SINGLE).is_file():
        names = [k for k in _tensor_names(folder / SINGLE) if ours(k)]
        files = [SINGLE] if names else []
    else:
        raise SpecError(f"{source} has no {INDEX} and no single {SINGLE}")
    if not names:
        raise SpecError(
            f"{source} has no MTP layer (no {head.where(config)} tensors; conversions usually "
            "drop it: extract from the original repository)"
        )
    if any("/" in f or f.startswith(".") for f in files):
        raise SpecError(f"{INDEX} in {source} names a shard outside the folder")
    if not local:
        folder = _hub(source, ["config.json", *files])
    shards = [folder / f for f in files]
    missing = [f.name for f in shards if not f.is_file()]
    if missing:
        raise SpecError(f"{source} lacks the shard {missing[0]} that its index names")
    return folder, config, shards, names


def extract(source: str, out: Path, bits: int | None = None, group_size: int = 64, report=print):

    folder, config, shards, names = locate(source)
    head_class = mtp_head.HEADS[mtp_head.family(config).layout]
    wanted, tensors, mlx_format = set(names), {}, True
    for shard in shards:
        check_safetensors(shard)
        arrays, metadata = mx.load(str(shard), return_metadata=True)
        # mlx-lm writes format "mlx" (norms already w + 1); the originals write "pt"
        mlx_format = mlx_format and (metadata or {}).get("format") == "mlx"
        for key in wanted & set(arrays):
            tensors[head_class.tensor_name(key, config)] = arrays[key]
    missing = wanted - {k for k in names if head_class.tensor_name(k, config) in tensors}
    if missing:
        raise SpecError(f"the shards lack {sorted(missing)[0]}, which the index names")
    original = mtp_head.is_original(list(tensors), mlx_format)
    head = head_class(config)
    try:
        weights = head_class.weights(tensors, config, original)
        head.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError) as err:
        raise SpecError(
            f"the MTP tensors do not fit the {config.get('model_type')} layout: {err}"
        ) from None
    head_config = {
        "head_type": HEAD_TYPE,
        "model_type": config.get("model_type"),
        "source": source,
        "text_config": mtp_head.text_config(config),
    }
    if bits is not None:
        head_config["quantization"] = mtp_head.quantize_head(head, bits, group_size)
    out.mkdir(parents=True)
    flat = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), flat, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")
    report(f"read {len(names)} MTP tensors from {len(shards)} of the shards")
    return head_config


def cached_head(source: str, bits: int | None, group_size: int = 64, report=None) -> Path:
    """The head of an original checkpoint, extracted on first use into the cache (only its
    MTP shards read or downloaded) and reused after. The extract is written to a hidden
    directory and renamed into place, under a file lock: an interrupted one leaves no
    half-written head, and a second process waits for the first, then reuses its result.
    `report(line)` gets its lines (default: stderr)."""

    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(f"cannot use the head cache {root}: {err.strerror}") from None
    out = root / cache_name(source, bits, group_size)
    if is_head(out):
        return out
    with FileLock(f"{out}.lock"):
        if is_head(out):
            return out
        for partial in (*root.glob(f".{out.name}.*"), out):  # a killed run's, a damaged one
            if partial.is_dir():
                shutil.rmtree(partial, ignore_errors=True)
        tmp = root / f".{out.name}.{os.getpid()}"
        say = report or (lambda line: print(line, file=sys.stderr))  # as GGUF conversions
        locate(source)  # a checkpoint that cannot give a head: its one line, and no other
        say(f"Extracting the MTP head of {source} (once; cached in {root})…")
        try:
            extract(source, tmp, bits, group_size, report=say)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
