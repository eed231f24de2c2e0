"""`mlx-spec serve` with response_format: json_object and json_schema, chat and completions,
streamed or not, through the official `openai` client; the replies equal plain constrained
decoding (test_structured.reference, written on mlx-lm and llguidance directly)."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from test_server import KEY, chat, request, serving
from test_structured import reference

PET = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["fox", "dog", "capital"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 9},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["kind", "legs", "name"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": PET, "strict": True},
}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-server")
    args = [
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--drafter", "ngram+model", "--num-draft-tokens", "4", "--api-key", KEY,
    ]  # fmt: skip
    with serving(args, root) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def chat_text(pair, messages) -> str:
    return pair.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def collect(chunks, kind: str):
    chunks = list(chunks)
    if kind == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", ["Describe a pet", "The quick brown fox"])
def test_chat_json_schema_equals_plain_constrained_decoding(client, pair, text, stream):
    messages = chat(text)
    tokens, finish = reference(pair, chat_text(pair, messages), "schema", PET, 60)
    kwargs = dict(
        model="target", messages=messages, max_tokens=60, temperature=0,
        response_format=SCHEMA_FORMAT,
    )  # fmt: skip
    if stream:
        out, got = collect(client.chat.completions.create(**kwargs, stream=True), "chat")
    else:
        resp = client.chat.completions.create(**kwargs)
        out, got = resp.choices[0].message.content, resp.choices[0].finish_reason
        assert resp.model_extra["speculation"]["forced_tokens"] > 0
    assert out == pair.tokenizer.decode(tokens) and got == finish
    if finish == "stop":
        value = json.loads(out)
        assert (
            set(value) == {"kind", "legs", "name"}
            and value["kind"] in PET["properties"]["kind"]["enum"]
        )


@pytest.mark.parametrize("stream", [False, True])
def test_completion_json_object_equals_plain_constrained_decoding(client, pair, stream):
    prompt = "Paris is the capital of"
    tokens, finish = reference(pair, prompt, "schema", {"type": "object"}, 40)
    kwargs = dict(
        model="target", prompt=prompt, max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    if stream:
        out, got = collect(client.completions.create(**kwargs, stream=True), "completion")
    else:
        resp = client.completions.create(**kwargs)
        out, got = resp.choices[0].text, resp.choices[0].finish_reason
    assert out == pair.tokenizer.decode(tokens) and got == finish
    assert out.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(out), dict)


def test_a_reply_cut_by_max_tokens_says_length(client, pair):
    messages = chat("Describe a pet")
    full, _ = reference(pair, chat_text(pair, messages), "schema", PET, 60)
    resp = client.chat.completions.create(
        model="target", messages=messages, max_tokens=5, temperature=0,
        response_format=SCHEMA_FORMAT,
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == pair.tokenizer.decode(full[:5])


@pytest.mark.parametrize("stream", [False, True])
def test_log_probabilities_under_a_schema_are_finite_json(client, pair, stream):
    """Where the schema allows few tokens, the top log-probabilities include masked ones
    (-inf): they are sent as OpenAI's floor, -9999.0 (once a non-streamed reply failed to
    encode as JSON: a 500). The reply is the constrained target's."""
    messages = chat("Describe a pet")
    full, _ = reference(pair, chat_text(pair, messages), "schema", PET, 60)
    resp = client.chat.completions.create(
        model="target", messages=messages, max_tokens=12, temperature=0, stream=stream,
        response_format=SCHEMA_FORMAT, logprobs=True, top_logprobs=8,
    )  # fmt: skip
    choices = [c.choices[0] for c in resp if c.choices] if stream else resp.choices
    text = "".join((c.delta.content if stream else c.message.content) or "" for c in choices)
    assert text == pair.tokenizer.decode(full[:12])
    entries = [e for c in choices if c.logprobs for e in c.logprobs.content]
    values = [t.logprob for e in entries for t in [e, *e.top_logprobs]]
    assert len(entries) == 12 and all(-9999.0 <= v <= 0.0 for v in values)
    assert -9999.0 in values  # (a forced token's alternatives are masked)


def test_the_openai_client_parses_into_a_pydantic_model(client):
    class Pet(BaseModel):
        kind: Literal["fox", "dog"]
        legs: Literal[2, 4]

    resp = client.chat.completions.parse(
        model="target", messages=chat("Describe a pet"), response_format=Pet, temperature=0.7,
        seed=3, max_tokens=40,
    )  # fmt: skip
    pet = resp.choices[0].message.parsed
    assert isinstance(pet, Pet) and resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "response_format, param, words",
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
         "response_format", "cannot be compiled"),
        ({"type": "xml"}, "response_format.type", "json_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}},
         "response_format.json_schema.schema", "schema"),
        ({"type": "json_schema"}, "response_format.json_schema", "schema"),
        ({"type": "json_object", "schema": {}}, "response_format.schema", "unsupported"),
        ("json", "response_format", "object"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_bad_response_formats_are_one_400(server, endpoint, response_format, param, words):
    body = {"model": "target", "max_tokens": 5, "response_format": response_format}
    body.update({"messages": chat("hi")} if endpoint.startswith("chat") else {"prompt": "hi"})
    r = request("POST", f"{server}/{endpoint}", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"]


def test_stop_strings_cannot_cut_the_json(server):
    body = {
        "model": "target", "messages": chat("hi"), "stop": ["}"],
        "response_format": {"type": "json_object"},
    }  # fmt: skip
    r = request("POST", f"{server}/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_plain_requests_after_structured_ones_are_unconstrained(client, pair):
    """The grammar belongs to its request: a kept decoder serves the next one freely."""
    from mlx_spec import generate

    messages = chat("The quick brown fox")
    client.chat.completions.create(
        model="target", messages=messages, max_tokens=20, temperature=0,
        response_format=SCHEMA_FORMAT,
    )  # fmt: skip
    resp = client.chat.completions.create(
        model="target", messages=messages, max_tokens=20, temperature=0
    )
    expected = generate(pair, messages, max_tokens=20, temperature=0, use_draft=False)
    assert resp.choices[0].message.content == expected.text
