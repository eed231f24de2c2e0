"""Anthropic's Messages API (`/v1/messages`) on a real `mlx-spec serve`, driven by the official
`anthropic` SDK: plain and streamed text equal to `mlx_spec.generate` (and to the same prompt
through chat completions and the Responses API), count_tokens, stop_sequences, tools with a
forced tool_choice whose streamed `input_json_delta` the SDK assembles, a tool_result fed
back, errors in Anthropic's shape.

Two servers: the tiny pair (lookup then the tiny draft) for text, and the tool-calling model
of test_agents.py (it thinks, then calls get_weather, and answers once the result is back).
"""

from __future__ import annotations

import http.client
import json

import anthropic
import jsonschema
import openai
import pytest
import tiny
from test_server import KEY, serving

from mlx_spec import generate

OTHER_KEY = "other-key"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0}  # (the SDK has no sampling parameters any more: sent as extra_body)
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    args = [
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--drafter", "ngram+model", "--num-draft-tokens", "4", "--api-key", KEY,
        "--api-key", OTHER_KEY,
    ]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("messages")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    base = server.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    target, draft = tiny.write_tool_model(tmp_path_factory.mktemp("tool"), draft_errors=2)
    args = [
        "--target", str(target), "--draft", str(draft), "--drafter", "model",
        "--num-draft-tokens", "3", "--api-key", KEY,
    ]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("tool_server")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def tools(tool_server):
    base = tool_server.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def raw(url: str, path: str, body: dict, headers: dict) -> tuple[int, str]:
    host, _, port = url.removeprefix("http://").split("/")[0].rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", **headers}
        )
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


PROMPT = "The quick brown fox"
STORY = "Tell me a story"  # (the tiny target's reply to it is more than U+FFFD)


def test_a_message_equals_generate(client, pair):
    expected = generate(pair, chat(PROMPT), max_tokens=40, temperature=0.0)
    msg = client.messages.create(
        model="target", max_tokens=40, messages=chat(PROMPT), extra_body=GREEDY, system="",
        metadata={"user_id": "u1"},
    )  # fmt: skip
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == expected.text
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert msg.usage.output_tokens == len(expected.tokens)
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == expected.stats.prompt_tokens
    assert msg.model_extra["speculation"]["drafted"] > 0


def test_a_streamed_message_and_its_events(client, server, pair):
    expected = generate(pair, chat("Paris is the capital of"), max_tokens=30, temperature=0.0)
    kwargs = dict(model="target", max_tokens=30, messages=chat("Paris is the capital of"))
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.text == final.content[0].text
    assert final.usage.output_tokens == len(expected.tokens)
    # the wire: an `event:` line per event, in Anthropic's order
    status, body = raw(server, "/v1/messages", {**kwargs, "stream": True}, {"x-api-key": KEY})
    assert status == 200
    names = [line[7:] for line in body.splitlines() if line.startswith("event: ")]
    names = [n for n in names if n != "ping"]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert body.count("data: ") == body.count("event: ")


def test_count_tokens(client, pair):
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    counted = client.messages.count_tokens(model="target", messages=messages, system="Be brief.")
    full = [{"role": "system", "content": "Be brief."}, *chat(PROMPT)]
    assert counted.input_tokens == generate(pair, full, max_tokens=1).stats.prompt_tokens


def test_stop_sequences(client, pair):
    text = generate(pair, chat(STORY), max_tokens=40, temperature=0.0).text
    at = next(
        i
        for i in range(1, len(text) - 3)
        if text.index(text[i : i + 3]) == i and "\ufffd" not in text[i : i + 3]
    )
    stop = text[at : at + 3]  # its first occurrence is after some text
    msg = client.messages.create(
        model="target",
        max_tokens=40,
        messages=chat(STORY),
        extra_body=GREEDY,
        stop_sequences=[stop],
    )
    assert msg.content[0].text == text[:at]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


def test_the_same_greedy_reply_through_every_endpoint(client, server, pair):
    """Speculation is lossless whichever protocol asks: chat completions, Messages and
    Responses give mlx_spec.generate's reply, token for token."""
    expected = generate(pair, chat("Tell me a story"), max_tokens=48, temperature=0.0)
    oa = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)
    via_chat = oa.chat.completions.create(
        model="target", messages=chat("Tell me a story"), max_tokens=48, temperature=0
    )
    via_messages = client.messages.create(
        model="target", max_tokens=48, messages=chat("Tell me a story"), extra_body=GREEDY
    )
    via_responses = oa.responses.create(
        model="target", input="Tell me a story", max_output_tokens=48, temperature=0
    )
    texts = [
        via_chat.choices[0].message.content,
        via_messages.content[0].text,
        via_responses.output_text,
    ]
    assert texts == [expected.text] * 3
    counts = [
        via_chat.usage.completion_tokens,
        via_messages.usage.output_tokens,
        via_responses.usage.output_tokens,
    ]
    assert counts == [len(expected.tokens)] * 3


def test_an_image_is_refused_in_anthropics_shape(client):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="target", max_tokens=8,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}],
        )  # fmt: skip
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]


def test_keys_and_errors(server, client):
    base = server.removesuffix("/v1")
    wrong = anthropic.Anthropic(base_url=base, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="target", max_tokens=4, messages=chat("hi"))
    assert info.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=base, auth_token=OTHER_KEY, max_retries=0)
    assert bearer.messages.create(model="target", max_tokens=4, messages=chat("hi")).content
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-pair", max_tokens=4, messages=chat("hi"))
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:  # max_tokens is required
        client.post("/v1/messages", body={"model": "target", "messages": chat("hi")}, cast_to=dict)
    assert "max_tokens" in info.value.body["error"]["message"]
    status, body = raw(server, "/v1/messages/nothing", {}, {"x-api-key": KEY})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_a_tool_call_then_its_result(tools):
    msg = tools.messages.create(model="tool_target", max_tokens=64, messages=ASK, tools=TOOLS)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == tiny.THOUGHT
    call = msg.content[1]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "Paris"} and msg.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id, "content": '{"sky": "sunny"}'}
    history = [
        *ASK,
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [result]},
    ]
    answer = tools.messages.create(
        model="tool_target", max_tokens=64, messages=history, tools=TOOLS
    )
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == tiny.ANSWER and answer.stop_reason == "end_turn"


def test_a_forced_tool_streamed_is_assembled_by_the_sdk(tools):
    kwargs = dict(
        model="tool_target", max_tokens=64, messages=ASK, tools=TOOLS, extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    with tools.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert partial and all(isinstance(p, str) for p in partial)
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_weather" and final.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER)
    assert json.loads("".join(partial)) == call.input
    plain = tools.messages.create(**kwargs)
    assert [b.input for b in plain.content if b.type == "tool_use"] == [call.input]
    with pytest.raises(anthropic.BadRequestError):  # a tool that is not in tools
        tools.messages.create(**{**kwargs, "tool_choice": {"type": "tool", "name": "nope"}})


def test_a_stop_sequence_the_tool_call_holds_is_not_its_stop_reason(tools):
    """A stop string inside a tool call's text ends it as a tool call: stop_reason tool_use,
    stop_sequence null, as Anthropic's format has it (the stop string was sent along)."""
    kwargs = dict(
        model="tool_target", max_tokens=64, messages=ASK, tools=TOOLS, extra_body=GREEDY,
        stop_sequences=["</tool_call>"],
    )  # fmt: skip
    msg = tools.messages.create(**kwargs)
    with tools.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    for got in (msg, final):
        assert got.stop_reason == "tool_use" and got.stop_sequence is None
        assert [b.input for b in got.content if b.type == "tool_use"] == [{"city": "Paris"}]


def test_a_tool_whose_input_is_not_an_object_is_refused(tools):
    """Its call streamed the bare value (the SDK made `input` None, refused when sent back)
    and the whole body wrapped it: Anthropic's rule, type object, now says it at once."""
    for schema in ({"type": "integer"}, {"type": "null"}, {"type": "array"}):
        with pytest.raises(anthropic.BadRequestError) as info:
            tools.messages.create(
                model="tool_target", max_tokens=8, messages=ASK,
                tools=[{"name": "count", "input_schema": schema}],
            )  # fmt: skip
        assert "type object" in info.value.body["error"]["message"]


def test_a_final_assistant_turn_is_continued(client, pair):
    """Anthropic's prefill: a conversation that ends with the assistant's text is continued
    from it (the reply holds only what follows), streamed and not, as the target continues
    the chat template's own continue_final_message rendering; trailing whitespace is refused
    as Anthropic refuses it. (A new assistant turn was started after it.)"""
    turns = [*chat(STORY), {"role": "assistant", "content": "The"}]  # (a reply not all U+FFFD)
    text = pair.tokenizer.apply_chat_template(turns, tokenize=False, continue_final_message=True)
    assert text.endswith("The")
    ids = pair.tokenizer.encode(text, add_special_tokens=False)
    want = generate(pair, ids, max_tokens=10, temperature=0.0).text
    kwargs = dict(model="target", max_tokens=10, messages=turns, extra_body=GREEDY)
    msg = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert msg.content[0].text == final.content[0].text == want
    assert "ed" in want and msg.usage.output_tokens == 10
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(ids)
    counted = client.messages.count_tokens(model="target", messages=turns)
    assert counted.input_tokens == len(ids)
    spaced = [*chat(STORY), {"role": "assistant", "content": "The "}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**{**kwargs, "messages": spaced})
    assert "trailing whitespace" in info.value.body["error"]["message"]
    forced = {**kwargs, "tools": TOOLS, "tool_choice": {"type": "any"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**forced)
    assert "cannot be continued" in info.value.body["error"]["message"]


def test_a_system_turn_mid_conversation(client, pair):
    """Claude Code sends `system` turns inside messages: they reach the template in place."""
    turns = [*chat("Hello"), {"role": "assistant", "content": "Hi"}, *chat(STORY)]
    sent = [*turns[:2], {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    expected = generate(
        pair, [*turns[:2], {"role": "system", "content": "Be brief."}, turns[2]], max_tokens=12,
        temperature=0.0,
    )  # fmt: skip
    msg = client.messages.create(
        model="target", max_tokens=12, messages=[*sent, turns[2]], extra_body=GREEDY
    )
    assert msg.content[0].text == expected.text
