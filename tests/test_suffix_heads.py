"""Suffix decoding beside each head kind (`suffix+mtp`, `+eagle3`, `+dflash`, `+dspark`,
`+assistant`) and a draft model (`suffix+model`), one stream: the target's own tokens (greedy,
against mlx-lm's), with lookup rounds and the other drafter's rounds in the same reply; saved
to a file and loaded, it continues exactly.

The heads are test_heads_surfaces.py's: a tiny Qwen3.5 target (hybrid: rejected rounds
replay) with its MTP head and an EAGLE-3, DFlash and DSpark head over it; Gemma 4's assistant
over a tiny Gemma 4 target; the draft model is the tiny Llama pair's. The prompt holds the
start of the target's reply after its own text, then the text again: the first round is a
lookup draft the target partly accepts, and the rounds after it, where the match is short,
are the other drafter's."""

from __future__ import annotations

import pytest
from test_greedy_equality import PROMPTS, reference
from test_heads_surfaces import target_of, write_heads

from mlx_spec import generate, load_decoder, load_pair, make_decoder, save_decoder

KINDS = ["mtp", "eagle3", "dflash", "dspark", "assistant", "model"]
AGREE = {"mtp", "assistant", "model"}  # drafters that agree with their target often
TOKENS = 40
SEPARATOR = [10]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    return write_heads(tmp_path_factory.mktemp("suffix_heads"), tiny_models.tokenizer)


@pytest.fixture(scope="module")
def pairs(models, tiny_models):
    """kind -> its suffix+kind pair and the prompt, loaded once ("model": the tiny Llama
    target and its 2-layer draft)."""
    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            if kind == "model":
                target, draft = str(tiny_models.target), str(tiny_models.draft)
                pair = load_pair(target=target, draft=draft, drafter="suffix+model")
            else:
                target, head = str(target_of(models, kind)), str(models[kind])
                pair = load_pair(target=target, drafter=f"suffix+{kind}", head=head)
            text = pair.tokenizer.encode(PROMPTS[1])
            start = reference(pair, PROMPTS[1], 8)  # the target's own reply to `text`
            loaded[kind] = pair, text + start + SEPARATOR + text
        return loaded[kind]

    return get


def sources(decoder) -> list[list]:
    """Records each round's drafter on the decoder's SuffixDrafter: [source, k, accepted]
    with source "lookup" (its own lookup draft) or "head" (the inner drafter's proposal),
    accepted filled in when the round commits."""
    events = []
    drafter = decoder.drafter
    propose_lookup, propose, commit = drafter.propose_lookup, drafter.propose, drafter.commit

    def spy_lookup(k):
        events.append(["lookup", k, None])
        return propose_lookup(k)

    def spy_propose(k, *args, **kwargs):
        events.append(["head", k, None])
        return propose(k, *args, **kwargs)

    def spy_commit(kept, output=None):
        if events and events[-1][2] is None:  # a round's commit (plain steps commit too)
            events[-1][2] = len(kept) - 1
        return commit(kept, output)

    drafter.propose_lookup, drafter.propose, drafter.commit = spy_lookup, spy_propose, spy_commit
    return events


@pytest.mark.parametrize("k", [1, 3, "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_the_target_alone_with_lookup_and_head_rounds(pairs, kind, k):
    pair, prompt = pairs(kind)
    decoder = make_decoder(pair)
    events = sources(decoder)
    res = generate(pair, prompt, max_tokens=TOKENS, num_draft_tokens=k, decoder=decoder)
    assert res.tokens == reference(pair, prompt, TOKENS)
    assert res.stats.accepted == sum(res.accepted)
    if k == "auto":  # auto follows this machine's timings: which rounds draft varies
        return
    # the first round's lookup length does not depend on timings (no lookup round timed
    # yet), nor, after its rejection, that a short match leaves the round to the head
    lookups = [e for e in events if e[0] == "lookup"]
    heads = [e for e in events if e[0] == "head" and e[2] is not None]
    assert events[0][0] == "lookup" and events[0][2] >= 1, events
    assert heads and heads[0][1] == k and all(e[1] <= k for e in heads), events
    if kind in AGREE:
        assert sum(e[2] for e in heads) > 0, events
    print(kind, k, f"lookup rounds {len(lookups)}, accepted {sum(e[2] or 0 for e in lookups)};",
          f"head rounds {len(heads)}, accepted {sum(e[2] for e in heads)}")  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_suffix_head_conversation_continues_exactly(pairs, kind, tmp_path):
    """save_decoder / load_decoder (and the server's disk tier, which restores the same way)
    hand the head's state to the inner drafter; the lookup index is rebuilt from the next
    prompt. The next turn is the target's own, drafted, as the never-saved decoder's."""
    pair, prompt = pairs(kind)
    decoder = make_decoder(pair)
    first = generate(pair, prompt, max_tokens=12, num_draft_tokens=3, decoder=decoder)
    loaded = load_decoder(pair, save_decoder(decoder, tmp_path / "c.safetensors"))
    assert type(loaded.drafter) is type(decoder.drafter) and loaded.hidden_gap is None
    follow = prompt + first.tokens + pair.tokenizer.encode(" And then?")
    second = generate(pair, follow, max_tokens=16, num_draft_tokens=3, decoder=loaded)
    kept = generate(pair, follow, max_tokens=16, num_draft_tokens=3, decoder=decoder)
    assert second.tokens == kept.tokens == reference(pair, follow, 16)
    assert second.stats.drafted > 0
    assert second.stats.prompt_tokens_reused >= len(prompt)
