"""Random target/draft pairs for serve_batch.py, written in the Hugging Face layout (issue 46).

Two pairs, each a directory `target` and `draft` with `config.json`, `model.safetensors` and a
tokenizer (a byte-level BPE trained here on serve_batch.py's prompts, with a Qwen-2.5-shaped
chat template that has tools, so mlx-lm's `json_tools` parser and `tool_choice` work):

- `hybrid`: a Qwen3.5-shaped target (`model_type` `qwen3_5`: Gated-DeltaNet layers, full
  attention every `--interval`th layer; checkpoint keys `model.language_model.*`, conv1d
  weights `[C, 1, K]` and zero-centred norms, as Qwen's checkpoints, which mlx-lm's `sanitize`
  converts) and as its draft the target's embedding, final norm and head around one dense
  `qwen3` layer of its own (plain KV caches; a `qwen3_5` of attention layers only does not run
  in mlx-lm 0.32, whose ssm mask reads layer 0's cache); and in `hybrid/draft-recurrent` a
  recurrent draft, as the curated Qwen3.5 pairs' 0.8B is: the target's layer 0 (Gated-DeltaNet)
  and its first full-attention layer, its embedding, norm and head (a quarter of its layers).
- `sliding`: a Gemma-3-shaped target (`gemma3_text`, `--window`-token sliding window on every
  layer but each `--pattern`th) and as its draft its first `--draft-layers` (2: one sliding,
  one global).

Weights are random float32; every layer's output projection is scaled by `--residual` so the
embedding dominates the residual stream and the draft agrees with the target often, and the
output head is scaled by `--head-scale` with the end-of-turn row zeroed (replies run to
`max_tokens`). Sizes default to hidden 1024 (the model, not Python, dominates a step on a
2-core CPU).

    python benchmarks/make_batch_models.py OUT [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx_spec  # noqa: F401  (first: OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
from serve_batch import PROMPTS  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
EOS = 2  # <|im_end|>
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' and tools %}
{%- elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls %}{% set tool_call = tc.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CORPUS = PROMPTS + [
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a tiny model.",
    "def add(a, b):\n    return a + b\n",
]


def write_tokenizer(path: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    assert fast.convert_tokens_to_ids("<|im_end|>") == EOS
    return len(fast)


def build(config: dict, seed: int) -> dict[str, mx.array]:
    """Random float32 weights in mlx-lm's layout, outputs of every layer scaled down."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
    return {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}


def shape(weights: dict, residual: float, head_scale: float) -> dict:
    """Every layer's output scaled by `residual` (Gemma's post-norms, `1 + w`, set the scale
    of its layers' outputs: those are scaled instead), the head by `head_scale`."""
    outs = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
    heads = [k for k in weights if k.endswith("lm_head.weight")]
    heads = heads or [k for k in weights if k.endswith("embed_tokens.weight")]
    posts = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
    gemma = any(k.endswith("pre_feedforward_layernorm.weight") for k in weights)
    for k in list(weights):
        if gemma and k.endswith(posts):
            weights[k] = (1.0 + weights[k]) * residual - 1.0
        elif not gemma and k.endswith(outs):
            weights[k] = weights[k] * residual
    for k in heads:
        weights[k] = weights[k] * head_scale
        weights[k][EOS] = 0
    return weights


def save(path: Path, config: dict, weights: dict, tokenizer: Path) -> Path:
    import shutil

    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}, indent=2))
    for f in tokenizer.iterdir():
        shutil.copy(f, path / f.name)
    return path


def qwen35_hf(weights: dict) -> dict:
    """mlx-lm's qwen3_5 layout -> Qwen's checkpoint layout (what `sanitize` undoes)."""
    norms = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    out = {}
    for k, v in weights.items():
        if k.endswith(norms) and v.ndim == 1:
            v = v - 1.0
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # [C, K, 1] -> [C, 1, K]
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        elif k.startswith("language_model."):
            k = k[len("language_model.") :]
        out[k] = v
    return out


def hybrid(root: Path, tok: Path, vocab: int, a) -> tuple[Path, Path]:
    heads = a.hidden // 128
    config = {
        "model_type": "qwen3_5",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128,
        "linear_num_value_heads": heads,
        "linear_num_key_heads": max(1, heads // 2),
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": a.interval,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    }
    weights = shape(build(config, a.seed), a.residual, a.head_scale)
    # the draft: a dense qwen3 (no qwen3_5 with attention only: its ssm mask reads layer 0's
    # cache) with the target's embedding, final norm and head and one layer of its own
    dconfig = {k: v for k, v in config.items() if not k.startswith(("linear_", "full_"))}
    dconfig.update(model_type="qwen3", num_hidden_layers=1)
    draft = shape(build(dconfig, a.seed + 2), a.residual, 1.0)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        draft[k] = weights["language_model." + k]
    target = save(root / "hybrid" / "target", config, qwen35_hf(weights), tok)
    # the recurrent draft: the target's layer 0 (Gated-DeltaNet) and its first full-attention
    # layer, as a 2-layer qwen3_5 (full attention every 2nd layer): a quarter of the target
    prefix = "language_model.model.layers."
    picked = {0: 0, a.interval - 1: 1}  # target layer -> draft layer
    first = {}
    for k, v in weights.items():
        if not k.startswith(prefix):
            first[k] = v
            continue
        layer, rest = k[len(prefix) :].split(".", 1)
        if int(layer) in picked:
            first[f"{prefix}{picked[int(layer)]}.{rest}"] = v
    rconfig = {**config, "num_hidden_layers": 2, "full_attention_interval": 2}
    save(root / "hybrid" / "draft-recurrent", rconfig, qwen35_hf(first), tok)
    return target, save(root / "hybrid" / "draft", dconfig, draft, tok)


def sliding(root: Path, tok: Path, vocab: int, a) -> tuple[Path, Path]:
    heads = a.hidden // 128
    config = {
        "model_type": "gemma3_text",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.sliding_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128,
        "query_pre_attn_scalar": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "sliding_window": a.window,
        "sliding_window_pattern": a.pattern,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
    }
    weights = shape(build(config, a.seed + 1), a.residual, a.head_scale)
    draft = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < a.draft_layers
    }
    # (gemma3_text reads the cache of layer `sliding_window_pattern - 1`: at least that many)
    dconfig = {**config, "num_hidden_layers": a.draft_layers, "sliding_window_pattern": 2}
    target = save(root / "sliding" / "target", config, weights, tok)
    return target, save(root / "sliding" / "draft", dconfig, draft, tok)


def check(target: Path, draft: Path) -> None:
    """The pair loads as written; how often the draft agrees (one greedy reply)."""
    from mlx_spec import generate, load_pair

    pair = load_pair(target=str(target), draft=str(draft))
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    res = generate(pair, msgs, max_tokens=128, temperature=0.0, num_draft_tokens=4)
    s = res.stats
    print(f"{target.parent.name}: drafted {s.drafted}, acceptance {s.acceptance_rate:.2f}, "
          f"{s.tokens_per_target_pass:.2f} tokens/pass, {s.tokens_per_second:.1f} tok/s, "
          f"{s.generated_tokens} tokens: {res.text[:80]!r}")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--pairs", default="hybrid,sliding")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8, help="qwen3_5: the target's")
    p.add_argument("--interval", type=int, default=4, help="qwen3_5: full attention every N")
    p.add_argument("--window", type=int, default=64, help="gemma3_text: sliding window")
    p.add_argument("--pattern", type=int, default=6, help="gemma3_text: every Nth layer global")
    p.add_argument("--sliding-layers", type=int, default=12, help="gemma3_text: the target's")
    p.add_argument("--draft-layers", type=int, default=2, help="gemma3_text: the draft's")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--residual", type=float, default=0.01)
    p.add_argument("--head-scale", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="load each pair, print its acceptance")
    a = p.parse_args()
    tok = a.out / "tokenizer"
    vocab = write_tokenizer(tok, a.vocab)
    made = {}
    for name in a.pairs.split(","):
        made[name] = {"hybrid": hybrid, "sliding": sliding}[name](a.out, tok, vocab, a)
        print(f"{name}: --target {made[name][0]} --draft {made[name][1]}")
        if name == "hybrid":  # (its recurrent draft: the target's first layers)
            print(f"hybrid, recurrent draft: --draft {made[name][1].parent / 'draft-recurrent'}")
    if a.check:
        for target, draft in made.values():
            check(target, draft)


if __name__ == "__main__":
    main()
