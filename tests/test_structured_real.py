"""Structured output on the real SmolLM2-135M (the demo GGUF): every configuration — plain
constrained decoding, forced tokens alone, forced + the demo's shipped head, forced + the 4-bit
draft model, forced + prompt lookup — gives the tokens of the independent constrained
reference, and valid JSON."""

from __future__ import annotations

import json

import pytest
from test_structured import reference

from mlx_spec import generate, load_pair

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "field": {"enum": ["mathematics", "poetry", "engineering"]},
        "known_for": {"type": "array", "items": {"type": "string"}, "maxItems": 1},
    },
    "required": ["name", "born", "field", "known_for"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe Ada Lovelace as JSON."}]


@pytest.fixture(scope="module")
def demo():
    return load_pair("smollm2-demo")  # the shipped EAGLE-3 head


@pytest.fixture(scope="module")
def own():
    return load_pair("smollm2-self")  # the 4-bit self-draft


@pytest.fixture(scope="module")
def alone():
    return load_pair("smollm2-demo", skip_draft=True)  # the target alone: forced tokens only


@pytest.fixture(scope="module")
def lookup():
    return load_pair("smollm2-lookup")


def test_every_configuration_equals_plain_constrained_decoding(demo, own, alone, lookup):
    text = demo.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected, finish = reference(demo, text, "schema", PERSON, 120)
    assert finish == "stop", "the reply should complete within 120 tokens"
    value = json.loads(demo.tokenizer.decode(expected))
    assert set(value) == set(PERSON["required"]) and value["field"] in {
        "mathematics", "poetry", "engineering",
    }  # fmt: skip
    runs = {
        "plain": generate(alone, MESSAGES, max_tokens=120, schema=PERSON, use_draft=False),
        "forced": generate(alone, MESSAGES, max_tokens=120, schema=PERSON),
        "forced+head": generate(demo, MESSAGES, max_tokens=120, schema=PERSON, num_draft_tokens=3),
        "forced+model": generate(own, MESSAGES, max_tokens=120, schema=PERSON, num_draft_tokens=3),
        "forced+lookup": generate(lookup, MESSAGES, max_tokens=120, schema=PERSON),
        "model, no forced": generate(
            own, MESSAGES, max_tokens=120, schema=PERSON, num_draft_tokens=3, forced_tokens=False
        ),
        "head, no forced": generate(
            demo, MESSAGES, max_tokens=120, schema=PERSON, num_draft_tokens=3, forced_tokens=False
        ),
    }  # fmt: skip
    for name, res in runs.items():
        assert res.tokens == expected, name
        assert res.finish_reason == "stop", name
        assert json.loads(res.text) == value, name
    assert runs["plain"].stats.forced_drafted == 0
    assert runs["model, no forced"].stats.forced_drafted == 0
    assert runs["head, no forced"].stats.forced_drafted == 0
    assert runs["head, no forced"].stats.accepted > 0
    for name in ("forced", "forced+head", "forced+model", "forced+lookup"):
        stats = runs[name].stats
        # keys, quotes, separators and the rest of the enum value are forced
        assert stats.forced_tokens >= len(expected) // 4, (name, stats.forced_tokens)
        assert stats.tokens_per_target_pass > runs["plain"].stats.tokens_per_target_pass


def test_sampled_replies_are_valid_json(demo):
    # one sample (~9 s here): the sampled distribution's exactness is test_structured's
    res = generate(demo, MESSAGES, max_tokens=100, schema=PERSON, temperature=0.8, seed=0)
    if res.finish_reason == "stop":
        value = json.loads(res.text)
        assert set(value) == set(PERSON["required"])
    else:  # cut by max_tokens: said so, never passed off as complete
        assert res.finish_reason == "length" and len(res.tokens) == 100
