"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`): its metadata checked, its stop
tokens, and a Hugging Face fast tokenizer rebuilt with the pre-tokenizer the file declares."""

from __future__ import annotations

import math
from pathlib import Path

from ...errors import SpecError, one_line

MODELS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece
# the named pre-tokenizers of byte-level BPE vocabularies (llama.cpp's llama-vocab.cpp), as the
# Hugging Face tokenizer.json of each family writes them: regexes applied one after another
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = {
    "llama3": [_LLAMA3_RE],
    "qwen2": [_QWEN2_RE],
    "smollm": [r"\p{N}", _GPT2_RE],
    "gpt2": [_GPT2_RE],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
PRE_TOKENIZERS = {
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral"], "llama3"),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], "qwen2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell"], "smollm"),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo"], "gpt2"),
    "default": "default",
}
# tokens that end a chat turn, added to eos_token_id when the vocabulary has them as control
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def check_metadata(meta: dict, where: str) -> None:
    """The tokenizer metadata a conversion needs, one line for the first thing wrong."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in MODELS:
        raise SpecError(
            f"{where}: unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2', "
            "SentencePiece 'llama')"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise SpecError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings")
    types = meta.get("tokenizer.ggml.token_type")
    if (
        not isinstance(types, list)
        or len(types) != len(tokens)
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in types)
    ):
        raise SpecError(
            f"{where}: tokenizer.ggml.token_type is missing or does not match the tokens"
        )
    if kind == "gpt2":
        _check_bpe(meta, where)
    else:
        _check_spm(meta, len(tokens), where)
    for key in ("bos", "eos", "unknown", "padding", "eot"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise SpecError(f"{where}: tokenizer.ggml.{key}_token_id is {value!r}")


def _check_bpe(meta: dict, where: str) -> None:
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(
        isinstance(m, str) and " " in m.strip(" ") for m in merges
    ):
        raise SpecError(f"{where}: tokenizer.ggml.merges is missing or malformed")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        known = ", ".join(PRE_TOKENIZERS)
        raise SpecError(f"{where}: unsupported pre-tokenizer tokenizer.ggml.pre = {pre!r} "
                        f"(supported: {known})")  # fmt: skip


def _check_spm(meta: dict, n_tokens: int, where: str) -> None:
    scores = meta.get("tokenizer.ggml.scores")
    if (
        not isinstance(scores, list)
        or len(scores) != n_tokens
        or not all(isinstance(s, float | int) and math.isfinite(s) for s in scores)
    ):
        raise SpecError(f"{where}: tokenizer.ggml.scores is missing or does not match "
                        "the tokens")  # fmt: skip


def eos_ids(meta: dict):
    """The stop ids: eos and eot, then the vocabulary's end-of-turn control tokens."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ids = []
    for key in ("eos", "eot"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens) and i not in ids:
            ids.append(i)
    control = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == 3}
    ids += [control[t] for t in END_OF_TURN if t in control and control[t] not in ids]
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def write_tokenizer(meta: dict, out: Path) -> None:
    """A Hugging Face fast tokenizer from `tokenizer.ggml.*`: byte-level BPE ('gpt2') with the
    declared pre-tokenizer, or SentencePiece ('llama': Llama 2, TinyLlama, Gemma) with byte
    fallback, its merges ranked by the scores."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in MODELS:
        raise SpecError(f"unsupported GGUF tokenizer {kind!r}")
    try:
        _build_tokenizer(meta, out)
    except SpecError:
        raise
    except Exception as err:  # the tokenizers library raises bare Exceptions on bad vocabularies
        raise SpecError(
            f"cannot build the tokenizer from the GGUF metadata: {one_line(err)}"
        ) from None


def _bpe_tokenizer(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "default")]
    # llama.cpp applies the regexes in turn, each splitting the pieces of the one before and
    # keeping the text between matches as pieces too: the tokenizers library's "isolated" split
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE[pre]]
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(meta: dict, tokens: list[str], types: list[int]):
    """SentencePiece BPE as llama.cpp runs it: spaces become "▁" (with one in front unless
    add_space_prefix is false), then adjacent pieces merge, highest-scoring result first;
    characters outside the vocabulary fall back to <0xXX> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta["tokenizer.ggml.scores"]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != 1 or vocab[t] != i:  # only normal tokens are merge results
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                merges.append((-scores[i], i, k, t[:k], t[k:]))
    merges.sort()
    unk = _token(meta, tokens, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _token(meta: dict, tokens: list[str], key: str) -> str | None:
    i = meta.get(key)
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def _add_special_tokens(tok, meta: dict, tokens: list[str], types: list[int]) -> None:
    """Control tokens (3) are special; user-defined ones (4, e.g. Qwen3's <think>) match whole;
    <bos> goes first where the file asks for it."""
    from tokenizers import AddedToken, processors

    pairs = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty == 3]
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == 4])
    bos = _token(meta, tokens, "tokenizer.ggml.bos_token_id")
    default_bos = meta["tokenizer.ggml.model"] == "llama"  # llama.cpp's default for SPM
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", default_bos) is True:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, bos_id)]
        )


def _build_tokenizer(meta: dict, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if meta["tokenizer.ggml.model"] == "gpt2":
        tok = _bpe_tokenizer(meta, tokens)
    else:
        tok = _spm_tokenizer(meta, tokens, types)
    _add_special_tokens(tok, meta, tokens, types)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_token(meta, tokens, "tokenizer.ggml.bos_token_id"),
        eos_token=_token(meta, tokens, "tokenizer.ggml.eos_token_id"),
        unk_token=_token(meta, tokens, "tokenizer.ggml.unknown_token_id"),
        pad_token=_token(meta, tokens, "tokenizer.ggml.padding_token_id"),
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        fast.chat_template = template
    fast.save_pretrained(str(out))
