"""What Claude Code 2.1.197, Codex CLI 0.171.0 and OpenCode 1.18.33 sent and read when they
read a file through `mlx-spec serve` with their own tools (benchmarks/real_agents.py ran them
from npm), replayed with the official SDKs so the suite keeps them working without npm.

The model is tests/tiny.py's scripted one: asked about the file (tools offered) it thinks, says
a preamble and calls `Read`; with the tool's result back it answers quoting the file's marker;
on a resumed turn ("again") whose history holds the result it answers the same; else a plain
reply. Each turn is the shape the client sent: Claude Code's content blocks (a system-reminder
text block, the thinking block resent with an empty signature, a mid-conversation system turn,
`cache_control` on the last block), Codex's Responses items (developer messages, the
`<environment_context>` user turn, its reasoning item with `reasoning_text` and a null
`encrypted_content`, `function_call` and `function_call_output` with their ids, a `namespace`
and a `web_search` tool), OpenCode's chat messages (`reasoning_content` on the assistant turn,
the tool message with its `<path>`/`<content>` wrapping).
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import tiny
from test_server import KEY, serving

MARKER = "MARKER-7f3a"
PATH = "/work/project/notes-7f3a.txt"
PROMPT = "Read the file notes-7f3a.txt and quote its marker."
THOUGHT = "I should read the file."
PREAMBLE = "Let me read the file."
ANSWER = f"The file says: the marker is {MARKER}."
PLAIN = "Hello from the scripted model."
CALL = {"name": "Read", "arguments": {"file_path": PATH}}
SCHEMA = {
    "type": "object",
    "properties": {"file_path": {"type": "string", "description": "absolute path"}},
    "required": ["file_path"],
    "additionalProperties": False,
}
REMINDER = "<system-reminder>\nToday's date is 2026-12-05.\n</system-reminder>\n\n"
CAT_N = f"1\tThese notes are for the mlx-spec agent test.\n2\tThe marker is {MARKER}.\n3\t"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    model = tiny.write_scripted_tool_model(
        root, CALL, ANSWER, trigger="notes-7f3a.txt", plain=PLAIN, thought=THOUGHT,
        preamble=PREAMBLE,
    )  # fmt: skip
    args = ["--target", str(model), "--drafter", "ngram", "--api-key", KEY]
    args += ["--max-tokens-limit", "256"]
    with serving(args, root) as (_, url):
        yield url


@pytest.fixture(scope="module")
def claude(server):
    base = server.removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def test_claude_code_reads_a_file_and_resumes(claude):
    tools = [{"name": "Read", "description": "Reads a file.", "input_schema": SCHEMA}]
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.abc;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ]
    blocks = [{"type": "text", "text": REMINDER}, {"type": "text", "text": PROMPT}]
    ask = {"role": "user", "content": blocks}
    extra = {
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }
    common = dict(model="scripted", max_tokens=32000, system=system, tools=tools, extra_body=extra)
    with claude.messages.stream(messages=[ask], **common) as s:
        first = s.get_final_message()
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = first.content
    assert thinking.thinking == THOUGHT and text.text == PREAMBLE
    assert use.name == "Read" and use.input == {"file_path": PATH}
    # sent back as Claude Code does: the thinking block with an empty signature, a
    # mid-conversation system turn, the result in cat -n form
    said = [
        {"type": "thinking", "thinking": THOUGHT, "signature": ""},
        {"type": "text", "text": PREAMBLE},
        {"type": "tool_use", "id": use.id, "name": "Read", "input": use.input},
    ]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": CAT_N}
    history = [
        ask,
        {"role": "system", "content": "Available agent types: general-purpose."},
        {"role": "assistant", "content": said},
        {"role": "user", "content": [result]},
    ]
    with claude.messages.stream(messages=history, **common) as s:
        second = s.get_final_message()
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["text"] and MARKER in second.content[0].text
    again = {
        "type": "text",
        "text": "Say the marker again.",
        "cache_control": {"type": "ephemeral"},
    }
    history += [
        {"role": "assistant", "content": [{"type": "text", "text": second.content[0].text}]},
        {"role": "user", "content": [again]},
    ]
    third = claude.messages.create(messages=history, **common)
    assert third.content[0].text == ANSWER
    assert third.usage.cache_read_input_tokens > 0  # the resumed prefix came from the cache
    # a plain question: no call
    plain = claude.messages.create(messages=[{"role": "user", "content": "Say hello."}], **common)
    assert plain.stop_reason == "end_turn" and plain.content[-1].text == PLAIN


def test_codex_reads_a_file_and_resumes(oai):
    tools = [
        {"type": "function", "name": "Read", "description": "Reads a file.",
         "strict": False, "parameters": SCHEMA},
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
         "tools": []},
        {"type": "web_search", "external_web_access": False},
    ]  # fmt: skip
    items = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent in the Codex CLI."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
         "text": "<environment_context>\n  <cwd>/work/project</cwd>\n</environment_context>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": PROMPT}]},
    ]  # fmt: skip
    extra = {
        "client_metadata": {"session_id": "s1"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "s1",
    }
    common = dict(
        model="scripted", tools=tools, tool_choice="auto", parallel_tool_calls=True,
        reasoning={"summary": "auto"}, store=False, extra_body=extra,
    )  # fmt: skip

    def turn(history):
        events = list(oai.responses.create(input=history, stream=True, **common))
        assert events[-1].type == "response.completed"
        return [i.model_dump(exclude_none=False) for i in events[-1].response.output]

    out = turn(items)
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    reasoning, message, call = out
    assert reasoning["content"][0] == {"type": "reasoning_text", "text": THOUGHT}
    assert message["content"][0]["text"] == PREAMBLE
    assert call["name"] == "Read" and json.loads(call["arguments"]) == {"file_path": PATH}
    # resent whole, as Codex does (store: false): its reasoning item with a null
    # encrypted_content, the call with its id and status, the output
    reasoning = {k: reasoning[k] for k in ("type", "id", "summary", "content")}
    reasoning["encrypted_content"] = None
    sent_call = {k: call[k] for k in ("type", "id", "status", "name", "arguments", "call_id")}
    output = {
        "type": "function_call_output", "id": "fco_1", "call_id": call["call_id"],
        "output": f"Process exited with code 0\nOutput:\nThe marker is {MARKER}.\n",
    }  # fmt: skip
    items += [reasoning, {**message, "id": message["id"]}, sent_call, output]
    out = turn(items)
    assert [i["type"] for i in out] == ["message"]
    assert out[0]["content"][0]["text"] == ANSWER
    # `codex exec resume --last`: the same items and a new user turn
    items += [
        {k: out[0][k] for k in ("type", "id", "role", "content")},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Say the marker again."}]},
    ]  # fmt: skip
    out = turn(items)
    assert out[-1]["content"][0]["text"] == ANSWER


def test_opencode_reads_a_file_and_resumes(oai):
    tools = [
        {"type": "function", "function": {"name": "Read", "description": "Reads a file.",
                                          "parameters": SCHEMA}},
    ]  # fmt: skip
    ask = [
        {"role": "system", "content": "You are opencode, an interactive CLI tool."},
        {"role": "user", "content": PROMPT},
    ]
    opts = dict(model="scripted", max_tokens=32000, tools=tools, tool_choice="auto")
    opts |= dict(stream=True, stream_options={"include_usage": True})

    def turn(messages):
        chunks = list(oai.chat.completions.create(messages=messages, **opts))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.tool_calls or []]
        assert chunks[-1].usage is not None
        return content, reasoning, calls

    content, reasoning, calls = turn(ask)
    assert (content, reasoning) == (PREAMBLE, THOUGHT)
    (call,) = calls
    assert call.function.name == "Read"
    assert json.loads(call.function.arguments) == {"file_path": PATH}
    result = f"<path>{PATH}</path>\n<type>file</type>\n<content>\n2: The marker is {MARKER}.\n"
    history = ask + [
        {"role": "assistant", "content": PREAMBLE, "reasoning_content": THOUGHT,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "Read", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result + "</content>"},
    ]  # fmt: skip
    content, _, calls = turn(history)
    assert content == ANSWER and not calls
    history += [
        {"role": "assistant", "content": content},
        {"role": "user", "content": "Say the marker again."},
    ]
    content, _, calls = turn(history)
    assert content == ANSWER and not calls
    # OpenCode's title request: the same prompt, no tools: the plain reply, no call as text
    title = oai.chat.completions.create(
        model="scripted",
        messages=[{"role": "system", "content": "You are a title generator."}, ask[1]],
    )
    assert title.choices[0].message.content == PLAIN
