"""What a round costs with each drafting head, against a draft model's, on tiny models.

Tiny random float32 models in the published layouts (the test suite's builders): a llama target
(hidden 256, 8 layers) drafted by its 2-layer truncation, an EAGLE-3 head, a DFlash head and a
DSpark head (DFlash's backbone and a Markov head of rank 8: its k small steps after the block)
and a DFlash2 head (convolutions in every layer, the selector's k steps over 16 candidates); a
Qwen3.5 target (hybrid) with its MTP head; a DeepSeek-V3 target (MLA, MoE; hidden 256, 8
layers) drafted by its 2-layer truncation and by its MTP layer in the DeepSeek layout
(`model.layers.{N}`: enorm / hnorm / eh_proj / shared_head); a Gemma 4 target (hidden 256,
6 layers: sliding and full, the last two sharing keys and values) drafted by a 2-layer Gemma 4
(its layers 0 and 2) and by a 2-layer assistant head (k steps over the target's keys and
values). Random heads are nearly always
rejected, so what this compares is cost, not acceptance: the median ms of a round at fixed
k = 3 (the draft and one verify pass of 4 rows) divided by the median ms of a plain target
step on the same target, interleaved runs in one process.
Run: flock /tmp/bench.lock python benchmarks/head_round_cost.py [TARGET ...] (llama, qwen3.5,
dsv3, gemma4; all when none is named)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import mlx_spec  # noqa: E402, I001  (first: OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402

# isort: split
import real_configs  # noqa: E402
import tiny  # noqa: E402
from test_dflash import head_config  # noqa: E402
from test_dflash import write_head as write_dflash  # noqa: E402
from test_dflash2 import head_config as dflash2_config  # noqa: E402
from test_dflash2 import write_head as write_dflash2  # noqa: E402
from test_dspark import head_config as dspark_config  # noqa: E402
from test_dspark import write_head as write_dspark  # noqa: E402
from test_eagle import head_weights, subset  # noqa: E402
from test_eagle import write_head as write_eagle  # noqa: E402
from test_gemma4_assistant import head_config as assistant_config  # noqa: E402
from test_gemma4_assistant import target_embedding, text_of  # noqa: E402
from test_gemma4_assistant import write_head as write_assistant  # noqa: E402
from test_mtp import original_checkpoint  # noqa: E402
from test_mtp_nextn import write_original  # noqa: E402

from mlx_spec.cli import main as cli  # noqa: E402

RUNS, TOKENS, K = 5, 48, 3
PROMPT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."


def pairs(root: Path) -> dict:
    tok = root / "tok"
    tiny.write_tokenizer(tok, 320)
    cfg = tiny.llama_config(320, layers=8, hidden=256)
    weights = tiny.random_weights(cfg, seed=0)
    target = tiny.write_model(root / "llama", cfg, weights, tok)
    dw, dc = tiny.truncated(weights, cfg, layers=2)
    draft = tiny.write_model(root / "draft", dc, dw, tok)
    llama = json.loads((target / "config.json").read_text())
    eagle = write_eagle(root / "eagle", llama, head_weights(llama, subset(320, 96, 1), 5, False))
    dflash = write_dflash(root / "dflash", head_config(llama, [1, 4, 6], block_size=8))
    dspark = write_dspark(root / "dspark", dspark_config(llama, [1, 4, 6], block_size=8))
    dflash2 = write_dflash2(root / "dflash2", dflash2_config(llama, [1, 4, 6], block_size=8))
    original_checkpoint(root / "qwen35", 320, tok)
    assert cli(["heads", "extract", str(root / "qwen35"), str(root / "mtp")]) == 0
    wide = {"hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 512}
    wide |= {"moe_intermediate_size": 128, "kv_lora_rank": 64, "q_lora_rank": 96}
    ds = real_configs.mtp_configs(320)["deepseek-v3"] | wide
    ds, ds_weights, _ = write_original(root / "dsv3-original", "deepseek-v3", 320, tok, config=ds)
    ds_target = tiny.write_model(root / "dsv3", ds, ds_weights, tok)
    dw, dc = tiny.truncated(ds_weights, ds, layers=2)
    ds_draft = tiny.write_model(root / "dsv3-draft", dc, dw, tok)
    assert cli(["heads", "extract", str(root / "dsv3-original"), str(root / "dsv3-mtp")]) == 0
    gemma4 = tiny.write_gemma4(root / "gemma4", tok, hidden=256)
    g4_cfg = json.loads((gemma4 / "config.json").read_text())
    g4_text = g4_cfg["text_config"]
    g4_text |= {"num_hidden_layers": 2, "num_kv_shared_layers": 0}
    g4_text["layer_types"] = ["sliding_attention", "full_attention"]  # layers 0 and 2
    layer = {"0": "0", "2": "1"}
    g4_weights = {}
    for k, v in mx.load(str(gemma4 / "model.safetensors")).items():
        if ".layers." not in k:
            g4_weights[k] = v
        elif k.split(".")[3] in layer:
            parts = k.split(".")
            parts[3] = layer[parts[3]]
            g4_weights[".".join(parts)] = v
    g4_draft = tiny.write_model(root / "gemma4-draft", g4_cfg, g4_weights, tok)
    assistant = write_assistant(
        root / "assistant", assistant_config(text_of(gemma4)), target_embedding(gemma4)
    )
    load = mlx_spec.load_pair
    return {
        "llama": {
            "draft model (2 of 8 layers)": load(target=str(target), draft=str(draft)),
            "eagle3 head": load(target=str(target), drafter="eagle3", head=str(eagle)),
            "dflash head (block 8)": load(target=str(target), drafter="dflash", head=str(dflash)),
            "dspark head (block 8)": load(target=str(target), drafter="dspark", head=str(dspark)),
            "dflash2 head (block 8)": load(target=str(target), drafter="dflash", head=str(dflash2)),
        },
        "qwen3.5": {
            "mtp head": load(target=str(root / "qwen35"), drafter="mtp", head=str(root / "mtp"))
        },
        "dsv3": {
            "draft model (2 of 8 layers)": load(target=str(ds_target), draft=str(ds_draft)),
            "mtp head (DeepSeek layout)": load(
                target=str(ds_target), drafter="mtp", head=str(root / "dsv3-mtp")
            ),
        },
        "gemma4": {
            "draft model (2 of 6 layers)": load(target=str(gemma4), draft=str(g4_draft)),
            "assistant head (2 layers)": load(
                target=str(gemma4), drafter="assistant", head=str(assistant)
            ),
        },
    }


def seconds_per_pass(pair, **settings) -> float:
    res = mlx_spec.generate(pair, PROMPT, max_tokens=TOKENS, **settings)
    return res.stats.generation_seconds / res.stats.target_passes


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for target, kinds in pairs(Path(tmp)).items():
            if sys.argv[1:] and target not in sys.argv[1:]:
                continue
            any_pair = next(iter(kinds.values()))
            times = {"plain step": [], **{name: [] for name in kinds}}
            for run in range(RUNS + 1):
                step = seconds_per_pass(any_pair, use_draft=False)
                rounds = {n: seconds_per_pass(p, num_draft_tokens=K) for n, p in kinds.items()}
                if run:  # the first run pays one-time costs
                    times["plain step"].append(step)
                    for name, t in rounds.items():
                        times[name].append(t)
            plain = statistics.median(times["plain step"])
            for name, t in times.items():
                m = statistics.median(t)
                print(f"{target:<8} {name:<28} {m * 1e3:6.2f} ms  {m / plain:5.2f} plain steps")


if __name__ == "__main__":
    main()
