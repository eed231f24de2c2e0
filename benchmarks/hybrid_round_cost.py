"""What a speculative round costs on a hybrid (recurrent) target against plain attention.

Builds tiny random float32 models of the same width and depth — `qwen3_5` (Gated-DeltaNet
layers + attention: rejected rounds restore a snapshot and replay the kept tokens in the next
verify pass) and `qwen3` (attention only: rejected rounds trim the KV cache) — each drafted by
a noisy copy of itself, and times interleaved runs in one process. Prints median ms per round,
ms per token, and the replayed tokens per round, for the hybrid at several replay limits (past
the limit a round drafts nothing, which ends the replay). The draft is as large as its target
here, so neither beats plain decoding: compare the rows, not the speed-ups.
Run: python benchmarks/hybrid_round_cost.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx_spec  # noqa: E402  (first: OpenBLAS before mlx.core)
import mlx_spec.decode.engine as engine  # noqa: E402

# isort: split
import tiny  # noqa: E402

RUNS, TOKENS, K = 7, 96, 3
TEXT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."


def build(root: Path, family: str, noise: float):
    cfg = tiny.family_configs(320)[family]
    cfg = {**cfg, "hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 512}
    weights = tiny.family_weights(cfg, seed=0)
    target = tiny.write_model(root / family, cfg, weights, root / "tok")
    draft = tiny.write_model(root / f"{family}-d", cfg, tiny.noisy(weights, noise), root / "tok")
    return mlx_spec.load_pair(target=str(target), draft=str(draft))


def main() -> None:
    root = Path(tempfile.mkdtemp())
    tiny.write_tokenizer(root / "tok", 320)
    attention, hybrid = build(root, "qwen3", 0.05), build(root, "qwen3_5", 0.03)
    variants = {"qwen3 (attention)": (attention, engine.REPLAY_LIMIT)}
    for limit in (4, 8, 16):
        variants[f"qwen3_5 (limit {limit})"] = (hybrid, limit)
    rows: dict[str, list] = {name: [] for name in variants}
    for _ in range(RUNS):  # interleaved: every variant sees the same machine load
        for name, (pair, limit) in variants.items():
            engine.REPLAY_LIMIT = limit
            prompt = pair.tokenizer.encode(TEXT, add_special_tokens=False)
            for use_draft in (False, True):
                start = time.perf_counter()
                res = mlx_spec.generate(
                    pair, prompt, max_tokens=TOKENS, num_draft_tokens=K, use_draft=use_draft
                )
                rows[name].append((use_draft, time.perf_counter() - start, res.stats))
    print(
        f"{'target':22} {'plain ms/tok':>12} {'spec ms/round':>13} {'spec ms/tok':>11} "
        f"{'tok/pass':>8} {'replayed/round':>14} {'speed-up':>8}"
    )
    for name, runs in rows.items():
        plain = [s.generation_seconds / s.generated_tokens for d, _, s in runs if not d]
        spec = [s for d, _, s in runs if d]
        per_round = [s.generation_seconds / s.target_passes for s in spec]
        per_tok = [s.generation_seconds / s.generated_tokens for s in spec]
        replayed = statistics.median(s.replayed_tokens / s.target_passes for s in spec)
        tpp = statistics.median(s.tokens_per_target_pass for s in spec)
        ratio = statistics.median(plain) / statistics.median(per_tok)
        print(
            f"{name:22} {1e3 * statistics.median(plain):12.2f} "
            f"{1e3 * statistics.median(per_round):13.2f} {1e3 * statistics.median(per_tok):11.2f} "
            f"{tpp:8.2f} {replayed:14.2f} {ratio:7.2f}x"
        )


if __name__ == "__main__":
    main()
