"""A conversation saved with ctrl+s, read back for `mlx-spec chat --load`."""

from __future__ import annotations

from pathlib import Path

from mlx_spec import SpecError


def read_saved(path: str | Path) -> dict:
    """A conversation saved with ctrl+s (its .json), checked: {"messages": [...], "system"}."""
    import json

    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise SpecError(f"cannot read the saved chat {path}: {err.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpecError(f"{path} is not a saved chat (not JSON: {err})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    good = isinstance(messages, list) and all(
        isinstance(m, dict)
        and m.get("role") in ("user", "assistant")
        and isinstance(m.get("content"), str)
        for m in messages
    )
    if not good or not isinstance(record.get("system"), str | None):
        raise SpecError(f"{path} is not a saved chat (no list of user/assistant messages)")
    cache = Path(path).with_suffix(".safetensors")  # ctrl+s saves the caches beside it
    return {"messages": messages, "system": record.get("system"),
            "cache": cache if cache.is_file() else None}  # fmt: skip
