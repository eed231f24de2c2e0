"""Does a shorter DFlash / DSpark block pay? (issue 59, item 7)

mlx-vlm shortens the block a DFlash or DSpark head runs at run time (`_dflash_next_block_size`:
from recent acceptance, down to 4 rows, and 6 rows for a DSpark head over a context inside its
window). mlx-spec always runs the checkpoint's `block_size` (what the head was trained on: the
block attends both ways, so a shorter block changes the guesses) and lets the controller choose
how many of the guesses the target verifies (k). What a shorter block could save is the head's
own forward over fewer rows; this measures it.

Tiny random float32 models (the suite's builders): a llama target (hidden 512, 8 layers) and a
DFlash head in z-lab's layout (2 layers, hidden 512, 3 target layers read), one checkpoint per
block size. A round at fixed k: the head's forward over the block, then one verify pass of k + 1
rows (random heads are rejected, so every round keeps one token: what is compared is cost, not
acceptance). Per k: the median ms per target pass with the full block of 16 against a block of
k + 1 (the shortest that offers k guesses), interleaved in one process, and a plain step's.

Run: flock /tmp/bench.lock python benchmarks/block_length.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx_spec  # noqa: E402, I001  (first: OpenBLAS before mlx.core)
import tiny  # noqa: E402
from test_dflash import head_config, write_head  # noqa: E402

FULL, KS, TOKENS = 16, (3, 5, 7, 15), 48
PROMPT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."


def seconds_per_pass(pair, **settings) -> float:
    res = mlx_spec.generate(pair, PROMPT, max_tokens=TOKENS, temperature=0.0, **settings)
    return res.stats.generation_seconds / res.stats.target_passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny.write_tokenizer(root / "tok", 320)
        cfg = tiny.llama_config(320, layers=8, hidden=512)
        weights = tiny.random_weights(cfg, seed=0)
        target = tiny.write_model(root / "llama", cfg, weights, root / "tok")
        llama = json.loads((target / "config.json").read_text())
        pairs = {}
        for block in sorted({FULL, *(k + 1 for k in KS)}):
            head = write_head(root / f"b{block}", head_config(llama, [1, 4, 6], block, layers=2))
            pairs[block] = mlx_spec.load_pair(target=str(target), drafter="dflash", head=str(head))
        plain, times = [], {(k, b): [] for k in KS for b in (FULL, k + 1)}
        for run in range(args.runs + 1):  # the first run warms up, not counted
            step = seconds_per_pass(pairs[FULL], use_draft=False)
            rounds = {(k, b): seconds_per_pass(pairs[b], num_draft_tokens=k) for k, b in times}
            if run:
                plain.append(step)
                for key, s in rounds.items():
                    times[key].append(s)
            print(f"run {run}: plain {step * 1e3:.1f} ms", file=sys.stderr, flush=True)
    step = statistics.median(plain)
    print(f"\nplain step {step * 1e3:.1f} ms (median of {args.runs}); ms per target pass, "
          "× a plain step in brackets\n")  # fmt: skip
    print(f"| k | block {FULL} (mlx-spec) | block k + 1 (shortened) | shortened / full |")
    print("|---:|---:|---:|---:|")
    for k in KS:
        full = statistics.median(times[(k, FULL)])
        short = statistics.median(times[(k, k + 1)])
        print(f"| {k} | {full * 1e3:.1f} ({full / step:.2f}) | {short * 1e3:.1f} "
              f"({short / step:.2f}) | {short / full:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
