"""Tiny models whose configs carry what the real checkpoints of each family ship.

Each entry is a published checkpoint's `config.json`, shrunk in width and depth (hidden size,
layers, heads, experts, vocabulary) but keeping the fields that change how mlx-lm builds the
model: rope scaling blocks (`llama3`, YaRN, longrope, linear), sliding windows and their layer
patterns, tied embeddings, an explicit head_dim, partial rotary, qk-norm, attention sinks, MLA.
Fields mlx-lm ignores (`use_sliding_window: false`, `max_window_layers`, ...) stay too: a
loader that read them wrongly would show it here.

The rope scaling classes (`Llama3RoPE`, `YarnRoPE`, `SuScaledRoPE`) hold private `_freqs`
arrays that `mlx_lm.load` does not evaluate: the reason this matrix exists (threads.py).
"""

from __future__ import annotations

WINDOW = 8  # sliding windows shrunk like everything else; prompts and replies cross them


# DeepSeek-V3's published YaRN block (its config.json)
DEEPSEEK_V3_YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}


def _llama3_rope(factor: float) -> dict:
    return {
        "factor": factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }


def real_configs(vocab: int) -> dict[str, dict]:
    common = {"vocab_size": vocab, "eos_token_id": 2, "rms_norm_eps": 1e-5}
    return {
        # meta-llama/Llama-3.1-8B-Instruct: llama3 rope scaling (factor 8), untied head
        "llama3.1": {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": _llama3_rope(8.0),
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
        # meta-llama/Llama-3.2-1B-Instruct: llama3 rope (factor 32), tied embeddings,
        # head_dim given explicitly
        "llama3.2": {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": _llama3_rope(32.0),
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
        },
        # Qwen/Qwen2.5-7B-Instruct with the YaRN block its model card tells users to add for
        # long context; q/k/v biases; the unused sliding-window fields it ships
        "qwen2.5-yarn": {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rope_scaling": {
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
                "type": "yarn",
            },
            "sliding_window": 131072,
            "use_sliding_window": False,
            "max_window_layers": 28,
            "tie_word_embeddings": False,
        },
        # Qwen/Qwen3-0.6B: head_dim 128 != hidden / heads, qk-norm, tied embeddings
        "qwen3": {
            **common,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": 28,
            "tie_word_embeddings": True,
        },
        # Qwen/Qwen3.5-27B: multimodal wrapper, a text_config of Gated-DeltaNet layers and
        # one gated full-attention layer in 4, mrope with partial rotary in rope_parameters
        "qwen3.5": {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": False,
            "eos_token_id": 2,
            "text_config": {
                "model_type": "qwen3_5_text",
                "vocab_size": vocab,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "linear_num_value_heads": 4,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 32,
                "linear_value_head_dim": 32,
                "linear_conv_kernel_dim": 4,
                "full_attention_interval": 4,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                "attn_output_gate": True,
                "max_position_embeddings": 262144,
                "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "mrope_interleaved": True,
                    # 32 x 0.25 = 8 rotary dims, 4 pairs (the real 256 x 0.25: 11 + 11 + 10)
                    "mrope_section": [2, 1, 1],
                    "rope_type": "default",
                    "rope_theta": 10000000,
                    "partial_rotary_factor": 0.25,
                },
                "mtp_num_hidden_layers": 1,
                "tie_word_embeddings": False,
                "eos_token_id": 2,
            },
        },
        # google/gemma-3-4b-it: multimodal wrapper; linear rope scaling (factor 8) on the
        # global layers, a local rope base, 5 sliding layers to 1 global
        "gemma3": {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "vocab_size": vocab,
            "eos_token_id": [1, 2],
            "text_config": {
                "model_type": "gemma3_text",
                "vocab_size": vocab,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 6,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "query_pre_attn_scalar": 16,
                "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0,
                "rope_local_base_freq": 10000.0,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                "sliding_window": WINDOW,
                "sliding_window_pattern": 6,
                "max_position_embeddings": 131072,
                "final_logit_softcapping": None,
                "attn_logit_softcapping": None,
            },
        },
        # microsoft/Phi-3.5-mini-instruct: longrope (long/short factors per rotary pair)
        "phi3.5": {
            **common,
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.08, 1.2, 1.6, 2.4, 4.1, 7.5, 12.8, 20.3],
                "short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7],
            },
            "sliding_window": 262144,
            "tie_word_embeddings": False,
        },
        # microsoft/Phi-4-mini-instruct: phi3 with partial rotary (0.75) and tied embeddings
        "phi4-mini": {
            **common,
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.2, 2.0, 4.0, 8.0, 16.0],
                "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            },
            "sliding_window": 262144,
            "tie_word_embeddings": True,
        },
        # deepseek-ai/DeepSeek-V2-Lite-Chat: multi-head latent attention, YaRN, MoE after a
        # first dense layer
        "deepseek-v2-lite": {
            **common,
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "routed_scaling_factor": 1.0,
            "topk_method": "greedy",
            "norm_topk_prob": False,
            "max_position_embeddings": 163840,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            "tie_word_embeddings": False,
        },
        # openai/gpt-oss-20b: sliding and full attention alternating, attention sinks, MoE,
        # YaRN
        "gpt-oss": {
            **common,
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "experts_per_token": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
            "max_position_embeddings": 131072,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
        },
        # mistralai/Mistral-Small-3.1-24B text config (Devstral-style): "mistral" maps to
        # mlx-lm's llama; head_dim 128 != hidden / heads; no window
        "mistral": {
            **common,
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 131072,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    }


def mtp_configs(vocab: int) -> dict[str, dict]:
    """Checkpoints that ship an MTP layer as one more decoder layer (tests/test_mtp_nextn.py);
    kept apart from `real_configs` so the conformance matrix does not grow by two families."""
    common = {"vocab_size": vocab, "eos_token_id": 2}
    return {
        # deepseek-ai/DeepSeek-V3 (and -R1, -V3-0324): MLA with a q LoRA, YaRN (factor 40),
        # MoE after the first dense layers, noaux_tc routing with group-limited top-k, and one
        # MTP layer stored as model.layers.{num_hidden_layers} (mlx-lm drops it at load)
        "deepseek-v3": {
            **common,
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "routed_scaling_factor": 2.5,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "n_group": 4,
            "topk_group": 2,
            "norm_topk_prob": True,
            "aux_loss_alpha": 0.001,
            "seq_aux": True,
            "ep_size": 1,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "max_position_embeddings": 163840,
            "rope_theta": 10000,
            "rope_scaling": dict(DEEPSEEK_V3_YARN),
            "rms_norm_eps": 1e-6,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        },
        # zai-org/GLM-4.5: grouped-query attention with biases and qk-norm (GLM-4.5-Air ships
        # use_qk_norm false), half the head rotated, MoE after the first dense layers, sigmoid
        # routing with a correction bias, one MTP layer as model.layers.{num_hidden_layers}
        "glm-4.5": {
            **common,
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "rms_norm_eps": 1e-5,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
            "pad_token_id": 0,
            "torch_dtype": "bfloat16",
        },
        # zai-org/GLM-4.7-Flash (glm4_moe_lite): DeepSeek-style MLA (q LoRA, kv_b_proj) in a
        # GLM MoE, one MTP layer as model.layers.{num_hidden_layers}; fields as mlx-lm's
        # glm4_moe_lite defaults name them (not compared with the hub's file here)
        "glm-4.7-flash": {
            **common,
            "architectures": ["Glm4MoeLiteForCausalLM"],
            "model_type": "glm4_moe_lite",
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_nope_head_dim": 24,
            "qk_rope_head_dim": 8,
            "v_head_dim": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "routed_scaling_factor": 1.8,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "partial_rotary_factor": 1.0,
            "attention_bias": False,
            "max_position_embeddings": 202752,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "rms_norm_eps": 1e-5,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
        },
    }


def llama4_configs(vocab: int, chunk: int = 8) -> dict[str, dict]:
    """Llama 4's two published text configs, shrunk: chunked attention (`attention_chunk_size`
    8192 -> `chunk`) on three layers of four, the fourth global without RoPE (iRoPE; mlx-lm
    decides it by layer index, `no_rope_layers` ships empty), attention temperature tuning
    on the no-RoPE layers, qk-norm, one routed expert a token beside a shared one."""
    text = {
        "model_type": "llama4_text",
        "attention_bias": False,
        "attention_chunk_size": chunk,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "no_rope_layers": [],
        "num_attention_heads": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return {
        # meta-llama/Llama-4-Scout-17B-16E-Instruct: 16 experts on every layer, llama3 rope
        # scaling (factor 16), qk-norm, 10M positions
        "llama4-scout": {
            "architectures": ["Llama4ForConditionalGeneration"],
            "model_type": "llama4",
            "eos_token_id": 2,
            "text_config": {
                **text,
                "interleave_moe_layer_step": 1,
                "num_local_experts": 4,
                "max_position_embeddings": 10485760,
                "rope_scaling": {
                    "factor": 16.0,
                    "high_freq_factor": 1.0,
                    "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                    "rope_type": "llama3",
                },
                "use_qk_norm": True,
            },
        },
        # meta-llama/Llama-4-Maverick-17B-128E-Instruct: experts on every other layer (128),
        # no rope scaling, no qk-norm, 1M positions
        "llama4-maverick": {
            "architectures": ["Llama4ForConditionalGeneration"],
            "model_type": "llama4",
            "eos_token_id": 2,
            "text_config": {
                **text,
                "interleave_moe_layer_step": 2,
                "num_local_experts": 4,
                "max_position_embeddings": 1048576,
                "rope_scaling": None,
                "use_qk_norm": False,
            },
        },
    }


def tied(config: dict) -> bool:
    text = config.get("text_config", {})
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings")))


def real_weights(config: dict, seed: int) -> dict:
    """Random float32 weights (tiny.family_weights). With tied embeddings the output head is
    the input embedding, and a tiny random model's residual stream is mostly its input: it
    would echo its last token forever. Louder attention and MLP outputs make it say more."""
    import tiny

    if not tied(config):
        return tiny.family_weights(config, seed=seed)
    # measured on llama3.2 / qwen3 / phi4-mini rows: distinct tokens in a 40-token greedy
    # reply 1 / 1 / 1 as built, 7 / 13 / 5 with an unscaled head and 30x louder layers
    weights = tiny.family_weights(config, seed=seed, head_scale=1.0)
    for k, v in weights.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] = v * 30.0
    return weights
