"""Every architecture of the installed mlx-lm, tiny and random, decoded by mlx-spec against
mlx-lm's own greedy decoding (issue 58).

For each module of `mlx_lm.models` that defines `ModelArgs` and `Model`, a small config is
derived from its `ModelArgs` (every size-like field shrunk: hidden 64, 2 layers, 4 heads,
4 experts...; required fields filled from their names and types), or hand-written where
derivation cannot work (`HAND`, each with its reason). The model is built through mlx-lm's own
classes with random float32 weights (the output head scaled so distributions are peaked, its
end-of-sequence row zeroed so replies run long), written in the Hugging Face layout with a
byte-level BPE tokenizer (tests/tiny.py), beside a draft: the same weights plus 5 % noise.

Then, against mlx-lm's `stream_generate` on the target alone at temperature 0:
- `draft`: one stream with the draft model, k = 4;
- `ngram`: one stream with prompt lookup;
- `batch`: `mlx_spec.batch_generate` over two prompts of different lengths with the draft.

One line per architecture: ok, `differs at token i`, `crash: <exception>`, `refused: <the
one-line reason>`, or `mlx-lm cannot: <why>` where mlx-lm itself cannot build or run the
tiny model. Random weights make near-ties: where a difference falls on an exact tie of the
reference's two best logits (softcapped logits saturate), the architecture is rebuilt with
the next seed (up to `--seeds`) and the line says so.

    python benchmarks/arch_sweep.py [ARCH ...] [--tokens N] [--markdown] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import mlx_spec  # noqa: F401  (first: OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx
import mlx_lm.models
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import real_configs  # noqa: E402
import tiny  # noqa: E402

from mlx_spec import SpecError, batch_generate, generate, load_pair  # noqa: E402

VOCAB = 320
WINDOW = 8  # sliding windows and chunks shrunk like the rest; prompts and replies cross them
PROMPTS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef add(",
]

# field name -> the small value every architecture gets (whatever its default)
SIZES = {
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "model_dim"], 64),
    # 4 layers: room for a layer of each kind where kinds alternate (patterns of 2 below)
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers"], 4),
    **dict.fromkeys(["intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"], 128),
    **dict.fromkeys(["num_attention_heads", "n_head", "n_heads", "num_heads"], 4),
    **dict.fromkeys(["num_key_value_heads", "n_kv_heads", "num_kv_heads"], 2),
    "head_dim": 16,
    "vocab_size": VOCAB,
    **dict.fromkeys(
        ["max_position_embeddings", "n_positions", "n_ctx", "block_size", "model_max_length"],
        512,
    ),
    **dict.fromkeys(
        ["rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "layernorm_epsilon"],
        1e-5,
    ),
    "rope_theta": 10000.0,
    **dict.fromkeys(
        ["moe_intermediate_size", "expert_ffn_hidden_size", "shared_intermediate_size"], 32
    ),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk"], 2),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "num_shared_expert"], 1),
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    **dict.fromkeys(["sliding_window", "sliding_window_size", "attention_chunk_size"], WINDOW),
    "tie_word_embeddings": False,  # tied, a tiny random model echoes its input token
    # recurrent layers (Mamba, Mamba-2, convolutions): a kernel of 1 keeps the whole input
    "state_size": 8,
    "conv_kernel": 4,
    "time_step_rank": 4,
    # linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next, Kimi Linear)
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    # rotary and head sizes under other names
    "rotary_dim": 8,
    "kv_channels": 16,
    "moe_top_k": 2,
    # a layer of each kind within 4 layers
    **dict.fromkeys(["full_attention_interval", "sliding_window_pattern"], 2),
}
MAX_PARAMETERS = 4_000_000  # a derived config past this kept a real size somewhere


def _filler(f: dataclasses.Field):
    """A value for a required field the size table does not know, from its declared type."""
    t = str(f.type).lower()
    if "bool" in t:
        return False
    if "float" in t:
        return 1.0
    if "int" in t and "list" not in t:
        return 1
    if "list" in t:
        return []
    if "dict" in t:
        return {}
    return None


LAYERS4 = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

# Changes to the derived config, each with why derivation cannot do; `WHOLE` entries replace
# it with a config the test suite already uses.
# ministral3's and mistral4's rope: Llama 4's attention-scaling beta on a default rope
LLAMA4_SCALED_ROPE = {
    "rope_theta": 1e4,
    "rope_type": "default",
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 512,
}

HAND: dict[str, tuple[str, dict]] = {
    "afmoe": ("a layer-type list", {"layer_types": LAYERS4, "sliding_window": WINDOW}),
    "dbrx": (
        "nested ffn / attention configs",
        {
            "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000},
        },
    ),  # fmt: skip
    "deepseek_v2": (
        "a YaRN rope block (its default is None)",
        {"rope_scaling": dict(real_configs.DEEPSEEK_V3_YARN)},
    ),  # fmt: skip
    "exaone_moe": (
        "layer-type and MoE-layer lists",
        {"layer_types": LAYERS4, "is_moe_layer": [False, True, True, True]},
    ),
    "gear": ("a layer-type list", {"layer_types": ["full_attention"] * 4}),
    "hunyuan": (
        "a dynamic rope block, cross-layer attention",
        {
            "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
            "use_mixed_mlp_moe": True,
            "use_cla": True,
            "cla_share_factor": 2,
        },
    ),  # fmt: skip
    "jamba": (
        "layer periods and Mamba sizes",
        {
            "attn_layer_offset": 1,
            "attn_layer_period": 2,
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "mamba_d_conv": 4,
            "mamba_d_state": 8,
            "mamba_expand": 2,
            "tie_word_embeddings": False,
        },
    ),  # fmt: skip
    "lfm2": (
        "which layers attend, the conv block's sizes",
        {
            "full_attn_idxs": [1, 3],
            "block_dim": 64,
            "block_ff_dim": 128,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "conv_bias": True,
            "conv_L_cache": 3,
        },
    ),  # fmt: skip
    "lfm2_moe": (
        "which layers attend, dense layers first",
        {
            "full_attn_idxs": [1, 3],
            "num_dense_layers": 1,
            "conv_bias": True,
            "conv_L_cache": 3,
            "norm_topk_prob": True,
            "use_expert_bias": True,
        },
    ),  # fmt: skip
    "llama4_text": (
        "which layers use RoPE",
        {"no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True, "intermediate_size_mlp": 128},
    ),
    "mellum": (
        "a layer-type list and rope parameters",
        {
            "layer_types": LAYERS4,
            "rope_parameters": dict.fromkeys(
                ["sliding_attention", "full_attention"], {"rope_theta": 1e4, "rope_type": "default"}
            ),
        },
    ),
    "ministral3": (
        "rope parameters with Llama 4's scaling beta",
        {"rope_parameters": dict(LLAMA4_SCALED_ROPE)},
    ),  # fmt: skip
    "mistral4": (
        "rope parameters with Llama 4's scaling beta",
        {"rope_parameters": dict(LLAMA4_SCALED_ROPE)},
    ),  # fmt: skip
    "kimi_linear": (
        "which layers are linear (KDA)",
        {
            "linear_attn_config": {
                "kda_layers": [1, 3],
                "head_dim": 16,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
            }
        },
    ),  # fmt: skip
    "longcat_flash_ngram": (
        "MLA scales",
        {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"},
    ),
    "plamo": ("heads a key/value head serves", {"n_shared_head": 2}),
    "mimo_v2_flash": (
        "per-layer sliding and MoE lists, the sliding layers' own sizes",
        {
            "hybrid_layer_pattern": [0, 1, 0, 1],
            "moe_layer_freq": [0, 1, 1, 1],
            "sliding_window_size": WINDOW,
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2,
            "swa_head_dim": 16,
            "swa_v_head_dim": 16,
            "swa_rope_theta": 1e4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.5,
            "layernorm_epsilon": 1e-5,
        },
    ),  # fmt: skip
    "nemotron-nas": (
        "one block config a layer (attention grouping, FFN width; one attention skipped)",
        {
            "block_configs": [
                {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
                {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
                {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 2.0}},
                {"attention": {"n_heads_in_group": 2}, "ffn": {"no_op": True}},
            ],
            "hidden_act": "silu",
        },
    ),  # fmt: skip
    "glm_moe_dsa": (
        "rope parameters, its router's method",
        {
            "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
            "index_topk": 8,
            "topk_method": "noaux_tc",
            "index_head_dim": 16,
            "index_n_heads": 2,
            "scoring_func": "sigmoid",
            "moe_layer_freq": 1,
            "norm_topk_prob": True,
        },
    ),  # fmt: skip
    "nemotron_h": (
        "a layer pattern (M: Mamba-2, *: attention, -: MLP), Mamba-2 sizes",
        {
            "hybrid_override_pattern": "M*-M",
            "num_hidden_layers": 4,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "conv_kernel": 4,
            "n_groups": 1,
            "head_dim": 16,
            "use_conv_bias": True,
        },
    ),  # fmt: skip
    "openelm": (
        "per-layer head counts and FFN multipliers",
        {
            "num_transformer_layers": 4,
            "num_query_heads": [4] * 4,
            "num_kv_heads": [2] * 4,
            "ffn_multipliers": [2.0] * 4,
            "ffn_dim_divisor": 16,
            "share_input_output_layers": False,
        },
    ),  # fmt: skip
    "phixtral": (
        "its own size names",
        {"num_vocab": VOCAB, "model_dim": 64, "num_heads": 4, "num_layers": 4, "rotary_dim": 8},
    ),
    "plamo2": (
        "its own size names, Mamba sizes",
        {
            "hidden_size_per_head": 16,
            "attention_window_size": WINDOW,
            "mamba_d_state": 8,
            "mamba_num_heads": 4,
            "mamba_chunk_size": 16,
            "full_attention_idx": [1, 3],
        },
    ),  # fmt: skip
    "spark2_5": (
        "a layer-type list and rope parameters per type",
        {
            "layer_types": LAYERS4,
            "tie_word_embeddings": False,
            "rope_parameters": dict.fromkeys(
                ["sliding_attention", "full_attention"], {"rope_theta": 1e4, "rope_type": "default"}
            ),
        },
    ),  # fmt: skip
    "granitemoehybrid": (
        "layer types and Mamba-2 sizes",
        {
            "layer_types": ["mamba", "attention", "mamba", "attention"],
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_proj_bias": False,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
            "tie_word_embeddings": False,
            "embedding_multiplier": 1.0,
            "attention_multiplier": 0.25,
            "logits_scaling": 1.0,
            "residual_multiplier": 1.0,
            "shared_intermediate_size": 128,
        },
    ),  # fmt: skip
    "mamba2": (
        "Mamba-2 sizes and a time-step limit",
        {
            "num_heads": 8,
            "head_dim": 16,
            "state_size": 8,
            "n_groups": 1,
            "time_step_limit": [0.0, 1e9],
            "use_conv_bias": True,
            "intermediate_size": 128,
        },
    ),  # fmt: skip
    "nemotron": ("an activation name", {"hidden_act": "relu2", "partial_rotary_factor": 0.5}),
    "exaone4": (
        "a rope block and a window pattern",
        {"rope_scaling": None, "sliding_window_pattern": "LLGL"},
    ),
    "minicpm3": ("its default rope block is None", {"rope_scaling": {"type": "default"}}),
    "recurrent_gemma": (
        "a block-type list, a window",
        {
            "block_types": ["recurrent", "recurrent", "attention"],
            "conv1d_width": 3,
            "logits_soft_cap": 30.0,
            "attention_window_size": WINDOW,
        },
    ),  # fmt: skip
}
WHOLE: dict[str, tuple[str, object]] = {
    # (reason, a function of the vocabulary size giving the config: the test suite's own)
    "baichuan_m1": (
        "a window-layer list: tests/tiny.py's",
        lambda v: tiny.cachelist_configs(v)["baichuan_m1"],
    ),
    "longcat_flash": (
        "MLA scales: tests/tiny.py's",
        lambda v: tiny.cachelist_configs(v)["longcat_flash"],
    ),
    "gemma3": ("a multimodal wrapper: tests/tiny.py's", lambda v: tiny.family_configs(v)["gemma3"]),
    "qwen3_5": (
        "rope parameters, linear attention: tests/tiny.py's",
        lambda v: tiny.family_configs(v)["qwen3_5"],
    ),
    # (its own defaults compress nothing: only the window would be swept)
    "deepseek_v41": (
        "compression ratios and source layers: tests/tiny.py's",
        lambda v: tiny.compressed_config(v),
    ),
    "gemma4": ("per-layer-type settings: tests/tiny.py's", lambda v: tiny.gemma4_config(v)),
    "gemma4_text": (
        "per-layer-type settings: tests/tiny.py's",
        lambda v: tiny.gemma4_text_config(v),
    ),
    "llama4": (
        "a text config: tests/real_configs.py's Scout",
        lambda v: __import__("real_configs").llama4_configs(v)["llama4-scout"],
    ),
}
WHOLE["gemma3n"] = (
    "a text config of lists and AltUp / LAuReL sizes (Gemma 3n E2B's, shrunk)",
    lambda v: {
        "model_type": "gemma3n",
        "text_config": {
            "model_type": "gemma3n_text", "hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": [128] * 4, "num_attention_heads": 4, "head_dim": 16,
            "rms_norm_eps": 1e-6, "vocab_size": v, "num_key_value_heads": 2,
            "num_kv_shared_layers": 2, "vocab_size_per_layer_input": v,
            "sliding_window": WINDOW, "max_position_embeddings": 512,
            "rope_local_base_freq": 1e4, "rope_theta": 1e6, "final_logit_softcapping": 30.0,
            "layer_types": LAYERS4, "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
            "hidden_size_per_layer_input": 16, "altup_num_inputs": 4, "altup_coef_clip": 120.0,
            "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8,
        },
    },
)  # fmt: skip
WHOLE["mistral3"] = (
    "a wrapper of three text models: llama's",
    lambda v: {"model_type": "mistral3", "text_config": derive("llama")},
)
WHOLE["qwen3_5_moe"] = (
    "tests/tiny.py's qwen3_5 with experts",
    lambda v: {
        **tiny.family_configs(v)["qwen3_5"],
        "model_type": "qwen3_5_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
)
# mlx-lm's model cannot be built tiny, with why
NOT_TINY = {
    "phi3small": "writes -inf into logits 100256..100351 in place: needs a vocabulary of 100352",
}


def _shrunk(args_class) -> dict:
    config = {}
    for f in dataclasses.fields(args_class):
        if f.name in SIZES:
            config[f.name] = SIZES[f.name]
        elif f.name in ("model_type", "text_config"):
            continue
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            config[f.name] = _filler(f)
    return config


def _text_args(mod):
    """The dataclass of a multimodal checkpoint's `text_config` (its own, or its text
    module's ModelArgs)."""
    for v in vars(mod).values():
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v is not mod.ModelArgs:
            if "text" in v.__name__.lower():
                return v
    for k, v in vars(mod).items():
        if isinstance(v, type(mod)) and "text" in k.lower() and hasattr(v, "ModelArgs"):
            return v.ModelArgs
    return None


def _inner_module(mod) -> str | None:
    """A vision-language wrapper's text model: the one mlx-lm model module it imports."""
    inner = [
        v.__name__.rsplit(".", 1)[1]
        for v in vars(mod).values()
        if isinstance(v, type(mod))
        and v.__name__.startswith("mlx_lm.models.")
        and hasattr(v, "ModelArgs")
        and hasattr(v, "Model")
    ]
    return inner[0] if len(inner) == 1 else None


def derive(name: str) -> dict:
    """The tiny config of architecture `name` (module mlx_lm.models.<name>)."""
    if name in WHOLE:
        return {"eos_token_id": 2, **WHOLE[name][1](VOCAB)}
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    config = {"model_type": name, "eos_token_id": 2, **_shrunk(mod.ModelArgs)}
    if "text_config" in {f.name for f in dataclasses.fields(mod.ModelArgs)}:
        text, inner = _text_args(mod), _inner_module(mod)
        if text is not None:
            config["text_config"] = _shrunk(text)
            if any(f.name == "model_type" for f in dataclasses.fields(text)):
                config["text_config"]["model_type"] = f"{name}_text"
        elif inner is not None:
            config["text_config"] = {k: v for k, v in derive(inner).items() if k != "eos_token_id"}
        else:
            config["text_config"] = {}
    if name in HAND:
        config.update(HAND[name][1])
    return config


def architectures() -> list[str]:
    out = []
    for m in sorted(pkgutil.iter_modules(mlx_lm.models.__path__), key=lambda m: m.name):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{m.name}")
        except (Exception, SystemExit):  # (olmo exits when ai2-olmo is missing)
            out.append(m.name)
            continue
        if hasattr(mod, "ModelArgs") and hasattr(mod, "Model"):
            out.append(m.name)
    return out


class MlxLmCannot(Exception):
    """mlx-lm itself cannot build or run the tiny model."""


class NoConfig(Exception):
    """The derived config does not build (a hand-written one is still to write)."""


def reference(pair, prompt: list[int], max_tokens: int):
    """mlx-lm's greedy tokens on the target alone, and whether each step's two best
    log-probabilities were an exact tie."""
    tokens, ties = [], []
    for r in stream_generate(
        pair.target, pair.tokenizer, prompt, max_tokens, sampler=make_sampler(0.0)
    ):
        if r.token in pair.tokenizer.eos_token_ids:
            break
        tokens.append(r.token)
        top = mx.sort(r.logprobs.astype(mx.float32))[-2:].tolist()
        ties.append(top[0] == top[1])
    return tokens, ties


def cacheless(pair, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the target's full forward over the whole sequence each step, no
    cache: what a cached decoding must equal (checks mlx-lm's own cache handling)."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(mx.argmax(pair.target(mx.array(seq)[None])[0, -1]))
        if token in pair.tokenizer.eos_token_ids:
            break
        out.append(token)
        seq.append(token)
    return out


def first_difference(got: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            return i
    return None if len(got) == len(ref) else min(len(got), len(ref))


def build(name: str, root: Path, tokenizer: Path, seed: int) -> tuple[Path, Path]:
    config = derive(name)
    try:
        from mlx.utils import tree_flatten
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
        size = sum(p.size for _, p in tree_flatten(model.parameters()))
        if size > MAX_PARAMETERS:
            raise NoConfig(f"{size:,} parameters: a size field kept its real value")
        weights = tiny.family_weights(config, seed=seed)
    except NoConfig:
        raise
    except Exception as e:
        raise NoConfig(f"{type(e).__name__}: {_short(e)}") from e
    target = tiny.write_model(root / name / "target", config, weights, tokenizer)
    draft = tiny.write_model(root / name / "draft", config, tiny.noisy(weights, 0.05), tokenizer)
    return target, draft


def _short(e: BaseException, width: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def sweep_one(name: str, root: Path, tokenizer: Path, tokens: int, seeds: int = 3) -> dict:
    """{"arch", "result" (ok / differ / crash / refused / mlx-lm cannot), "line", "seed"}."""
    notes = []
    for seed in range(seeds):
        out = _attempt(name, root, tokenizer, tokens, seed)
        if out.get("tie") is None:
            out["line"] = "; ".join([*notes, out["line"]]) if notes else out["line"]
            out["seed"] = seed
            return out
        notes.append(f"seed {seed}: exact tie of the reference's top two at {out['tie']}")
        shutil.rmtree(root / name, ignore_errors=True)
    return {"arch": name, "result": "tie", "line": "; ".join(notes), "seed": seeds - 1}


def _attempt(name: str, root: Path, tokenizer: Path, tokens: int, seed: int) -> dict:
    def line(result, text, **more):
        return {"arch": name, "result": result, "line": text, **more}

    if name in NOT_TINY:
        return line("mlx-lm cannot", f"mlx-lm cannot (tiny): {NOT_TINY[name]}")
    try:
        target, draft = build(name, root, tokenizer, seed)
        pair = load_pair(target=str(target), draft=str(draft))
        lookup = load_pair(target=str(target), drafter="ngram")
        prompts = [pair.tokenizer.encode(p) for p in PROMPTS]
        try:
            refs = [reference(pair, p, tokens) for p in prompts]
        except Exception as e:
            raise MlxLmCannot(f"generate: {type(e).__name__}: {_short(e)}") from e
    except MlxLmCannot as e:
        return line("mlx-lm cannot", f"mlx-lm cannot: {e}")
    except NoConfig as e:
        return line("no config", f"no config: the derived one does not build ({e})")
    except SpecError as e:
        if "cannot load the tokenizer" in str(e):  # transformers validates config.json
            return line("no config", f"no config: transformers rejects it ({_short(e)})")
        return line("refused", f"refused: {_short(e)}")
    except (Exception, SystemExit) as e:
        return line("mlx-lm cannot", f"mlx-lm cannot: load: {type(e).__name__}: {_short(e)}")
    parts = []
    runs = {
        "draft": lambda: [generate(pair, prompts[0], max_tokens=tokens, num_draft_tokens=4)],
        "ngram": lambda: [generate(lookup, prompts[0], max_tokens=tokens, num_draft_tokens=4)],
        "batch": lambda: batch_generate(pair, PROMPTS, max_tokens=tokens, num_draft_tokens=4),
    }
    worst = "ok"
    for what, run in runs.items():
        try:
            results = run()
        except SpecError as e:
            parts.append(f"{what} refused: {_short(e)}")
            worst = worst if worst in ("crash", "differ") else "refused"
            continue
        except Exception as e:
            where = traceback.extract_tb(e.__traceback__)[-1]
            parts.append(
                f"{what} crash: {type(e).__name__}: {_short(e)} "
                f"({Path(where.filename).name}:{where.lineno})"
            )
            worst = "crash"
            continue
        for res, (ref, ties) in zip(results, refs, strict=False):
            i = first_difference(res.tokens, ref)
            if i is None:
                continue
            if i < len(ties) and ties[i]:
                return line("tie", "", tie=f"{what} token {i}")
            truth = cacheless(pair, prompts[results.index(res)], tokens)
            if res.tokens == truth:  # mlx-lm's cached decoding is the one that strays
                parts.append(
                    f"{what} equals the cacheless forward; mlx-lm's own decoding differs "
                    f"from it at token {first_difference(ref, truth)}"
                )
                worst = worst if worst in ("crash", "differ") else "mlx-lm differs"
                continue
            parts.append(f"{what} differs at token {i}")
            worst = "crash" if worst == "crash" else "differ"
            break
    return line(worst, "ok" if not parts else "; ".join(parts))


def in_child(name: str, root: Path, args) -> dict:
    """Sweep one architecture in a process of its own: a model that exhausts memory or
    aborts takes only its own line down."""
    cmd = [sys.executable, __file__, name, "--child", str(root), "--tokens", str(args.tokens),
           "--seeds", str(args.seeds)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"arch": name, "result": "crash", "line": f"crash: over {args.timeout} s"}
    for out in done.stdout.splitlines():
        if out.startswith("ROW "):
            return json.loads(out[4:])
    tail = _short(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "")
    return {"arch": name, "result": "crash",
            "line": f"crash: the process ended with {done.returncode} {tail}"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", nargs="*", help="architectures (default: every one)")
    parser.add_argument("--tokens", type=int, default=24, help="reply length")
    parser.add_argument("--seeds", type=int, default=3, help="seeds tried past exact ties")
    parser.add_argument("--json", help="write the lines to this file")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # (one architecture, in ROOT)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    names = args.arch or architectures()
    if args.child:  # the parent's folder and tokenizer: a child makes none of its own
        row = sweep_one(names[0], Path(args.child), Path(args.child) / "tokenizer", args.tokens,
                        args.seeds)  # fmt: skip
        print("ROW " + json.dumps(row))
        return
    root = Path(tempfile.mkdtemp(prefix="arch-sweep-"))
    tokenizer = root / "tokenizer"
    tiny.write_tokenizer(tokenizer, VOCAB)
    rows = []
    try:
        for name in names:
            start = time.perf_counter()
            row = in_child(name, root, args)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(f"{name:24s} {row['line']}  ({row['seconds']} s)", flush=True)
            shutil.rmtree(root / name, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    counts = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    order = ["ok", "differ", "crash", "refused", "tie", "mlx-lm differs", "mlx-lm cannot",
             "no config"]  # fmt: skip
    summary = f"{len(rows)} architectures: " + ", ".join(
        f"{counts.get(k, 0)} {k}" for k in order if counts.get(k) or k != "tie"
    )
    print(summary)
    if args.markdown:
        print("\n| architecture | result |\n|---|---|")
        for r in rows:
            print(f"| {r['arch']} | {r['line']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
