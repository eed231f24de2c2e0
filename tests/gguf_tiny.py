"""Tiny GGUF files written the way llama.cpp's converter writes them, with the `gguf` package,
next to the same weights in the Hugging Face layout for mlx-lm to load directly.

The reference side never uses mlx_spec: the weights are what the `gguf` package dequantizes the
stored blocks to, the llama Q/K rows are restored with the inverse of llama.cpp's `permute`
(checked against `permute` itself), and Gemma's norms lose llama.cpp's +1 here, in the test.
K-quant blocks are random but valid (the `gguf` package cannot quantize K-quants); the float
scales in them are kept small so the tiny models behave like models.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from hostile_files import byte_tokens  # GPT-2's printable stand-ins for the 256 bytes

DIMS = {  # head_dim 64; every matrix width a multiple of 256 so K-quants fit
    "llama": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ff=512, layers=2),
    "qwen2": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ff=512, layers=2),
    "qwen3": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ff=512, layers=2),
    "gemma3": dict(hidden=256, heads=4, kv_heads=1, head_dim=64, ff=256, layers=6),
}
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# where d (and dmin) sit in each K-quant block, and sizes that give weights of rms ~0.05,
# centred (dmin * min offsets d * scale * code)
K_FIELDS = {
    T.Q2_K: [(80, 2.4e-3), (82, 6e-3)],
    T.Q3_K: [(108, 8e-4)],
    T.Q4_K: [(0, 1.5e-4), (2, 1.1e-3)],
    T.Q5_K: [(0, 7.7e-5), (2, 1.2e-3)],
    T.Q6_K: [(208, 2.5e-5)],
}
# a llama.cpp-style mixture: Q4_K_M keeps attn_v, ffn_down and the output in Q6_K
MIXES = {
    "Q4_K_M": lambda name: (
        T.Q6_K if name.split(".")[-2] in ("attn_v", "ffn_down", "output") else T.Q4_K
    ),
    "Q5_K_M": lambda name: (
        T.Q6_K if name.split(".")[-2] in ("attn_v", "ffn_down", "output") else T.Q5_K
    ),
}


def bpe_vocab(specials: list[str]) -> tuple[list[str], list[int], list[str]]:
    """256 byte tokens, a few merges (so BPE has work to do), then control tokens."""
    tokens = byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "1 2", "12 3", "Ġ Ġ", "ĠĠ Ġ"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, merges


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A Gemma-style SentencePiece vocabulary: specials, 256 byte-fallback tokens, pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "in", "▁a", "er", "▁▁"]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * (6 + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rows -> GGUF rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Its inverse (GGUF rows -> HF rows), as transformers' GGUF loader writes it."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def random_k_blocks(qtype: T, rows: int, cols: int, rng) -> np.ndarray:
    """Valid random K-quant blocks: random codes and sub-block scales, small float16 d/dmin."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at, d in K_FIELDS[qtype]:
        value = (d * rng.uniform(0.5, 1.5, n)).astype(np.float16)
        blocks[:, at : at + 2] = value.view(np.uint8).reshape(n, 2)
    # the 16-weight sub-block scales of Q6_K / Q3_K / Q2_K as real files have them: neighbours
    # of similar size (the max of 16 weights varies by tens of percent), signs at random;
    # unrelated sizes would make MLX's 32-weight groups (which they are re-quantized to)
    # far coarser than any real file makes them
    if qtype == T.Q6_K:
        sc = rng.integers(80, 128, (n, 16)) * rng.choice([-1, 1], (n, 16))
        blocks[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    elif qtype == T.Q3_K:
        v = (32 + rng.integers(20, 32, (n, 16)) * rng.choice([-1, 1], (n, 16))).clip(0, 63)
        v = v.astype(np.uint8)
        s = np.zeros((n, 12), np.uint8)
        s[:, 0:8] = (v[:, 0:8] & 15) | ((v[:, 8:16] & 15) << 4)
        for j in range(16):
            s[:, 8 + j % 4] |= (v[:, j] >> 4) << (2 * (j // 4))
        blocks[:, 96:108] = s
    elif qtype == T.Q2_K:
        blocks[:, 0:16] = rng.integers(10, 16, (n, 16)) | (rng.integers(0, 16, (n, 16)) << 4)
    return blocks.reshape(rows, cols // block * size)


def stored_tensor(qtype: T, rows: int, cols: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what the GGUF stores, the float32 weights it means) for one matrix."""
    if qtype in K_FIELDS:
        data = random_k_blocks(qtype, rows, cols, rng)
        return data, dequantize(data, qtype).reshape(rows, cols)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qtype == T.F32:
        return w, w
    if qtype == T.F16:  # the reference keeps float16 too: mlx-lm computes in what it loads
        data = w.astype(np.float16)
        return data, data
    if qtype == T.BF16:
        data = quantize(w, qtype)
        return data, dequantize(data, qtype).reshape(rows, cols)
    data = quantize(w, qtype)
    return data, dequantize(data, qtype).reshape(rows, cols)


class Tiny:
    """One tiny model: the GGUF file and the reference directory mlx-lm loads itself."""

    def __init__(self, gguf_path: Path, ref_dir: Path, arch: str, vocab: int):
        self.gguf, self.ref, self.arch, self.vocab = gguf_path, ref_dir, arch, vocab


def write_tiny(
    root: Path,
    arch: str,
    qtype: str = "F32",
    *,
    seed: int = 0,
    tied: bool | None = None,
    rope_scaling: dict | None = None,
    pre: str | None = None,
    embd_type: str | None = None,
    spm: bool | None = None,
) -> Tiny:
    """Write `root/<arch>-<qtype>.gguf` (matrices in `qtype`, or a mix like Q4_K_M) and
    `root/<arch>-<qtype>-ref/` (config.json + float32 safetensors in the HF layout)."""
    d = DIMS[arch]
    hidden, heads, kv_heads, head_dim, ff, layers = (
        d[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ff", "layers")
    )
    rng = np.random.default_rng(seed)
    spm = arch == "gemma3" if spm is None else spm  # Llama 2 / TinyLlama: SentencePiece too
    if spm:
        tokens, types, scores = spm_vocab()
        merges = None
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        tokens, types, merges = bpe_vocab(specials)
    vocab = len(tokens)
    tied = (arch in ("gemma3", "qwen3")) if tied is None else tied

    def type_of(name: str) -> T:
        if name.startswith("token_embd") and embd_type:
            return T[embd_type]
        return MIXES[qtype](name) if qtype in MIXES else T[qtype]

    stored, ref = {}, {}  # GGUF name -> (data, type); HF name -> float32

    def matrix(name: str, hf: str, rows: int, cols: int, n_head: int | None = None):
        qt = type_of(name)
        data, w = stored_tensor(qt, rows, cols, rng)
        if n_head is not None:  # llama: the file holds permute(HF); restore HF for the ref
            w_hf = unpermute(w, n_head)
            assert np.array_equal(permute(w_hf, n_head), w)
            w = w_hf
        stored[name] = (data, qt)
        ref[hf] = w

    def vector(name: str, hf: str, n: int, norm: bool):
        w = (rng.standard_normal(n) * 0.1 + (1.0 if norm and arch != "gemma3" else 0.0)).astype(
            np.float32
        )
        ref[hf] = w
        # llama.cpp adds 1 to every Gemma norm weight (its norm multiplies by w, Gemma's by 1+w)
        stored[name] = ((w + 1) if norm and arch == "gemma3" else w, T.F32)
        if norm and arch == "gemma3":
            ref[hf] = stored[name][0] - np.float32(1)

    matrix("token_embd.weight", "model.embed_tokens.weight", vocab, hidden)
    vector("output_norm.weight", "model.norm.weight", hidden, True)
    if not tied:
        matrix("output.weight", "lm_head.weight", vocab, hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        perm = arch == "llama"
        matrix(
            p + "attn_q.weight", h + "self_attn.q_proj.weight", q, hidden, heads if perm else None
        )
        matrix(p + "attn_k.weight", h + "self_attn.k_proj.weight", kv, hidden,
               kv_heads if perm else None)  # fmt: skip
        matrix(p + "attn_v.weight", h + "self_attn.v_proj.weight", kv, hidden)
        matrix(p + "attn_output.weight", h + "self_attn.o_proj.weight", hidden, q)
        matrix(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", ff, hidden)
        matrix(p + "ffn_up.weight", h + "mlp.up_proj.weight", ff, hidden)
        matrix(p + "ffn_down.weight", h + "mlp.down_proj.weight", hidden, ff)
        vector(p + "attn_norm.weight", h + "input_layernorm.weight", hidden, True)
        if arch == "gemma3":
            vector(p + "post_attention_norm.weight", h + "post_attention_layernorm.weight",
                   hidden, True)  # fmt: skip
            vector(p + "ffn_norm.weight", h + "pre_feedforward_layernorm.weight", hidden, True)
            vector(p + "post_ffw_norm.weight", h + "post_feedforward_layernorm.weight",
                   hidden, True)  # fmt: skip
        else:
            vector(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", hidden, True)
        if arch in ("qwen3", "gemma3"):
            vector(p + "attn_q_norm.weight", h + "self_attn.q_norm.weight", head_dim, True)
            vector(p + "attn_k_norm.weight", h + "self_attn.k_norm.weight", head_dim, True)
        if arch == "qwen2":
            for part, n in (("q", q), ("k", kv), ("v", kv)):
                vector(p + f"attn_{part}.bias", h + f"self_attn.{part}_proj.bias", n, False)

    theta = {"llama": 10000.0, "qwen2": 1e6, "qwen3": 1e6, "gemma3": 1e6}[arch]
    ctx = 512
    path = root / f"{arch}-{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", layers)
    w.add_uint32(f"{arch}.context_length", ctx)
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_uint32(f"{arch}.feed_forward_length", ff)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if arch in ("qwen3", "gemma3"):
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    else:
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    if arch == "gemma3":
        w.add_uint32("gemma3.attention.sliding_window", 8)
    config = {
        "model_type": MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ff,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
    }
    if arch == "gemma3":
        config |= {"query_pre_attn_scalar": head_dim, "sliding_window": 8,
                   "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}  # fmt: skip
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
        kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
        if kind == "llama3":  # llama.cpp writes the factors as the rope_freqs tensor
            stored["rope_freqs.weight"] = (llama3_factors(rope_scaling, theta, head_dim), T.F32)
        else:
            w.add_string(f"{arch}.rope.scaling.type", kind)
            w.add_float32(f"{arch}.rope.scaling.factor", rope_scaling["factor"])
            if "original_max_position_embeddings" in rope_scaling:
                w.add_uint32(
                    f"{arch}.rope.scaling.original_context_length",
                    rope_scaling["original_max_position_embeddings"],
                )
    if spm:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores(scores)
        w.add_add_space_prefix(arch != "gemma3")
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}[arch])
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    for name, (data, qt) in stored.items():
        if qt in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ref_dir = root / f"{arch}-{qtype}-ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(ref_dir / "model.safetensors"), {k: mx.array(v) for k, v in ref.items()}
    )
    return Tiny(path, ref_dir, arch, vocab)


def llama3_factors(s: dict, base: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the rope_freqs tensor."""
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
