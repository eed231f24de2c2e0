"""mlx-spec: lossless speculative decoding for local LLMs on Apple Silicon, built on MLX."""

# ruff: noqa: E402  (OpenBLAS must be loaded before mlx.core is first imported below)
from .blas import preload_openblas

preload_openblas()

from .batch import BatchDecoder, batch_generate, make_batch_decoder
from .config import GenerationConfig, PairConfig
from .engine import Decoder, Event, Result, generate, make_decoder, stream, stream_rounds
from .errors import SpecError
from .loading import Pair, load_pair
from .sampling import SamplingParams
from .stats import Stats

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
    "load_pair",
    "make_batch_decoder",
    "make_decoder",
    "stream",
    "stream_rounds",
]
