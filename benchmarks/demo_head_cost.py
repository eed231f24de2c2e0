"""What a round with an EAGLE-3 head costs on the demo target, against a plain step.

A head of the demo recipe's shape (draft vocabulary 2,048, MLP 1,024) with random weights, so
nearly every draft is rejected and every round costs a full k: the median ms per target pass at
fixed k, divided by plain decoding's ms per token, interleaved runs in one process. A head
breaks even at that many tokens per target pass.

    flock /tmp/bench.lock python benchmarks/demo_head_cost.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from mlx_spec.decode.prompts import encode_prompt
from mlx_spec.measure.benchmark import run_mlx_spec
from mlx_spec.models.model_dir import text_config
from mlx_spec.pairs.loading import load_pair, pair_config
from mlx_spec.train import eagle_head as ht

ROOT = Path(__file__).resolve().parent.parent
DEMO = "smollm2-demo"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", default="1,2,4")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1024)
    args = p.parse_args(argv)

    plain = load_pair(pair_config(DEMO, skip_draft=True))
    where = Path(tempfile.mkdtemp()) / "head"  # new_head writes the head and loads it back
    layers = ht.default_layers(int(text_config(plain.target_config)["num_hidden_layers"]))
    config = ht.head_config(plain.target_config, layers, args.draft_vocab, args.intermediate)
    head = ht.new_head(plain, config, list(range(args.draft_vocab)), where, seed=0)
    headed = ht.engine_pair(plain, head, where)  # the same loaded target, with the head
    texts = (ROOT / "benchmarks" / "chat_prompts.txt").read_text().splitlines()
    texts = [t.strip() for t in texts if t.strip()][: args.prompts]
    ks = [0, *(int(k) for k in args.k.split(","))]
    ms = {k: [] for k in ks}
    for r in range(args.runs):
        for text in texts:
            ids = encode_prompt(plain.tokenizer, [{"role": "user", "content": text}])
            for k in ks:
                run = run_mlx_spec(headed if k else plain, ids, args.max_tokens, 0.0, k, seed=r)
                # timed from the first token (the prefill's) to the last: the decode passes
                seconds = (len(run.tokens) - 1) / run.tokens_per_second
                ms[k].append(1000 * seconds / max(run.target_passes, 1))
    shutil.rmtree(where.parent)
    base = statistics.median(ms[0])
    print(f"plain: {base:.1f} ms a step")
    for k in ks[1:]:
        m = statistics.median(ms[k])
        print(f"k={k}: {m:.1f} ms a round, {m / base:.2f}x a plain step (break-even tokens/pass)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
