"""The suffix index's size and look-up time (drafters/suffix.py): a key's history of real
text (the repository's Python sources, tokenized by the demo's tokenizer) at several sizes,
a request's context over it, and the time of one round's look-up (the longest match, its
continuation) against the same for today's n-gram lookup. Memory by tracemalloc (Python
objects of the index); times are medians of many look-ups at positions through the text.

    flock /tmp/bench.lock python benchmarks/suffix_index.py [--sizes 10000,100000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from mlx_spec.decode.history import HistoryIndex
from mlx_spec.drafters.ngram import NGramDrafter
from mlx_spec.drafters.suffix import SuffixDrafter, SuffixHistory
from mlx_spec.pairs.loading import load_pair, pair_config

ROOT = Path(__file__).resolve().parent.parent


def corpus(tokenizer, size: int) -> list[int]:
    tokens: list[int] = []
    for path in sorted((ROOT / "mlx_spec").rglob("*.py")):
        tokens += tokenizer.encode(path.read_text())
        if len(tokens) >= size + 4000:
            break
    return tokens


def measured(make):
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = make()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return obj, after - before


def lookup_times(drafter, queries, call) -> float:
    times = []
    for q in queries:
        drafter.prefill(q)
        start = time.perf_counter()
        call(drafter)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000")
    args = p.parse_args(argv)
    tokenizer = load_pair(pair_config("smollm2-demo", skip_draft=True)).tokenizer
    sizes = [int(s) for s in args.sizes.split(",")]
    text = corpus(tokenizer, max(sizes))
    print("| history tokens | index | memory (MB) | bytes / token | look-up median (µs) |")
    print("|---|---|---|---|---|")
    for size in sizes:
        history = text[:size]
        # requests: 2,000-token windows that repeat a stretch of the history, cut at 50 places
        queries = [text[i : i + 2000] for i in range(0, size - 2000, max(1, (size - 2000) // 50))]
        s_hist, s_bytes = measured(lambda h=history, n=size: _suffix_history(h, n))
        n_hist, n_bytes = measured(lambda h=history, n=size: _ngram_history(h, n))
        d = SuffixDrafter(history=s_hist)
        suffix_us = lookup_times(
            d, queries, lambda d: (d.suffix_draft(), setattr(d, "_draft", None))
        )
        n = NGramDrafter(3, 1, history=n_hist)
        ngram_us = lookup_times(n, queries, lambda n: n.lookup(8))
        for name, b, us in (("suffix", s_bytes, suffix_us), ("ngram", n_bytes, ngram_us)):
            print(f"| {size} | {name} | {b / 1e6:.1f} | {b / size:.0f} | {us:.1f} |")
    # a request's own index: a 2,000-token context built once, then one look-up and one
    # commit a round
    d, ctx_bytes = measured(lambda: _context(text[:2000]))
    print(f"\nrequest index, 2,000 tokens: {ctx_bytes / 1e6:.2f} MB")
    return 0


def _fresh_lookup(d):
    d._draft = None  # not the cached one: a look-up after a commit
    return d.suffix_draft()


def _suffix_history(tokens, size):
    h = SuffixHistory(size)
    h.add(tokens)
    return h


def _ngram_history(tokens, size):
    h = HistoryIndex(size)
    h.add(tokens)
    return h


def _context(tokens):
    d = SuffixDrafter()
    d.prefill(tokens)
    return d


if __name__ == "__main__":
    sys.exit(main())
