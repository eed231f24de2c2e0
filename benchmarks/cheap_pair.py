"""Write a synthetic pair whose draft is cheap (< 0.2 of a target step) and agrees often.

No real pair of that shape fits this offline machine, so this builds one from random float32
weights in the Hugging Face layout: the draft is a small model (the tests' tokenizer, a
320-token vocabulary, so the output head costs nothing); the target is the same model with many
extra layers whose outputs are scaled down (`--scale`), so it computes nearly the same function
at many times the cost. `--scale` sets how often they disagree (0.01: about half the draft
tokens accepted). The text is gibberish; the timings and the agreement are what the benchmark
measures.

    python benchmarks/cheap_pair.py /tmp/cheap
    mlx-spec bench --target /tmp/cheap/target --draft /tmp/cheap/draft --k 2,4,6,auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx_spec  # noqa: E402, F401  (first: OpenBLAS before mlx.core)

# isort: split
import tiny  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--extra-layers", type=int, default=30, help="target = draft + these")
    parser.add_argument("--scale", type=float, default=0.01, help="the extra layers' output scale")
    args = parser.parse_args()

    tiny.write_tokenizer(args.out / "tokenizer", 320)
    cfg = {**tiny.llama_config(320, layers=args.draft_layers, hidden=args.hidden)}
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = 12, 4
    draft_weights = tiny.random_weights(cfg, seed=0)
    tiny.write_model(args.out / "draft", cfg, draft_weights, args.out / "tokenizer")

    layers = args.draft_layers + args.extra_layers
    big = {**cfg, "num_hidden_layers": layers}
    weights = tiny.random_weights(big, seed=1)
    for name, w in draft_weights.items():  # the draft's own layers, embedding and head
        weights[name] = w
    for i in range(args.draft_layers, layers):  # the rest barely move the residual stream
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            name = f"model.layers.{i}.{proj}.weight"
            weights[name] = weights[name] * args.scale
    tiny.write_model(args.out / "target", big, weights, args.out / "tokenizer")
    print(f"draft: {args.draft_layers} layers; target: {layers} layers; in {args.out}")


if __name__ == "__main__":
    main()
