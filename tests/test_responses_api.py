"""OpenAI's Responses API (`/v1/responses`) on a real `mlx-spec serve`, driven by the `openai`
SDK's Responses client: plain and streamed text equal to `mlx_spec.generate`, the event
sequence, max_output_tokens (incomplete), text.format json_schema, function calls with a
forced tool_choice and their output fed back, previous_response_id continuing a stored
response (and another key's 404 for it).

Two servers: the tiny pair for text and JSON, and the tool-calling model of test_agents.py
(it thinks, then calls get_weather, and answers once the result is back), with two keys.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import tiny
from test_server import KEY, request, serving

from mlx_spec import generate

OTHER_KEY = "other-key"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER,
        "strict": True,
    }
]
ASK = "What is the weather in Paris?"
PET = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["fox", "dog"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["kind", "legs"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    args = [
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--drafter", "ngram+model", "--num-draft-tokens", "4", "--api-key", KEY,
    ]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("responses")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    target, draft = tiny.write_tool_model(tmp_path_factory.mktemp("tool"), draft_errors=2)
    args = [
        "--target", str(target), "--draft", str(draft), "--drafter", "model",
        "--num-draft-tokens", "3", "--api-key", KEY, "--api-key", OTHER_KEY,
    ]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("tool_server")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def tools(tool_server):
    return openai.OpenAI(base_url=tool_server, api_key=KEY, max_retries=0, timeout=60)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


STORY = "Tell me a story"


def test_a_response_equals_generate(client, pair):
    expected = generate(
        pair, [{"role": "system", "content": "Be brief."}, *chat(STORY)], max_tokens=40,
        temperature=0.0,
    )  # fmt: skip
    resp = client.responses.create(
        model="target",
        input=[{"role": "user", "content": [{"type": "input_text", "text": STORY}]}],
        instructions="Be brief.", max_output_tokens=40, temperature=0,
        prompt_cache_key="k", parallel_tool_calls=True, include=[], user="u", truncation="disabled",
    )  # fmt: skip
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == expected.text
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert resp.usage.output_tokens == len(expected.tokens)
    assert resp.usage.input_tokens == expected.stats.prompt_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    if expected.finish_reason == "length":
        assert resp.status == "incomplete"
        assert resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"


def test_a_streamed_response_and_its_events(client, pair):
    expected = generate(pair, chat(STORY), max_tokens=30, temperature=0.0)
    with client.responses.stream(
        model="target", input=STORY, max_output_tokens=30, temperature=0
    ) as stream:
        events = list(stream)
    # (the SDK's get_final_response wants response.completed; a reply cut by
    # max_output_tokens ends with response.incomplete, as OpenAI's own does)
    final = events[-1].response
    assert final.output[0].content[0].text == expected.text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        expected.text
    )
    names = [e.type for e in events]
    assert names[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    last = "response.incomplete" if expected.finish_reason == "length" else "response.completed"
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == len(expected.tokens)


def test_text_format_json_schema(client):
    resp = client.responses.create(
        model="target", input="Describe a pet", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}},
    )  # fmt: skip
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), PET)


def test_hosted_tools_are_left_out_and_images_are_400(client):
    # Codex sends web_search and `namespace` tools: left out of the prompt, named in a header
    raw = client.responses.with_raw_response.create(
        model="target", input="hi", max_output_tokens=2, temperature=0,
        tools=[{"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}],
    )  # fmt: skip
    assert raw.headers["x-ignored-fields"] == "tools[0]:web_search, tools[1]:namespace"
    assert raw.parse().usage.output_tokens == 2
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA"}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="target", input=[{"role": "user", "content": [image]}])


@pytest.mark.parametrize(
    "field",
    [
        {"metadata": "abc"},
        {"metadata": {"a": 1}},
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        {"metadata": {"k": "v" * 513}},
        {"user": {"id": 1}},
        {"prompt_cache_key": 5},
    ],
)
def test_fields_echoed_in_the_response_are_checked(client, field):
    """metadata and user are copied into the Response: a value OpenAI refuses was echoed
    (a body the SDK's strict model rejects). Now a 400 naming the field."""
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="target", input="hi", max_output_tokens=2, extra_body=field)
    assert next(iter(field)) in str(info.value)
    ok = client.responses.create(
        model="target", input="hi", max_output_tokens=2, metadata={"run": "7"}, user="u1"
    )
    assert ok.metadata == {"run": "7"} and ok.user == "u1"


def test_a_forced_function_call_then_its_output(tools):
    kwargs = dict(model="tool_target", tools=TOOLS, max_output_tokens=64, temperature=0)
    first = tools.responses.create(
        **kwargs, input=ASK, tool_choice={"type": "function", "name": "get_weather"}
    )
    calls = [i for i in first.output if i.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    # the whole history resent (as Codex does), the call's output last
    history = [
        {"role": "user", "content": ASK},
        *[i.model_dump(exclude_none=True) for i in first.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    second = tools.responses.create(**kwargs, input=history, store=False)
    assert second.output_text == tiny.ANSWER


def test_a_streamed_call_and_previous_response_id(tool_server, tools):
    with tools.responses.stream(
        model="tool_target", input=ASK, tools=TOOLS, max_output_tokens=64
    ) as stream:
        events = list(stream)
        first = stream.get_final_response()
    kinds = [i.type for i in first.output]
    assert kinds == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == tiny.THOUGHT
    call = first.output[1]
    assert json.loads(call.arguments) == {"city": "Paris"}
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    # continued from the stored response: only the call's output is sent
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = tools.responses.create(
        model="tool_target", tools=TOOLS, previous_response_id=first.id, input=[output]
    )
    assert second.output_text == tiny.ANSWER
    assert second.previous_response_id == first.id
    assert tools.responses.retrieve(second.id).output_text == tiny.ANSWER
    # another key sees none of it
    other = openai.OpenAI(base_url=tool_server, api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(
            model="tool_target", tools=TOOLS, previous_response_id=first.id, input=[output]
        )
    assert request("GET", f"{tool_server}/responses/{first.id}", key=OTHER_KEY).status_code == 404
