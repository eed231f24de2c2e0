"""models.toml: curated pairs shipped with the package, plus a user file that adds or
overrides pairs (~/.config/mlx-spec/models.toml, or the path in MLX_SPEC_MODELS), and which of
them are already on this machine (`pair_downloaded`). Nothing here loads MLX or mlx-lm:
`mlx-spec models` lists the pairs in a fraction of a second."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from ..errors import SpecError
from ..models.hub import is_downloaded
from .config import PairConfig

PAIR_KEYS = {
    "target", "draft", "num_draft_tokens", "note", "dtype", "drafter", "draft_adapter", "seen"
}  # fmt: skip


def builtin_file() -> Path:
    """The curated models.toml: inside an installed wheel (the build copies it in), else the
    repository's top-level file (a source checkout or an editable install)."""
    package = Path(__file__).resolve().parents[1]  # mlx_spec/
    packaged = package / "models.toml"
    return packaged if packaged.is_file() else package.parent / "models.toml"


def user_file() -> Path:
    env = os.environ.get("MLX_SPEC_MODELS")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "mlx-spec" / "models.toml"


def _line_of(text: str, name: str) -> int:
    pattern = re.compile(
        r'^[ \t]*\[[ \t]*pairs[ \t]*\.[ \t]*"?' + re.escape(name) + r'"?[ \t]*\]', re.M
    )
    m = pattern.search(text)
    return text.count("\n", 0, m.start()) + 1 if m else 1


def _parse_pair(name: str, entry, path: Path, text: str) -> PairConfig:
    """A [pairs.NAME] table -> a PairConfig; a problem is one line that names the file, the
    line and the pair (the config's own checks included)."""
    where = f"{path}:{_line_of(text, name)}"
    if not isinstance(entry, dict):
        raise SpecError(f"{where}: pair {name!r} must be a table")
    unknown = set(entry) - PAIR_KEYS
    if unknown:
        raise SpecError(f"{where}: pair {name!r} has unknown keys {sorted(unknown)}")
    target = entry.get("target")
    if not isinstance(target, str) or not target:
        raise SpecError(f'{where}: pair {name!r} needs target = "path or hub id"')
    raw_k = entry.get("num_draft_tokens", "auto")
    if raw_k != "auto" and (not isinstance(raw_k, int) or isinstance(raw_k, bool) or raw_k < 1):
        raise SpecError(
            f'{where}: pair {name!r}: num_draft_tokens must be an integer >= 1 or "auto"'
        )
    draft = entry.get("draft")
    draft_bits, group_size, head = None, 32, None
    drafter = entry.get("drafter")
    if isinstance(draft, dict) and "head" in draft:  # { head = "mtp", path = "DIR" }
        unknown = set(draft) - {"head", "path"}
        if unknown or not isinstance(draft["head"], str) or not isinstance(draft.get("path"), str):
            raise SpecError(
                f'{where}: pair {name!r}: a head draft must be {{ head = "KIND", path = "DIR" }}'
            )
        if drafter is not None and drafter != draft["head"]:
            raise SpecError(f"{where}: pair {name!r}: drafter and the draft's head differ")
        # a folder beside the file, or else a hub id ("org/name": EAGLE-3 and DFlash heads)
        head, local = draft["path"], _relative_to(path, draft["path"])
        hub_id = head.count("/") == 1 and not head.startswith((".", "/", "~", "package:"))
        head = head if hub_id and not Path(local).exists() else local
        drafter = draft["head"]
        draft = None
    elif isinstance(draft, dict):
        if draft.get("from_target") is not True or not isinstance(draft.get("bits"), int):
            raise SpecError(
                f"{where}: pair {name!r}: a draft table must be "
                "{ from_target = true, bits = N, group_size = G }"
            )
        unknown = set(draft) - {"from_target", "bits", "group_size"}
        if unknown:
            raise SpecError(f"{where}: pair {name!r}: the draft table has unknown keys "
                            f"{sorted(unknown)}")  # fmt: skip
        draft_bits, group_size, draft = draft["bits"], draft.get("group_size", 32), None
    elif draft is not None and not isinstance(draft, str):
        raise SpecError(f"{where}: pair {name!r}: draft must be a path or hub id")
    adapter = entry.get("draft_adapter")
    if adapter is not None:
        if not isinstance(adapter, str) or not adapter:
            raise SpecError(f"{where}: pair {name!r}: draft_adapter must be a directory path")
        adapter = _relative_to(path, adapter)
    if drafter is not None and not isinstance(drafter, str):
        raise SpecError(f"{where}: pair {name!r}: drafter must be a string")
    seen = entry.get("seen")
    if seen is not None and not (isinstance(seen, str) and seen.strip() or seen is False):
        raise SpecError(
            f'{where}: pair {name!r}: seen must be "where the names were seen published" or false'
        )
    try:
        return PairConfig(
            target,
            draft,
            drafter=drafter,
            draft_bits=draft_bits,
            draft_group_size=group_size,
            dtype=entry.get("dtype"),
            draft_adapter=adapter,
            head=head,
            num_draft_tokens=raw_k,
            name=name,
            note=str(entry.get("note", "")),
            seen="" if seen is False else seen,
            source=path,
        )
    except SpecError as err:
        raise SpecError(f"{where}: pair {name!r}: {err}") from None


def _relative_to(toml_file: Path, name: str) -> str:
    """A relative adapter path in models.toml is read from the file's own folder."""
    if name.startswith("package:"):  # inside an installed package: no folder to join
        return name
    expanded = os.path.expanduser(name)
    return expanded if os.path.isabs(expanded) else str(toml_file.parent / expanded)


def parse_file(path: Path) -> dict[str, PairConfig]:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise SpecError(f"{path}:{line}: not UTF-8 (TOML files must be UTF-8)") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path}: malformed TOML: {err}") from err
    pairs = data.get("pairs", {})
    if not isinstance(pairs, dict) or not all(isinstance(e, dict) for e in pairs.values()):
        raise SpecError(f"{path}:{_line_of(text, '')}: [pairs] must be a table of pairs")
    return {name: _parse_pair(name, entry, path, text) for name, entry in pairs.items()}


class Registry:
    def __init__(self, pairs: dict[str, PairConfig]):
        self.pairs = pairs

    def get_pair(self, name: str) -> PairConfig:
        if name not in self.pairs:
            known = ", ".join(sorted(self.pairs))
            raise SpecError(f"unknown pair {name!r}; known pairs: {known}")
        return self.pairs[name]


def load_registry() -> Registry:
    pairs = parse_file(builtin_file())
    user = user_file()
    if user.is_file():
        pairs.update(parse_file(user))
    elif os.environ.get("MLX_SPEC_MODELS"):
        raise SpecError(f"MLX_SPEC_MODELS names a file that does not exist: {user}")
    return Registry(pairs)


def pair_parts(spec) -> list[tuple[str, str, bool]]:
    """(part, name, on this machine) for each thing a pair loads: its target, its draft model,
    its head (an MTP head: extracted into the head cache). No network."""
    parts = [("target", spec.target, is_downloaded(spec.target))]
    if spec.draft:
        parts.append(("draft", spec.draft, is_downloaded(spec.draft)))
    if spec.head is not None:
        parts.append(
            (f"{spec.drafter} head", spec.head, spec.kind.head_downloaded(spec.head, spec.target))
        )
    return parts


def pair_downloaded(spec) -> bool:
    """Whether every model of a models.toml pair is on this machine (nothing to download)."""
    return all(have for _, _, have in pair_parts(spec))
