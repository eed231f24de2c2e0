"""GGUF tokenizers as declared (issue 17): every named pre-tokenizer splits text as the model's
own tokenizer does, and SentencePiece vocabularies (Llama 2, TinyLlama, Gemma) encode as the
sentencepiece library does.

References are built independently of mlx_spec: the pre-tokenizers with the `regex` module and
a plain-Python byte-level BPE (llama.cpp's algorithm), plus hand-written splits for the cases
that tell the families apart; SentencePiece with the `sentencepiece` library itself, on a
model trained here.
"""

from __future__ import annotations

import io

import pytest
import regex
from gguf_tiny import byte_tokens
from transformers import PreTrainedTokenizerFast

from mlx_spec.models.gguf import write_tokenizer

# the pre-tokenizer regexes of each family, as its Hugging Face tokenizer.json (or, for the
# multi-regex ones, llama.cpp's llama-vocab.cpp) writes them
GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
          r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")  # fmt: skip
QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
         r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")  # fmt: skip
REFERENCE = {
    "gpt-2": [GPT2],
    "llama-bpe": [LLAMA3],
    "qwen2": [QWEN2],
    "smollm": [r"\p{N}", GPT2],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
}
TEXTS = [
    "12345 and 3.14159, 1,000,000!",
    "Hello  world\n\n  indented\tTAB   end   ",
    "It's they'LL we'Re DON'T",
    "naïve café — «quotes» 北京欢迎你 🙂 Ωmega",
    "x=a+b; if(y>=2){z|=3}",
    "\n\n\n  \r\n trailing \n",
    "٣٤٥ ½ ²",
]
# what distinguishes them: hand-written pre-tokenizer splits
SPLITS = {
    ("gpt-2", "12345 ab"): ["12345", " ab"],
    ("llama-bpe", "12345 ab"): ["123", "45", " ab"],
    ("qwen2", "12345 ab"): ["1", "2", "3", "4", "5", " ab"],
    ("smollm", "12345 ab"): ["1", "2", "3", "4", "5", " ab"],
    ("llama-bpe", "a  \n\nb"): ["a", "  \n\n", "b"],
    ("gpt-2", "a  \n\nb"): ["a", "  \n", "\n", "b"],
    ("llama-bpe", "x...!\n"): ["x", "...!\n"],
    ("gpt-2", "x...!\n"): ["x", "...!", "\n"],
    ("qwen2", "HE'LL"): ["HE", "'LL"],
    ("gpt-2", "HE'LL"): ["HE", "'", "LL"],
}


def split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex splits the previous pieces; the text
    between matches stays, as its own pieces."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            at = 0
            for m in regex.finditer(pattern, piece):
                if m.start() > at:
                    out.append(piece[at : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = max(at, m.end())
            if at < len(piece):
                out.append(piece[at:])
        pieces = out
    return pieces


BYTE = byte_tokens()


def bpe(word: str, ranks: dict) -> list[str]:
    parts = [BYTE[b] for b in word.encode("utf-8")]
    while len(parts) > 1:
        pairs = [
            (ranks.get((a, b), 1 << 30), i)
            for i, (a, b) in enumerate(zip(parts, parts[1:], strict=False))
        ]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "Ġ Ġ", "ĠĠ Ġ", "Ċ Ċ", "' L", "'L L", ". .",
          "Ã ¯", "i n", "Ġ a", "a n", "Ġa n", "an d"]  # fmt: skip


def bpe_meta(pre: str) -> dict:
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.eos_token_id": len(tokens) - 1,
    }


@pytest.mark.parametrize("pre", list(REFERENCE))
def test_bpe_pre_tokenizer_matches_reference(tmp_path, pre):
    meta = bpe_meta(pre)
    write_tokenizer(meta, tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ranks = {tuple(m.split(" ")): i for i, m in enumerate(MERGES)}
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    for text in TEXTS:
        expected = [vocab[p] for w in split(text, REFERENCE[pre]) for p in bpe(w, ranks)]
        assert tok.encode(text) == expected, (pre, text)
        assert tok.decode(expected) == text
    for (name, text), pieces in SPLITS.items():
        if name == pre:
            assert split(text, REFERENCE[pre]) == pieces  # the reference says what we think
            pre_split = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
            assert [bytes(BYTE.index(c) for c in p).decode() for p, _ in pre_split] == pieces


def test_special_tokens_are_whole(tmp_path):
    write_tokenizer(bpe_meta("qwen2"), tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ids = tok.encode("a<|endoftext|>b")
    assert ids[1] == len(bpe_meta("qwen2")["tokenizer.ggml.tokens"]) - 1 and len(ids) == 3


# --- SentencePiece -----------------------------------------------------------------------------

CORPUS = (
    """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
In the beginning there was the word, and the word was with the fox and the dog.
Numbers like 12, 345 and 6789 appear here and there, as do  double  spaces.
"""
    * 20
)


@pytest.fixture(scope="module")
def spm_models(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    out = {}
    for prefix in (True, False):
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS.splitlines()),
            model_writer=buf,
            vocab_size=420,
            model_type="bpe",
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=prefix,
            split_digits=False,
            allow_whitespace_only_pieces=True,
            split_by_whitespace=False,
            user_defined_symbols=["<start_of_turn>"],
        )
        out[prefix] = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    return out


def spm_meta(sp, prefix: bool) -> dict:
    tokens, types, scores = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(
            2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
            else 4 if tokens[-1] == "<start_of_turn>" else 1
        )  # fmt: skip
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.add_space_prefix": prefix,
        "tokenizer.ggml.add_bos_token": False,
    }


@pytest.mark.parametrize("prefix", [True, False], ids=["llama-style", "gemma-style"])
def test_sentencepiece_matches_the_library(tmp_path, spm_models, prefix):
    sp = spm_models[prefix]
    write_tokenizer(spm_meta(sp, prefix), tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    texts = TEXTS + ["the fox and the dog", "  the  lazy\n\ndog  ", "Über 北京 🙂"]
    for text in texts:
        assert tok.encode(text) == sp.encode(text), text
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_sentencepiece_bos_is_added_when_declared(tmp_path, spm_models):
    sp = spm_models[True]
    meta = spm_meta(sp, True) | {"tokenizer.ggml.add_bos_token": True}
    write_tokenizer(meta, tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert tok.encode("the dog") == [sp.bos_id(), *sp.encode("the dog")]
