"""A quantized target, as most Mac checkpoints ship (mlx-lm's `convert -q`: affine 4- and 8-bit,
and mxfp4): speculative decoding, alone and in a batch, is token for token what mlx-lm gives
the quantized target alone. Quantized matmuls round differently from the float ones, so a
float draft's guesses meet a target whose logits are not the float target's."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.utils import load, quantize_model, save
from test_batch import TEXTS, assert_schedule_exact, run_schedule
from test_greedy_equality import reference

from mlx_spec import generate, load_pair
from mlx_spec.decode.generate import make_batch_decoder

MODES = {"4bit": (64, 4, "affine"), "8bit": (32, 8, "affine"), "mxfp4": (32, 4, "mxfp4")}


@pytest.fixture(scope="module")
def quantized(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, (group, bits, mode) in MODES.items():
        model, tokenizer, config = load(str(tiny_models.target), return_config=True)
        model, config = quantize_model(model, config, group, bits, mode=mode)
        save(root / name, tiny_models.target, model, tokenizer, config)
        out[name] = root / name
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_a_quantized_target_decodes_as_mlx_lm(quantized, tiny_models, mode):
    pair = load_pair(target=str(quantized[mode]), draft=str(tiny_models.draft))
    assert any(isinstance(w, mx.array) and w.dtype == mx.uint32 for w in _weights(pair.target))
    lookup = load_pair(target=str(quantized[mode]), drafter="ngram")
    model, tokenizer = load(str(quantized[mode]))
    own = SimpleNamespace(target=model, tokenizer=tokenizer)
    for text in TEXTS[:3]:
        prompt = pair.tokenizer.encode(text)
        ref = reference(own, text, 20)  # (mlx-lm's own load and decoding)
        for p, k in ((pair, 3), (pair, 6), (lookup, 4)):
            res = generate(p, prompt, max_tokens=20, num_draft_tokens=k)
            assert res.tokens == ref, (mode, text, k)
    assert res.stats.drafted > 0
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    decoder = make_batch_decoder(pair, 3)
    out, reasons = run_schedule(decoder, prompts)
    assert_schedule_exact(pair, prompts, out, reasons, mode)
    assert decoder.drafted > 0


def _weights(model):
    from mlx.utils import tree_flatten

    return [w for _, w in tree_flatten(model.parameters())]
