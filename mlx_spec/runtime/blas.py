"""Linux: make MLX's CPU backend use the system OpenBLAS.

The mlx-cpu wheel links a reference BLAS. Loading OpenBLAS with RTLD_GLOBAL before
`mlx.core` is first imported makes MLX resolve its BLAS symbols there: float32 mat-vec gets
~2x faster and, crucially, verifying 8 tokens costs little more than 1, so float32 decoding
becomes memory-bound as on Apple Silicon. Without it speculation cannot pay on Linux.
"""

from __future__ import annotations

import ctypes
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread"
# measured on the demo pair (float32 SmolLM2-135M) on a 2-core x86-64 Linux machine
SLOWDOWN = "float32 decoding ~3x slower than with OpenBLAS"
loaded: str | None = None  # path of the OpenBLAS we loaded, if any
too_late = False  # mlx.core was imported before we could load it


def preload_openblas() -> str | None:
    global loaded, too_late
    if not sys.platform.startswith("linux") or loaded or os.environ.get("MLX_SPEC_NO_OPENBLAS"):
        return loaded
    if "mlx.core" in sys.modules:
        too_late = True
        return None
    for path in CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded = path
            break
    return loaded


def installed() -> str | None:
    """Path of a system OpenBLAS that `preload_openblas` would load, if any."""
    return next((path for path in CANDIDATES if os.path.exists(path)), None)


def notice() -> str | None:
    """One line for the stats when MLX computes on the reference BLAS (Linux, OpenBLAS not
    loaded), saying what it costs and how to fix it; None otherwise."""
    if not sys.platform.startswith("linux") or loaded:
        return None
    head = f"note: MLX uses its slow reference BLAS here ({SLOWDOWN})"
    if too_late:
        return f"{head}: mlx was imported before mlx_spec; import mlx_spec first to load OpenBLAS"
    if os.environ.get("MLX_SPEC_NO_OPENBLAS") and installed():
        return f"{head}: MLX_SPEC_NO_OPENBLAS is set; unset it to use OpenBLAS"
    return f"{head}; install OpenBLAS: {INSTALL_HINT}"


def describe() -> str:
    """One line on which BLAS MLX's CPU backend uses here."""
    if not sys.platform.startswith("linux"):
        return "Apple Accelerate / Metal"
    if loaded:
        return f"OpenBLAS ({loaded})"
    if too_late:
        return "reference BLAS (mlx was imported before mlx_spec, so OpenBLAS was not loaded)"
    if os.environ.get("MLX_SPEC_NO_OPENBLAS"):
        return "reference BLAS (MLX_SPEC_NO_OPENBLAS is set)"
    return f"reference BLAS (float32 decoding is compute-bound; install OpenBLAS: {INSTALL_HINT})"
