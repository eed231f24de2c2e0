"""How fast a new EAGLE-3 head learns from each start, on the demo target's own replies.

Takes the replies of a `benchmarks/train_demo_head.py` run (its sequences.json), computes the
target's features once, then trains one head per start for a few steps (the same batches,
seed and learning rate) and prints the held-out greedy agreement per draft step after them:

- `target`: the output layer as the target's rows and final norm (eagle_build before the scale)
- `scaled`: the same with the norm at eagle_build.OUTPUT_SCALE (the default now)
- `pass`: `target`'s output, fc passing layer N-4's features through, the layer's output
  projections at zero (the head starts as the target's own guess from that layer)

    flock /tmp/bench.lock python benchmarks/head_init.py /tmp/demo-head/sequences.json

Measured (this 2-core CPU, 160 training replies, 30 steps of batch 8, 3 draft steps): held-out
agreement at draft step 1 0.065 (target), 0.142 (scaled), 0.131 (pass); 3.3 s a step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_spec.models.model_dir import text_config
from mlx_spec.pairs.loading import load_pair
from mlx_spec.train import eagle_build as hb
from mlx_spec.train import eagle_head as ht
from mlx_spec.train import eagle_ttt as tt
from mlx_spec.train.common import read_sequences

STARTS = ("target", "scaled", "pass")


def start(head: ht.Eagle3Head, name: str) -> None:
    """Change a head made by eagle_build.new_head (scaled) into the start `name`."""
    if name in ("target", "pass"):
        head.norm.weight = head.norm.weight / hb.OUTPUT_SCALE
    if name == "pass":
        hidden = head.fc.weight.shape[0]
        fc = mx.zeros(head.fc.weight.shape)  # (H, 3H): layer N-4's features are the last H
        fc[:, 2 * hidden :] = mx.eye(hidden)
        head.fc.weight = fc
        layer = head.midlayer
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sequences", type=Path, help="a head run's sequences.json")
    p.add_argument("--starts", default=",".join(STARTS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--train", type=int, default=160, help="training replies used")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    args = p.parse_args(argv)

    pair = load_pair("smollm2-demo", skip_draft=True)
    data = read_sequences(args.sequences)
    t = text_config(pair.target_config)
    layers = hb.default_layers(int(t["num_hidden_layers"]))
    ids = hb.choose_vocab(data["train"], int(t["vocab_size"]), 2048)
    config = hb.head_config(pair.target_config, layers, len(ids), 1024)
    where = args.sequences.parent / "head-init"
    first = hb.new_head(pair, config, ids, where, 0)
    begin = time.perf_counter()
    train = tt.target_features(
        pair, first.layers_read, data["train"][: args.train], 8, lambda m: None
    )
    held = tt.target_features(pair, first.layers_read, data["held_out"], 8, lambda m: None)
    print(f"features: {time.perf_counter() - begin:.0f} s")
    settings = ht.HeadSettings(batch_size=8)
    for name in args.starts.split(","):
        head = ht.load_head(where, pair.target, pair.target_config)  # new_head's, as written
        start(head, name)
        mx.eval(head.parameters())
        head.train()
        optimizer = optim.Adam(learning_rate=args.learning_rate)
        optimizer.init(head.trainable_parameters())
        loss_and_grad = nn.value_and_grad(
            head, lambda b, head=head: tt.ttt_loss(head, b, args.ttt_steps)
        )
        losses = []
        begin = time.perf_counter()
        for step in range(args.steps):
            losses.append(ht.train_step(head, optimizer, loss_and_grad, train, settings, step))
        seconds = (time.perf_counter() - begin) / args.steps
        after = tt.evaluate(head, held, args.ttt_steps, 8)
        agreement = " ".join(f"{a:.3f}" for a in after["greedy_agreement"])
        print(
            f"{name:7s} loss {losses[0]:.1f} -> {losses[-1]:.1f}  held-out agreement per draft "
            f"step {agreement}  tokens/pass offline {after['tokens_per_pass_offline']:.3f}  "
            f"({seconds:.1f} s/step)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
