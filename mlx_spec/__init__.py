"""mlx-spec: lossless speculative decoding for local LLMs on Apple Silicon, built on MLX.

The API's names load on first use (`mlx_spec.load_pair`, `from mlx_spec import generate`):
importing them pulls in MLX and mlx-lm, about a second, which `mlx-spec --help` and the
package's light modules should not pay.
"""

# ruff: noqa: E402  (OpenBLAS must be loaded before mlx.core is first imported)
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .runtime.blas import preload_openblas

preload_openblas()

from .errors import SpecError

API = {  # name -> the module that defines it
    "BatchDecoder": ".decode.batch",
    "Decoder": ".decode.engine",
    "Event": ".decode.events",
    "GenerationConfig": ".decode.config",
    "Pair": ".pairs.loading",
    "PairConfig": ".pairs.config",
    "Result": ".decode.events",
    "SamplingParams": ".core.sampling",
    "Stats": ".core.stats",
    "batch_generate": ".decode.generate",
    "generate": ".decode.generate",
    "load_decoder": ".decode.saved",
    "load_pair": ".pairs.loading",
    "make_batch_decoder": ".decode.generate",
    "make_decoder": ".decode.generate",
    "save_decoder": ".decode.saved",
    "stream": ".decode.generate",
    "stream_rounds": ".decode.generate",
}

if TYPE_CHECKING:  # what the names are, for readers and type checkers
    from .core.sampling import SamplingParams
    from .core.stats import Stats
    from .decode.batch import BatchDecoder
    from .decode.config import GenerationConfig
    from .decode.engine import Decoder
    from .decode.events import Event, Result
    from .decode.generate import (
        batch_generate,
        generate,
        make_batch_decoder,
        make_decoder,
        stream,
        stream_rounds,
    )
    from .decode.saved import load_decoder, save_decoder
    from .pairs.config import PairConfig
    from .pairs.loading import Pair, load_pair


def __getattr__(name: str):
    """An API name, imported on first use (PEP 562) and kept."""
    if name not in API:
        raise AttributeError(f"module 'mlx_spec' has no attribute {name!r}")
    value = getattr(importlib.import_module(API[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *API])


__all__ = [
    "BatchDecoder",
    "Decoder",
    "Event",
    "GenerationConfig",
    "Pair",
    "PairConfig",
    "Result",
    "SamplingParams",
    "SpecError",
    "Stats",
    "batch_generate",
    "generate",
    "load_decoder",
    "load_pair",
    "make_batch_decoder",
    "make_decoder",
    "save_decoder",
    "stream",
    "stream_rounds",
]
assert set(__all__) == {"SpecError", *API}
