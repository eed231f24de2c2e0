"""Shared fixtures: tiny random pairs written to disk once per session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
# the server's disk cache (and anything else under the user's cache folder) stays out of ~
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mlx-spec-tests-cache-")

import mlx_spec  # noqa: E402, F401  (first: it loads OpenBLAS before mlx.core, where present)

# isort: split
import tiny  # noqa: E402

VOCAB = 320


class TinyModels:
    """Paths of tiny models sharing one tokenizer (see tests/tiny.py)."""

    def __init__(self, root: Path):
        self.root = root
        self.tokenizer = root / "tokenizer"
        tiny.write_tokenizer(self.tokenizer, VOCAB)
        cfg = tiny.llama_config(VOCAB, layers=4)
        weights = tiny.random_weights(cfg, seed=0)
        self.target = tiny.write_model(root / "target", cfg, weights, self.tokenizer)
        dw, dc = tiny.truncated(weights, cfg, layers=2)
        self.draft = tiny.write_model(root / "draft", dc, dw, self.tokenizer)  # smaller
        self.copy = tiny.write_model(root / "copy", cfg, weights, self.tokenizer)
        noisy = tiny.noisy(weights, 0.01)  # agrees often in chat contexts: mixed rounds
        self.noisy = tiny.write_model(root / "noisy", cfg, noisy, self.tokenizer)
        self.deranged = tiny.write_model(
            root / "deranged", cfg, tiny.deranged(weights, VOCAB), self.tokenizer
        )
        cfg2 = tiny.llama_config(VOCAB, layers=3)
        w2 = tiny.random_weights(cfg2, seed=1)
        self.target2 = tiny.write_model(root / "target2", cfg2, w2, self.tokenizer)
        dw2, dc2 = tiny.truncated(w2, cfg2, layers=1)
        self.draft2 = tiny.write_model(root / "draft2", dc2, dw2, self.tokenizer)
        self.mamba = tiny.write_mamba(root / "mamba", VOCAB, self.tokenizer)
        l4 = tiny.llama4_config(VOCAB)
        self.chunked = tiny.write_model(
            root / "chunked", l4, tiny.family_weights(l4, seed=0), self.tokenizer
        )
        # deepseek_v41's compressed attention (LayerCache): restored and replayed, no trim
        cc = tiny.compressed_config(VOCAB)
        self.compressed = tiny.write_model(
            root / "compressed", cc, tiny.family_weights(cc, seed=0), self.tokenizer
        )
        self.swapped = tiny.write_model(root / "swapped", dc, dw, self.tokenizer)
        tiny.write_swapped_tokenizer(self.swapped, self.tokenizer, 100, 101)
        # a 16-token vocabulary: distributions small enough to enumerate exactly
        small = tiny.llama_config(16, layers=2, hidden=32)
        sw = tiny.random_weights(small, seed=3, head_scale=3.0)
        self.small_target = tiny.write_model(root / "small_target", small, sw, self.tokenizer)
        sdw, sdc = tiny.truncated(sw, small, layers=1)
        self.small_draft = tiny.write_model(root / "small_draft", sdc, sdw, self.tokenizer)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def pair(tiny_models):
    from mlx_spec import load_pair

    return load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
