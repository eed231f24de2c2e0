"""Tiny random models in the Hugging Face layout, built in code (no network).

A byte-level BPE tokenizer trained on a few sentences, and float32 llama models with a
few layers. Drafts are derived from a target so that they agree with it some of the time:
`truncated` keeps the target's first layers (a smaller model), `copy` agrees always,
`deranged` permutes the output head so it never proposes the target's choice.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Once upon a time there was a tiny model that predicted the next token.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(path: Path, vocab_size: int = 320) -> None:
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
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def llama_config(vocab_size: int, layers: int, hidden: int = 64, eos: int = 2) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "eos_token_id": eos,
    }


def random_weights(config: dict, seed: int, head_scale: float = 4.0) -> dict[str, mx.array]:
    """Random float32 weights; a scaled output head makes distributions peaked, not uniform."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights["lm_head.weight"] = weights["lm_head.weight"] * head_scale
    return {k: v.astype(mx.float32) for k, v in weights.items()}


def write_model(path: Path, config: dict, weights: dict[str, mx.array], tokenizer_from: Path):
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def write_head(path: Path, config: dict, weights: dict, drop: str | None = None) -> Path:
    """A drafting head's directory in its published layout: config.json and model.safetensors
    (`drop`: a weight left out, for the refusal tests)."""
    if drop:
        weights = dict(weights)
        weights.pop(drop)  # (a name that is not there: a KeyError, not a silent no-op)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def truncated(weights: dict, config: dict, layers: int) -> tuple[dict, dict]:
    """A smaller draft: the target's first `layers` blocks with its embedding and head."""
    keep = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    return keep, {**config, "num_hidden_layers": layers}


def deranged(weights: dict, vocab_size: int) -> dict:
    """Rotate the output head by one row: the draft's argmax is never the target's."""
    head = weights["lm_head.weight"]  # (vocab, hidden)
    perm = mx.array(np.roll(np.arange(vocab_size), 1))
    return {**weights, "lm_head.weight": head[perm]}


def mamba_config(vocab_size: int) -> dict:
    """A recurrent model: its cache (ArraysCache) cannot be trimmed, only snapshotted."""
    return {
        "model_type": "mamba",
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
        "tie_word_embeddings": True,
    }


def write_mamba(path: Path, vocab_size: int, tokenizer_from: Path) -> Path:
    from mlx_lm.models import mamba

    config = mamba_config(vocab_size)
    mx.random.seed(0)
    model = mamba.Model(mamba.ModelArgs.from_dict(config))
    return write_model(path, config, dict(tree_flatten(model.parameters())), tokenizer_from)


def write_swapped_tokenizer(path: Path, tokenizer_from: Path, a: int, b: int) -> None:
    """The same tokenizer with two token ids exchanged: same size, different map."""
    data = json.loads((tokenizer_from / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    (path / "tokenizer.json").write_text(json.dumps(data))


def noisy_pairs(root, configs: dict, tokenizer, noise: dict | None = None) -> dict:
    """{name: (target, draft)} model directories: each config's target (seed 0) and a noisy
    copy of it as the draft (relative noise `noise.get(name, 0.05)`)."""
    out = {}
    for name, cfg in configs.items():
        weights = family_weights(cfg, seed=0)
        target = write_model(root / name, cfg, weights, tokenizer)
        draft_weights = noisy(weights, (noise or {}).get(name, 0.05))
        out[name] = (target, write_model(root / f"{name}-draft", cfg, draft_weights, tokenizer))
    return out


def noisy(weights: dict, scale: float, seed: int = 7) -> dict:
    """The target plus relative Gaussian noise: a draft that agrees often, not always."""
    out = {}
    for i, (name, w) in enumerate(sorted(weights.items())):
        noise = mx.random.normal(w.shape, key=mx.random.key(seed + i))
        out[name] = w + scale * mx.sqrt(mx.mean(w * w)) * noise
    return out


# ----------------------------------------------------------------- the architecture matrix
# One tiny config per model family a pair can use (models.toml's model types, a hybrid
# recurrent model, sliding-window models with an 8-token window), built through mlx-lm's own
# classes. Windows and recurrent states are what the engine's roll-back must handle.
WINDOW = 8


def family_configs(vocab_size: int) -> dict[str, dict]:
    attn = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
        "tie_word_embeddings": False,  # tied, a tiny random model echoes its input token
    }
    gemma_text = {
        **attn,
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,  # layers 0 and 2 slide, 1 and 3 see everything
    }
    return {
        "llama": {**attn, "model_type": "llama", "num_hidden_layers": 3, "rope_theta": 1e4},
        "qwen2": {**attn, "model_type": "qwen2", "num_hidden_layers": 3, "rope_theta": 1e4},
        "qwen3": {
            **attn,
            "model_type": "qwen3",
            "num_hidden_layers": 3,
            "head_dim": 16,
            "rope_theta": 1e4,
        },
        "gemma3_text": gemma_text,
        # Gemma 3 12B's checkpoints are multimodal: a text model inside `text_config`
        "gemma3": {
            "model_type": "gemma3",
            "vocab_size": vocab_size,
            "eos_token_id": 2,
            "text_config": {k: v for k, v in gemma_text.items() if k != "eos_token_id"},
        },
        # Mistral-style: a llama whose layers alternate sliding and full attention
        "llama_sliding": {
            **attn,
            "model_type": "llama",
            "num_hidden_layers": 3,
            "rope_theta": 1e4,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        # Qwen3.5: Gated-DeltaNet layers (recurrent state) and a full-attention layer
        "qwen3_5": {
            **attn,
            "model_type": "qwen3_5",
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "head_dim": 32,
            "full_attention_interval": 2,
        },
    }


def cachelist_configs(vocab_size: int) -> dict[str, dict]:
    """Families whose layer cache is an mlx-lm `CacheList` (several caches a layer), with
    the fields their checkpoints ship: falcon_h1 (a Mamba-2 state beside attention),
    DeepSeek-V3.2 (MLA attention beside its sparse indexer's own keys; MoE, a dense first
    layer), baichuan_m1 (a convolution state beside attention, a sliding-window layer) and
    longcat_flash (two MLA attentions a layer, zero experts)."""
    common = {"vocab_size": vocab_size, "eos_token_id": 2, "max_position_embeddings": 512}
    mla = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "qk_nope_head_dim": 16, "num_attention_heads": 4}  # fmt: skip
    return {
        "falcon_h1": {
            **common,
            "model_type": "falcon_h1",
            "hidden_size": 64,
            "head_dim": 16,
            "intermediate_size": 128,
            "mamba_d_conv": 4,
            "mamba_d_head": 16,
            "mamba_d_ssm": 64,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "mamba_n_groups": 1,
            "mamba_n_heads": 4,
            "mamba_chunk_size": 16,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rope_theta": 1e4,
            "tie_word_embeddings": False,
        },
        "deepseek_v32": {
            **common,
            **mla,
            "model_type": "deepseek_v32",
            "hidden_size": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
            "index_topk": 8,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
        },
        "baichuan_m1": {
            **common,
            "model_type": "baichuan_m1",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1e4,
            "sliding_window": 16,
            "sliding_window_layers": [0],
            "conv_window": 2,
            "rms_norm_eps": 1e-5,
        },
        "longcat_flash": {
            **common,
            **mla,
            "model_type": "longcat_flash",
            "attention_method": "MLA",
            "zero_expert_type": "identity",
            "hidden_size": 64,
            "ffn_hidden_size": 128,
            "moe_topk": 2,
            "expert_ffn_hidden_size": 32,
            "n_routed_experts": 4,
            "zero_expert_num": 2,
            "num_layers": 2,
            "routed_scaling_factor": 1.0,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e4,
            "mla_scale_q_lora": True,
            "mla_scale_kv_lora": True,
            "attention_bias": False,
        },
    }


def gpt_bigcode_config(vocab_size: int) -> dict:
    """StarCoder's architecture: learned absolute positions, multi-query attention."""
    return {
        "model_type": "gpt_bigcode", "n_embd": 64, "n_layer": 2, "n_inner": 128, "n_head": 4,
        "n_positions": 512, "layer_norm_epsilon": 1e-5, "vocab_size": vocab_size,
        "tie_word_embeddings": False, "eos_token_id": 2,
    }  # fmt: skip


def family_weights(
    config: dict, seed: int, head_scale: float = 4.0, mute: int | None = 2
) -> dict[str, mx.array]:
    """Random float32 weights for any mlx-lm model type; the output head (or the tied
    embedding) scaled so distributions are peaked, not uniform, and its row `mute` (the
    tokenizer's end of sequence) zeroed so replies run long."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    heads = [k for k in weights if k.endswith("lm_head.weight")]
    heads = heads or [k for k in weights if k.endswith("embed_tokens.weight")]
    for k in heads:
        weights[k] = weights[k] * head_scale
        if mute is not None:
            weights[k][mute] = 0
    return weights


def compressed_config(vocab_size: int) -> dict:
    """mlx-lm's `deepseek_v41` (compressed attention beside a sliding window): its layer cache
    (`LayerCache`: the window, closed compressed groups and their index keys, the open group's
    rows) has no trim; it goes back by a snapshot and a replay (core/caches.py). Layers 1-3
    compress groups of 4 (1 and 3 make their own, with index keys; 2 reads layer 1's), layer 0
    has the window only; prompts and replies cross both the window of 8 and several groups."""
    return {
        "model_type": "deepseek_v41", "vocab_size": vocab_size, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16, "moe_intermediate_size": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-5, "sliding_window": 8, "rope_theta": 1e4,
        "compress_ratios": [0, 4, 4, 4], "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3], "compress_rope_theta": 1e4, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": 3, "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 2, "candidate_block_size": 2, "hc_mult": 2,
        "max_position_embeddings": 512, "eos_token_id": 2,
    }  # fmt: skip


def llama4_config(vocab_size: int) -> dict:
    """Llama 4: chunked attention (ChunkedKVCache), which rolls back within a chunk
    (caches.MarginChunkedKVCache); a batch refuses it (its code takes one offset)."""
    return {
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": 16,
            "head_dim": 16,
            "hidden_size": 64,
            "interleave_moe_layer_step": 1,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "max_position_embeddings": 512,
            "num_attention_heads": 4,
            "num_experts_per_tok": 1,
            "num_hidden_layers": 4,  # every 4th layer is global
            "num_key_value_heads": 2,
            "num_local_experts": 2,
            "rms_norm_eps": 1e-5,
            "rope_scaling": None,
            "rope_theta": 1e4,
            "use_qk_norm": True,
            "vocab_size": vocab_size,
        },
    }


def write_adapter(path: Path, draft_path: Path, seed: int = 0, size: float = 0.1) -> Path:
    """A LoRA adapter in mlx-lm's layout with random (non-zero) weights: a draft that
    proposes differently from its base, without training."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(draft_path)
    model.freeze()
    params = {"rank": 4, "scale": 1.0, "dropout": 0.0}
    linear_to_lora_layers(model, -1, params)
    leaves = tree_flatten(model.trainable_parameters())
    weights = {
        k: size * mx.random.normal(v.shape, key=mx.random.key(seed + i))
        for i, (k, v) in enumerate(leaves)
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": params}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


# ----------------------------------------------------------------- a model that calls a tool
# A "bigram" llama: its layers add nothing (zero output projections), so the next token depends
# on the current one alone, and the head maps each token of a fixed chain to its successor with
# a margin of ~30 nats: the same reply at any temperature. The chat template is Qwen 2.5's shape
# (tools in the system turn, <tool_call> JSON, <tool_response>), so mlx-lm infers its
# `json_tools` parser; `<think>`/`</think>` in the vocabulary make it a thinking model to mlx-lm.
TOOL_CALL_PIECES = ['{"name":"', "get_weather", '","arguments":{"city":"', "Paris", '"}}']
THOUGHT = "The user wants the weather in Paris."
ANSWER = "It is sunny in Paris today."
TOOL_SPECIALS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|answer|>"]
# Qwen 2.5's system turn with the tools (both tool templates below open with it)
TOOLS_SYSTEM = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>
{% endif %}
"""
TOOL_TEMPLATE = (
    TOOLS_SYSTEM
    + """{%- for m in messages %}
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
{%- if messages[-1]['role'] == 'tool' %}<|answer|>{% else %}{{ '\n' }}{% endif %}{% endif %}"""
)


def write_tool_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TOOL_SPECIALS])
    pieces = [*TOOL_CALL_PIECES, THOUGHT, ANSWER]
    tok.add_tokens([AddedToken(t, normalized=False) for t in pieces])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = TOOL_TEMPLATE
    fast.save_pretrained(str(path))


def tool_chain(tokenizer) -> dict[int, int]:
    """Successor of each token in the fixed replies (token id -> token id)."""
    ids = tokenizer.convert_tokens_to_ids
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    call = [ids("<tool_call>"), *ids(TOOL_CALL_PIECES), ids("</tool_call>"), ids("<|im_end|>")]
    thought = [ids("<think>"), ids(THOUGHT), ids("</think>")]
    chain = [newline[0], *thought, *call]
    successors = dict(zip(chain, chain[1:], strict=False))
    successors[ids("<|answer|>")] = ids(ANSWER)
    successors[ids(ANSWER)] = ids("<|im_end|>")
    return successors


def write_tool_model(root: Path, draft_errors: int = 0) -> tuple[Path, Path]:
    """The tool-calling target and a draft of the same shape whose chain is wrong at
    `draft_errors` places (rejections inside the tool call)."""
    from transformers import AutoTokenizer

    tok_dir = root / "tool_tokenizer"
    write_tool_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    vocab = len(tokenizer)
    cfg = llama_config(vocab, layers=1)
    weights = random_weights(cfg, seed=11)
    hidden = cfg["hidden_size"]
    emb = mx.random.normal((vocab, hidden), key=mx.random.key(12))
    unit = emb / mx.linalg.norm(emb, axis=-1, keepdims=True)
    weights["model.embed_tokens.weight"] = emb
    weights["model.norm.weight"] = mx.ones((hidden,))
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])

    def head(successors: dict[int, int]) -> mx.array:
        w = np.array(0.01 * mx.random.normal((vocab, hidden), key=mx.random.key(13)))
        u = np.array(unit)
        for t, nxt in successors.items():
            w[nxt] += 4.0 * u[t]
        return mx.array(w)

    chain = tool_chain(tokenizer)
    target = write_model(
        root / "tool_target", cfg, {**weights, "lm_head.weight": head(chain)}, tok_dir
    )
    wrong = dict(chain)
    # a few successors inside the call point elsewhere: the draft is rejected there
    for piece in ["get_weather", "Paris", THOUGHT][:draft_errors]:
        t = tokenizer.convert_tokens_to_ids(piece)
        wrong[t] = (wrong[t] + 7) % vocab
    draft = write_model(
        root / "tool_draft", cfg, {**weights, "lm_head.weight": head(wrong)}, tok_dir
    )
    return target, draft


def write_babbling_tool_models(root: Path) -> tuple[Path, Path]:
    """A random target with the tool-calling tokenizer and template (json_tools) and a noisy
    copy as its draft: left alone, the arguments it writes are not JSON."""
    from transformers import AutoTokenizer

    tok_dir = root / "tool_tokenizer"
    write_tool_tokenizer(tok_dir)
    cfg = llama_config(len(AutoTokenizer.from_pretrained(str(tok_dir))), layers=2)
    cfg["max_position_embeddings"] = 2048  # the tools' schemas, in bytes, are the prompt
    weights = random_weights(cfg, seed=21)
    target = write_model(root / "babbler", cfg, weights, tok_dir)
    draft = write_model(root / "babbler_draft", cfg, noisy(weights, 0.05), tok_dir)
    return target, draft


# ------------------------------------------------------------------------- Gemma 4 targets
# What the published Gemma 4 checkpoints ship (31B, 26B-A4B, E2B), in miniature: sliding and
# full layers with an 8-token window, the last layers sharing earlier layers' keys and values
# (num_kv_shared_layers), a wider head for full attention (global_head_dim) whose keys are
# its values (attention_k_eq_v, num_global_key_value_heads), proportional partial rotary
# embeddings for full attention, a soft-capped output, tied embeddings.
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma4_text_config(vocab_size: int, moe: bool = False, hidden: int = 64) -> dict:
    cfg = {
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": len(GEMMA4_TYPES),
        "num_attention_heads": 4,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 2,  # layers 4 and 5 read layers 3's and 2's keys and values
        "hidden_size_per_layer_input": 0,
        "layer_types": GEMMA4_TYPES,
        "sliding_window": WINDOW,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "use_double_wide_mlp": True,
        "tie_word_embeddings": True,
    }
    if moe:  # 26B-A4B: a dense MLP and routed experts beside it in every layer
        cfg |= {
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
        }
    return cfg


def gemma4_config(vocab_size: int, moe: bool = False, hidden: int = 64) -> dict:
    """A multimodal Gemma 4 checkpoint's config.json (as mlx-community's): the text model
    under text_config."""
    return {
        "model_type": "gemma4",
        "vocab_size": vocab_size,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "text_config": gemma4_text_config(vocab_size, moe, hidden),
    }


def gemma4_weights(config: dict, seed: int, scale: float = 2.0) -> dict[str, mx.array]:
    """Random float32 weights in the HF layout (`model.language_model.*`); the norms after
    attention and MLP scaled up so the layers, not the (tied) input embedding, decide the
    next token (a tiny tied model otherwise echoes its input), the end-of-sequence row muted."""
    weights = family_weights(config, seed, head_scale=1.0)
    out = {}
    for k, v in weights.items():
        if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            v = v * scale
        out[k.replace("language_model.model.", "model.language_model.", 1)] = v
    return out


def write_gemma4(path: Path, tokenizer_from: Path, vocab_size: int = 320, moe: bool = False,
                 seed: int = 0, hidden: int = 64, scale: float = 2.0) -> Path:  # fmt: skip
    cfg = gemma4_config(vocab_size, moe, hidden)
    return write_model(path, cfg, gemma4_weights(cfg, seed, scale), tokenizer_from)


def family_pairs(root: Path, tokenizer: Path, vocab: int, families, noise=0.02) -> dict:
    """{family: (target dir, draft dir)}: each family's tiny target (family_configs) and a
    noisy copy as its draft (agrees often: mixed rounds)."""
    out = {}
    for family in families:
        cfg = family_configs(vocab)[family]
        weights = family_weights(cfg, seed=0)
        target = write_model(root / family, cfg, weights, tokenizer)
        draft = write_model(root / f"{family}-draft", cfg, noisy(weights, noise), tokenizer)
        out[family] = (target, draft)
    return out


# ------------------------------------------------------ a scripted agent model (any tool call)
# The bigram mechanism above, generalised for real coding-agent clients (benchmarks/
# real_agents.py): each reply is a chain of tokens, and the chat template picks which chain by
# the token it ends the prompt with (what the model conditions on). After the last assistant
# turn: a tool result -> `<|answer|>` (the answer, quoting the file); a user text holding
# `trigger`, tools offered -> `<|read|>` (think, maybe say `preamble`, call the tool); holding
# `recall` once a tool result is anywhere in the history (a resumed session resent it) ->
# `<|answer|>`; else `<|plain|>`.
SCRIPT_MODES = ["<|read|>", "<|answer|>", "<|plain|>"]
SCRIPT_TEMPLATE = (
    TOOLS_SYSTEM
    + """{%- set ns = namespace(user='', fresh=false, ever=false) %}
{%- for m in messages %}
{%- if m['role'] == 'system' and tools %}
{%- elif m['role'] == 'assistant' %}{% set ns.user = '' %}{% set ns.fresh = false %}\
<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls or [] %}{% set tool_call = tc.function %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m['role'] == 'tool' %}{% set ns.fresh = true %}{% set ns.ever = true %}\
<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% else %}{% if m['role'] == 'user' %}{% set ns.user = ns.user + m['content'] %}{% endif %}\
<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if ns.fresh %}<|answer|>{% elif tools and TRIGGER in ns.user %}<|read|>\
{% elif RECALL in ns.user and ns.ever %}<|answer|>{% else %}<|plain|>{% endif %}{% endif %}"""
)


def write_scripted_tool_model(
    root: Path,
    call: dict,
    answer: str,
    trigger: str,
    plain: str = "Hello from the scripted model.",
    thought: str = "I should read the file.",
    recall: str = "again",
    preamble: str | None = None,
    corpus: list[str] | None = None,
    vocab_size: int = 320,
    context: int = 4096,
) -> Path:
    """A one-layer model whose greedy reply is scripted (the comment above): `call` is the tool
    call it writes, `{"name": ..., "arguments": {...}}`; `answer` what it says once the tool's
    result is back; `plain` its reply to anything else; `preamble`, text it writes between its
    thinking and the call. `corpus` (and `vocab_size`) train its
    byte-level BPE: a bigger one makes a client's long prompt fewer tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    call_text = json.dumps(call, ensure_ascii=False)
    template = SCRIPT_TEMPLATE.replace("TRIGGER", json.dumps(trigger)).replace(
        "RECALL", json.dumps(recall)
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or CORPUS, trainer=trainer)
    specials = [*TOOL_SPECIALS, *SCRIPT_MODES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    pieces = [call_text, thought, answer, plain, *([preamble] if preamble else [])]
    tok.add_tokens([AddedToken(t, normalized=False) for t in pieces])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    tok_dir = root / "scripted_tokenizer"
    fast.save_pretrained(str(tok_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tokenizer.convert_tokens_to_ids
    end = ids("<|im_end|>")
    chains = [
        ["<|read|>", "<think>", thought, "</think>", *([preamble] if preamble else [])]
        + ["<tool_call>", call_text, "</tool_call>"],
        ["<|answer|>", answer],
        ["<|plain|>", plain],
    ]
    successors: dict[int, int] = {}
    for chain in chains:
        seq = [*ids(chain), end]
        assert len(set(seq)) == len(seq) and all(t != tokenizer.unk_token_id for t in seq)
        for a, b in zip(seq, seq[1:], strict=False):
            assert successors.get(a, b) == b, f"{a} has two successors"
            successors[a] = b
    vocab = len(tokenizer)
    cfg = llama_config(vocab, layers=1)
    cfg["max_position_embeddings"] = context
    weights = random_weights(cfg, seed=11)
    hidden = cfg["hidden_size"]
    emb = mx.random.normal((vocab, hidden), key=mx.random.key(12))
    unit = np.array(emb / mx.linalg.norm(emb, axis=-1, keepdims=True))
    weights["model.embed_tokens.weight"] = emb
    weights["model.norm.weight"] = mx.ones((hidden,))
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    w = np.array(0.01 * mx.random.normal((vocab, hidden), key=mx.random.key(13)))
    for t, nxt in successors.items():
        w[nxt] += 4.0 * unit[t]
    weights["lm_head.weight"] = mx.array(w)
    return write_model(root / "scripted", cfg, weights, tok_dir)
