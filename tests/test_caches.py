"""KV-cache bookkeeping: after a run the target cache holds every token but the last."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_spec import generate, load_pair, make_decoder
from mlx_spec.core import caches

PROMPT = "Once upon a time"


def offsets(decoder) -> tuple[int, int]:
    return decoder.cache[0].offset, decoder.drafter.cache[0].offset


@pytest.mark.parametrize(
    ("draft", "rate"),
    [("copy", 1.0), ("deranged", 0.0), ("draft", None)],
    ids=["all-accepted", "all-rejected", "mixed"],
)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_cache_offsets_after_a_run(tiny_models, draft, rate, k):
    pair = load_pair(target=str(tiny_models.target), draft=str(getattr(tiny_models, draft)))
    decoder = make_decoder(pair)
    res = generate(pair, PROMPT, max_tokens=25, num_draft_tokens=k, decoder=decoder)
    assert res.finish_reason == "length"
    prompt_len = res.stats.prompt_tokens
    target_offset, draft_offset = offsets(decoder)
    assert target_offset == prompt_len + len(res.tokens) - 1
    # the draft holds all but its unfed tokens: one, two after a fully accepted round,
    # one more after the last round (k=0 when a single token was left to produce)
    assert draft_offset == prompt_len + len(res.tokens) - len(decoder.drafter.unfed)
    assert 1 <= len(decoder.drafter.unfed) <= 3
    if rate is not None:
        assert res.stats.acceptance_rate == rate
    else:
        assert 0 < res.stats.acceptance_rate < 1
    assert sum(res.accepted) == res.stats.accepted
    # every round that drafted is in the histogram; only a last single-token round is not
    assert res.stats.target_passes - sum(res.stats.accepted_lengths) in (0, 1)


def test_follow_up_prompt_reuses_the_cache(pair):
    """A second turn that extends the first only prefills its new tokens."""
    decoder = make_decoder(pair)
    tok = pair.tokenizer
    first = tok.encode(PROMPT, add_special_tokens=False)
    res = generate(pair, first, max_tokens=10, decoder=decoder)
    follow_up = first + res.tokens + tok.encode(" and then", add_special_tokens=False)
    again = generate(pair, follow_up, max_tokens=10, decoder=decoder)
    assert again.stats.prompt_tokens_reused == len(first) + len(res.tokens) - 1
    fresh = generate(pair, follow_up, max_tokens=10)
    assert again.tokens == fresh.tokens
    assert fresh.stats.prompt_tokens_reused == 0


def test_plain_decoding_cache_after_stop_and_length(tiny_models):
    pair = load_pair(target=str(tiny_models.target))
    decoder = make_decoder(pair)
    res = generate(pair, PROMPT, max_tokens=12, decoder=decoder)
    assert decoder.cache[0].offset == res.stats.prompt_tokens + len(res.tokens) - 1


def test_a_chunked_layer_rolls_back_only_into_a_chunk_it_still_holds():
    """Llama 4's chunked attention keeps the last chunk_size tokens; the position a roll-back
    returns to attends to its whole chunk, so the chunk's front must still be there (a branch
    into a chunk whose front was dropped decoded other tokens than a fresh run)."""
    from mlx_lm.models.cache import ChunkedKVCache

    c = ChunkedKVCache(8)
    c.update_and_fetch(mx.zeros((1, 1, 20, 4)), mx.zeros((1, 1, 20, 4)))
    c.maybe_trim_front()  # as the model does before each pass: it holds positions 12..19
    assert c.start_position == 12
    assert caches.can_rollback([c], 4)  # back to 16: its chunk (16..23) starts after 12
    assert not caches.can_rollback([c], 6)  # back to 14: chunk 8..15 lost 8..11
    assert not caches.can_rollback([c], 9)  # before anything it holds
    with pytest.raises(caches.CacheRollbackError, match="chunk of position 14"):
        caches.rollback([c], 6)
    assert c.offset == 20  # refused before anything changed
    caches.rollback([c], 4)
    assert c.offset == 16
