"""Per-round records and token kinds: what the draft proposed, what the target kept, and which
tokens are accepted guesses, corrections (regenerated) or the target's own — consistent with
the emitted tokens, in the API and in `generate --json`."""

from __future__ import annotations

import pytest
from test_greedy_equality import PROMPTS

from mlx_spec import generate, load_pair, stream


def replay(rounds) -> tuple[list[int], list[str]]:
    """The tokens and kinds the records say each round emitted."""
    tokens, kinds = [], []
    for r in rounds:
        out = (r.drafted[: r.accepted] + [r.token])[: r.emitted]
        tokens += out
        for i in range(len(out)):
            if i < r.accepted:
                kinds.append("accepted")
            else:
                kinds.append("regenerated" if r.kind == "correction" else "target")
    return tokens, kinds


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_records_rebuild_the_reply(pair, prompt, k):
    res = generate(pair, prompt, max_tokens=40, num_draft_tokens=k)
    tokens, kinds = replay(res.rounds)
    assert tokens == res.tokens and kinds == res.kinds
    assert len(res.rounds) == res.stats.target_passes
    assert res.accepted == [kind == "accepted" for kind in res.kinds]
    assert sum(r.accepted for r in res.rounds) >= res.stats.accepted
    assert {r.kind for r in res.rounds} <= {"correction", "bonus", "plain"}
    assert all(len(r.drafted) <= k for r in res.rounds)


def test_rejected_guesses_ride_on_the_correction(tiny_models):
    pair = load_pair(target=str(tiny_models.target), draft=str(tiny_models.noisy))
    events = list(stream(pair, PROMPTS[0], max_tokens=40, num_draft_tokens=4))
    corrections = [e for e in events if e.kind == "regenerated"]
    assert corrections and all(e.rejected and e.rejected[0] != e.token for e in corrections)
    assert not any(e.rejected for e in events if e.kind != "regenerated")


def test_plain_decoding_is_all_the_targets_own(pair):
    res = generate(pair, PROMPTS[1], max_tokens=12, use_draft=False)
    assert set(res.kinds) == {"target"} and {r.kind for r in res.rounds} == {"plain"}
    assert replay(res.rounds)[0] == res.tokens
