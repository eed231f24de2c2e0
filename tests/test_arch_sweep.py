"""The fast subset of benchmarks/arch_sweep.py, run every time: one architecture per cache class
mlx-lm builds, each tiny and random, decoded with a draft model (k = 4), with prompt lookup and
in a batch of two rows with the draft, every output equal to mlx-lm's own greedy decoding.
The whole sweep (every architecture of the installed mlx-lm) is the benchmark; its table is in
docs/families.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import arch_sweep  # noqa: E402

from mlx_spec import load_pair  # noqa: E402

# architecture -> the mlx-lm cache class it is here for
SUBSET = {
    "llama": "KVCache",
    "gemma3_text": "RotatingKVCache",  # sliding windows (WindowedKVCache here)
    "mamba": "ArraysCache",  # a recurrent state only
    "qwen3_5": "ArraysCache",  # Gated DeltaNet beside attention
    "falcon_h1": "CacheList",  # a Mamba-2 state and attention in one layer
    "llama4": "ChunkedKVCache",  # chunked attention
    "deepseek_v41": "LayerCache",  # a window and compressed groups, restored and replayed
}


def cache_classes(model) -> set[str]:
    out = set()
    for c in make_prompt_cache(model):
        out |= {type(x).__name__ for x in [c, *getattr(c, "caches", ())]}
    return out


@pytest.mark.parametrize("arch", list(SUBSET))
def test_each_cache_class_decodes_as_mlx_lm(arch, tiny_models, tmp_path):
    target, _ = arch_sweep.build(arch, tmp_path, tiny_models.tokenizer, seed=0)
    assert SUBSET[arch] in cache_classes(load_pair(target=str(target)).target)
    row = arch_sweep.sweep_one(arch, tmp_path, tiny_models.tokenizer, tokens=16, seeds=2)
    assert row["result"] == "ok", row
