"""matplotlib, an optional extra, for `--plot` on probe and bench."""

from __future__ import annotations

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
