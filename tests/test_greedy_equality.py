"""Temperature 0: speculative output is token-for-token what mlx_lm gives the target alone."""

from __future__ import annotations

import mlx_lm
import pytest

from mlx_spec import generate, load_pair

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Paris is the capital of",
]


def reference(pair, prompt: str, max_tokens: int) -> list[int]:
    """Target-only greedy tokens from mlx_lm, without a final end-of-sequence token."""
    out = list(mlx_lm.stream_generate(pair.target, pair.tokenizer, prompt, max_tokens=max_tokens))
    tokens = [r.token for r in out]
    if out and out[-1].finish_reason == "stop":
        tokens.pop()
    return tokens


@pytest.fixture(scope="module", params=["target/draft", "target2/draft2"])
def any_pair(request, tiny_models):
    target, draft = request.param.split("/")
    return load_pair(
        target=str(getattr(tiny_models, target)), draft=str(getattr(tiny_models, draft))
    )


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_target_alone(any_pair, prompt, k):
    expected = reference(any_pair, prompt, 48)
    res = generate(any_pair, prompt, max_tokens=48, num_draft_tokens=k)
    assert res.tokens == expected
    assert res.text == any_pair.tokenizer.decode(expected)
    assert res.stats.generated_tokens == len(expected)
    assert res.stats.drafted > 0


@pytest.mark.parametrize("k", [3, 5, 8])
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_inside_a_round(pair, k, max_tokens):
    expected = reference(pair, PROMPTS[0], max_tokens)
    res = generate(pair, PROMPTS[0], max_tokens=max_tokens, num_draft_tokens=k)
    assert res.tokens == expected
    assert len(res.tokens) == max_tokens
    assert res.finish_reason == "length"


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("draft", ["draft", "copy"])
def test_end_of_sequence_mid_round(tiny_models, k, draft):
    """Make a token the target emits at position ~10 an end-of-sequence token."""
    pair = load_pair(target=str(tiny_models.target), draft=str(getattr(tiny_models, draft)))
    free_run = reference(pair, PROMPTS[2], 40)
    position = next(i for i in range(8, 40) if free_run[i] not in free_run[:i])
    pair.tokenizer.add_eos_token(str(free_run[position]))
    expected = reference(pair, PROMPTS[2], 40)
    assert expected == free_run[:position]  # the reference stops there too
    res = generate(pair, PROMPTS[2], max_tokens=40, num_draft_tokens=k)
    assert res.tokens == expected
    assert res.finish_reason == "stop"


@pytest.mark.parametrize("k", [2, 5])
def test_plain_decoding_equals_mlx_lm(tiny_models, k):
    pair = load_pair(target=str(tiny_models.target))
    assert pair.draft is None
    res = generate(pair, PROMPTS[1], max_tokens=30, num_draft_tokens=k)
    assert res.tokens == reference(pair, PROMPTS[1], 30)
    assert res.stats.drafted == 0 and res.stats.target_passes == 30
    assert not any(res.accepted)


def test_chat_messages_use_the_template(pair):
    messages = [{"role": "user", "content": "Hello"}]
    text = pair.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = reference(pair, text, 20)
    assert generate(pair, messages, max_tokens=20).tokens == expected
    ids = pair.tokenizer.encode(text, add_special_tokens=False)
    assert generate(pair, ids, max_tokens=20).tokens == expected


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_equals_target_alone_with_a_draft_adapter(tiny_models, tmp_path, k):
    """A LoRA adapter changes what the draft proposes, never what the pair outputs."""
    import mlx.core as mx
    import tiny

    adapter = tiny.write_adapter(tmp_path / "adapter", tiny_models.draft, size=0.2)
    pair = load_pair(
        target=str(tiny_models.target), draft=str(tiny_models.draft), draft_adapter=adapter
    )
    bare = load_pair(target=str(tiny_models.target), draft=str(tiny_models.draft))
    ids = mx.array([[5, 9, 3, 12]])
    assert not mx.allclose(pair.draft(ids), bare.draft(ids)).item()  # the adapter is applied
    for prompt in PROMPTS:
        res = generate(pair, prompt, max_tokens=40, num_draft_tokens=k)
        assert res.tokens == reference(pair, prompt, 40)
        assert res.stats.drafted > 0
