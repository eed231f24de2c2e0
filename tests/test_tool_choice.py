"""tool_choice naming a function (or required) constrains the call with the tools' schemas.

A random target with a JSON tool-call template (tests/tiny.py `write_babbling_tool_models`)
writes garbage when left alone; under the grammar (server/output.py `tool_grammar`) its call is
to the named function, its arguments validate against the function's `parameters`, and the call
is closed. Served with a draft and without one, greedy replies are identical (the grammar masks
target and draft alike)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import tiny
from test_server import serving

FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "boolean"},
    },
    "required": ["unit", "days", "alerts"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hour"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [tool("get_weather", {"type": "object"}), tool("forecast", FORECAST), tool("alarm", ALARM)]
ASK = [{"role": "user", "content": "Will it rain in Paris this week?"}]
NAMED = {"type": "function", "function": {"name": "forecast"}}


@pytest.fixture(scope="module")
def babblers(tmp_path_factory):
    return tiny.write_babbling_tool_models(tmp_path_factory.mktemp("babbler"))


def client_for(args: list[str], log_dir):
    with serving(args, log_dir) as (_, url):
        yield openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def spec(babblers, tmp_path_factory):
    target, draft = babblers
    args = ["--target", str(target), "--draft", str(draft), "--drafter", "model"]
    yield from client_for(args + ["--num-draft-tokens", "4"], tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def plain(babblers, tmp_path_factory):
    args = ["--target", str(babblers[0]), "--no-draft"]
    yield from client_for(args, tmp_path_factory.mktemp("plain"))


def ask(client, **kw):
    kw = {"model": "babbler", "messages": ASK, "tools": TOOLS, "max_tokens": 96, **kw}
    return client.chat.completions.create(**kw)


def only_call(resp):
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    (call,) = c.message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


def test_named_function_arguments_follow_its_schema_and_speculation_changes_nothing(spec, plain):
    resp = ask(spec, tool_choice=NAMED, temperature=0)
    name, args = only_call(resp)
    assert name == "forecast"
    jsonschema.validate(args, FORECAST)
    s = resp.model_extra["speculation"]
    assert s["drafted"] > 0 and s["forced_tokens"] > 0  # `}`, the end tag: drafted for free
    # greedy, speculation on and off: the same call, token for token
    off = ask(plain, tool_choice=NAMED, temperature=0)
    assert only_call(off) == (name, args)
    assert off.choices[0].message.tool_calls[0].function.arguments == (
        resp.choices[0].message.tool_calls[0].function.arguments
    )
    assert off.usage.completion_tokens == resp.usage.completion_tokens


def test_named_function_sampled_and_streamed(spec):
    chunks = list(ask(spec, tool_choice=NAMED, temperature=1.0, seed=3, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["forecast"]
    jsonschema.validate(json.loads(deltas[0].function.arguments), FORECAST)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_with_its_schema(spec):
    resp = ask(spec, tool_choice="required", temperature=0)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_schema_llguidance_cannot_compile_and_response_format_are_400(spec):
    broken = [*TOOLS, tool("broken", {"type": "object", "properties": {"a": {"type": "strin"}}})]
    with pytest.raises(openai.BadRequestError) as info:
        ask(spec, tools=broken, tool_choice="required")
    error = info.value.body
    assert error["param"] == "tools" and "'broken'" in error["message"]
    assert "strin" in error["message"]
    # only the constrained choices compile the schemas: auto answers
    assert ask(spec, tools=broken, max_tokens=4).choices[0].finish_reason
    with pytest.raises(openai.BadRequestError) as info:
        ask(spec, tool_choice=NAMED, response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"
    assert "named tool_choice" in info.value.body["message"]
