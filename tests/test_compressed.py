"""mlx-lm's `deepseek_v41` (compressed attention beside a sliding window): its `LayerCache` has no
trim. Its layer replaces its arrays and never writes into one, so a copy of its attributes is a
snapshot: a rejected round restores it and replays the kept tokens, as a recurrent state is
(core/caches.py). Greedy output equals mlx-lm's own decoding of the target alone, with a draft
model and with prompt lookup, alone and in a batch (run row by row: batch_caches.ONE_OFFSET); a
fork and a saved decoder continue exactly; a cache class the file format does not know is
refused at save, never written as a file that does not load back."""

from __future__ import annotations

import pytest
import tiny
from conftest import VOCAB
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_spec import (
    SpecError,
    batch_generate,
    generate,
    load_decoder,
    load_pair,
    make_decoder,
    save_decoder,
)
from mlx_spec.core import caches

TEXTS = [
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef add(",
]
TOKENS = 40  # past the window of 8 and ten groups of 4


@pytest.fixture(scope="module")
def pairs(tiny_models, tmp_path_factory):
    """{drafter: pair} on tests/tiny.py's compressed target: a noisy copy as draft model, and
    prompt lookup."""
    config = tiny.compressed_config(VOCAB)
    noisy = tiny.noisy(tiny.family_weights(config, seed=0), 0.05)
    root = tmp_path_factory.mktemp("compressed")
    draft = tiny.write_model(root / "draft", config, noisy, tiny_models.tokenizer)
    target = str(tiny_models.compressed)
    return {
        "model": load_pair(target=target, draft=str(draft)),
        "ngram": load_pair(target=target, drafter="ngram"),
    }


def reference(pair, prompt: list[int], max_tokens: int = TOKENS) -> list[int]:
    """mlx-lm's greedy tokens on the target alone (up to its end token)."""
    out = []
    for r in stream_generate(
        pair.target, pair.tokenizer, prompt, max_tokens, sampler=make_sampler(0.0)
    ):
        if r.token in pair.tokenizer.eos_token_ids:
            break
        out.append(r.token)
    return out


def test_the_layer_cache_goes_back_by_a_snapshot(pairs):
    decoder = make_decoder(pairs["model"])
    assert {type(c).__name__ for c in decoder.cache} == {"LayerCache"}
    assert decoder.recurrent and not caches.can_rollback(decoder.cache, 1)
    with pytest.raises(caches.CacheRollbackError, match="LayerCache"):
        caches.rollback(decoder.cache, 1)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_output_is_mlx_lm_s(pairs, drafter, k):
    pair = pairs[drafter]
    replayed = 0
    for text in TEXTS:
        prompt = pair.tokenizer.encode(text)
        res = generate(pair, prompt, max_tokens=TOKENS, num_draft_tokens=k)
        assert res.tokens == reference(pair, prompt), text
        replayed += res.stats.replayed_tokens
    assert replayed > 0  # rounds were rejected: restored and replayed, not only accepted


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_batch_runs_row_by_row_and_each_row_is_mlx_lm_s(pairs, drafter):
    pair = pairs[drafter]
    results = batch_generate(pair, TEXTS, max_tokens=TOKENS, num_draft_tokens=4)
    for text, res in zip(TEXTS, results, strict=True):
        assert res.tokens == reference(pair, pair.tokenizer.encode(text)), text


def test_a_fork_and_a_saved_decoder_continue_exactly(pairs, tmp_path):
    pair = pairs["model"]
    prompt = pair.tokenizer.encode(TEXTS[0])
    decoder = make_decoder(pair)
    first = generate(pair, prompt, max_tokens=12, decoder=decoder)
    follow = prompt + first.tokens + pair.tokenizer.encode(" And then?")
    twin = decoder.fork()
    loaded = load_decoder(pair, save_decoder(decoder, tmp_path / "kept.safetensors"))
    expected = reference(pair, follow, 16)
    for kept in (twin, loaded, decoder):
        res = generate(pair, follow, max_tokens=16, decoder=kept)
        assert res.tokens == expected
        assert res.stats.prompt_tokens_reused >= len(prompt)


def test_a_cache_class_the_file_cannot_read_back_is_refused_at_save(pairs, tmp_path, monkeypatch):
    decoder = make_decoder(pairs["ngram"])
    generate(
        pairs["ngram"], pairs["ngram"].tokenizer.encode(TEXTS[1]), max_tokens=4, decoder=decoder
    )
    monkeypatch.setattr(caches, "compressed", lambda c: False)  # LayerCache unknown to us
    path = tmp_path / "kept.safetensors"
    with pytest.raises(SpecError, match="LayerCache layer cannot be saved"):
        save_decoder(decoder, path)
    assert not path.exists()
