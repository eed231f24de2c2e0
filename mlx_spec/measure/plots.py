"""matplotlib, an optional extra, for `--plot` on probe and bench."""

from __future__ import annotations

from pathlib import Path

from ..errors import SpecError


def pyplot():
    """matplotlib.pyplot on a file-only backend, or a one-line error saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SpecError("--plot needs matplotlib: pip install 'mlx-spec[plot]'") from err
    return plt


def check_plot(path: str | None) -> None:
    """`--plot FILE.png` checked before any work: matplotlib is there, and the file can be
    written where asked (a plot into a missing folder failed once the whole run was done,
    with a traceback and exit 1)."""
    if not path:
        return
    pyplot()
    target = Path(path).expanduser()
    if target.is_dir():
        raise SpecError(f"--plot {path} is a directory: give a file name, e.g. plot.png")
    if not target.parent.is_dir():
        raise SpecError(f"--plot {path}: the folder {target.parent} does not exist")
