"""mlx-spec: lossless speculative decoding for local LLMs on Apple Silicon, built on MLX."""

# ruff: noqa: E402  (OpenBLAS must be loaded before mlx.core is first imported below)
from .runtime.blas import preload_openblas

preload_openblas()

from .core.sampling import SamplingParams
from .core.stats import Stats
from .decode.batch import BatchDecoder, batch_generate, make_batch_decoder
from .decode.config import GenerationConfig
from .decode.engine import Decoder, generate, make_decoder, stream, stream_rounds
from .decode.events import Event, Result
from .errors import SpecError
from .pairs.config import PairConfig
from .pairs.loading import Pair, load_pair

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
