"""mlx-spec: lossless speculative decoding for local LLMs on Apple Silicon, built on MLX."""

from .engine import Decoder, Event, Result, generate, make_decoder, stream
from .errors import SpecError
from .loading import Pair, load_pair
from .sampling import SamplingParams
from .stats import Stats

__all__ = [
    "Decoder",
    "Event",
    "Pair",
    "Result",
    "SamplingParams",
    "SpecError",
    "Stats",
    "generate",
    "load_pair",
    "make_decoder",
    "stream",
]
