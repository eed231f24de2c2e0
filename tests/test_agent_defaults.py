"""What coding agents need out of the box (issue 57), on a real `mlx-spec serve` driven by the
`openai` and `anthropic` SDKs: a max_tokens above --max-tokens-limit clamped (Claude Code
always asks 32000), Claude Code's per-request attribution block kept out of the prompt (so a
second session reads the system prompt from the cache), each protocol's over-length error,
the context window in /v1/models, a Messages stream whose usage agrees between
message_start and message_delta (also after keep-alives), x-should-retry: false on a 401.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading

import anthropic
import openai
import pytest
import tiny
from conftest import VOCAB
from test_server import KEY, request, serving

from mlx_spec import generate, load_pair
from mlx_spec.decode.prompts import encode_prompt

LIMIT = 24  # --max-tokens-limit
CONTEXT = 8192
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"
GREEDY = {"temperature": 0}  # (the SDK has no sampling parameters any more: sent as extra_body)
SYSTEM = " ".join(f"Rule {i}: keep the answer short and name the file you read." for i in range(30))


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory):
    """The tiny target with a longer context and <|im_end|> never chosen: replies run to
    max_tokens, so a clamp shows."""
    cfg = {**tiny.llama_config(VOCAB, layers=4), "max_position_embeddings": CONTEXT}
    weights = tiny.random_weights(cfg, seed=0)
    weights["lm_head.weight"][2] = 0
    root = tmp_path_factory.mktemp("agent_model")
    return tiny.write_model(root / "agent", cfg, weights, tiny_models.tokenizer)


@pytest.fixture(scope="module")
def pair(model):
    return load_pair(target=str(model), draft=None)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    args = [
        "--target", str(model), "--no-draft", "--api-key", KEY,
        "--max-tokens-limit", str(LIMIT),
    ]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("agent_server")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def unlimited(model, tmp_path_factory):
    """One request at a time and no cap on replies: a long one holds the engine."""
    args = ["--target", str(model), "--no-draft", "--api-key", KEY, "--max-batch", "1",
            "--keepalive", "0.2"]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("unlimited_server")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(
        base_url=server.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def test_max_tokens_above_the_limit_is_clamped_not_refused(claude, oai, pair):
    ask = [{"role": "user", "content": "Write a long story"}]
    expected = generate(pair, ask, max_tokens=LIMIT, temperature=0.0)
    assert expected.finish_reason == "length"  # the model cannot stop: the clamp must
    msg = claude.messages.create(model="agent", max_tokens=32000, messages=ask, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == LIMIT
    assert msg.content[0].text == expected.text
    resp = oai.chat.completions.create(model="agent", messages=ask, max_tokens=32000, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == LIMIT
    assert resp.choices[0].message.content == expected.text


def test_claude_code_attribution_block_is_not_in_the_prompt(claude, pair):
    """Two sessions whose billing blocks differ (Claude Code's suffix changes every prompt):
    the second reads all but its last message from the prompt cache, and the model never sees
    the block (the reply is the one to the system prompt without it)."""
    question = [{"role": "user", "content": "Which file?"}]
    replies = []
    for suffix in ("0c0", "9f3"):
        system = [
            {"type": "text", "text": BILLING.format(suffix)},
            {"type": "text", "text": SYSTEM},
        ]
        replies.append(
            claude.messages.create(
                model="agent", max_tokens=4, system=system, messages=question, extra_body=GREEDY
            )
        )
    first, second = replies
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= 0.95 * total, second.usage
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == total
    plain = [{"role": "system", "content": SYSTEM}, *question]
    expected = generate(pair, plain, max_tokens=4, temperature=0.0)
    assert first.content[0].text == second.content[0].text == expected.text
    assert total == expected.stats.prompt_tokens
    # a string system prompt whose first line is the block: dropped the same way
    string = BILLING.format("abc") + "\n" + SYSTEM
    counted = claude.messages.count_tokens(model="agent", system=string, messages=question)
    assert counted.input_tokens == total


def test_each_protocol_says_too_long_its_own_way(claude, oai, pair):
    words = "alpha beta gamma delta " * (CONTEXT // 3)  # more tokens than the context
    ask = [{"role": "user", "content": words}]
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="agent", max_tokens=8, messages=ask)
    message = info.value.body["error"]["message"]
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
    assert found, message  # the words Claude Code compacts on
    n = len(encode_prompt(pair.tokenizer, ask, None, None))
    assert (int(found[1]), int(found[2])) == (n, CONTEXT)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="agent", max_tokens=8, messages=ask)
    assert info.value.code == "context_length_exceeded"
    assert info.value.body["param"] == "messages"
    assert f"{n} tokens" in info.value.body["message"]


def test_models_say_the_context_window_in_each_clients_shape(claude, oai, server):
    (entry,) = [m for m in oai.models.list().data if m.id == "agent"]
    assert entry.model_extra["max_model_len"] == CONTEXT  # vLLM's name (Codex, LiteLLM)
    assert entry.model_extra["max_context_length"] == CONTEXT  # LM Studio's
    assert entry.model_extra["max_tokens"] == LIMIT
    page = claude.models.list()
    (info,) = [m for m in page.data if m.id == "agent"]
    assert info.type == "model" and info.display_name == "agent"
    assert info.max_input_tokens == CONTEXT and info.max_tokens == LIMIT
    assert page.has_more is False


def sse_events(raw: bytes) -> list[tuple[str, dict | None]]:
    """A stream's parts in order: ("comment", None) or (event name, data)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        if block.startswith(":"):
            out.append(("comment", None))
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def stream_message(url: str, body: dict, on_headers=None) -> list:
    host, _, port = url.removeprefix("http://").split("/")[0].rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", "x-api-key": KEY}
    conn.request("POST", "/v1/messages", json.dumps({**body, "stream": True}), headers)
    r = conn.getresponse()
    assert r.status == 200
    if on_headers is not None:
        on_headers()
    data = r.read()
    conn.close()
    return sse_events(data)


def usage_of(events) -> tuple[dict, dict]:
    (start,) = [d["message"]["usage"] for e, d in events if e == "message_start"]
    (end,) = [d["usage"] for e, d in events if e == "message_delta"]
    return start, end


def test_stream_usage_agrees_between_start_and_end(server):
    body = {
        "model": "agent",
        "max_tokens": 6,
        "system": "Streams are tested here. " + SYSTEM,  # (not cached by another test)
        "messages": [{"role": "user", "content": "Summarise the rules"}],
    }
    for cached in (False, True):  # the second reads the first's prompt from the cache
        events = stream_message(server, body)
        assert events[0][0] == "message_start"
        start, end = usage_of(events)
        assert start["input_tokens"] == end["input_tokens"]
        assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"]
        total = start["input_tokens"] + start["cache_read_input_tokens"]
        assert (start["cache_read_input_tokens"] > 0.9 * total) == cached, start
        assert end["output_tokens"] == 6


def test_a_waiting_stream_gets_comments_then_a_message_start_that_agrees(unlimited):
    """A stream queued behind another (--max-batch 1) gets its headers and keep-alives while
    it waits: SSE comments before message_start (whose usage needs the prefill), pings after
    it never precede it."""
    server = unlimited
    host, _, port = server.removeprefix("http://").split("/")[0].rpartition(":")
    blocker = socket.create_connection((host, int(port)))
    long = json.dumps({"model": "agent", "prompt": "The", "max_tokens": 5000, "stream": True})
    blocker.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(long)}\r\n\r\n{long}".encode()
    )
    blocker.recv(1024)  # its first bytes: it runs, for seconds, until its client leaves

    def drain():  # read on: a client that stops reading is cut after --send-timeout
        with contextlib.suppress(OSError):
            while blocker.recv(1 << 16):
                pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    waited = threading.Event()

    def free_the_engine():
        waited.set()
        blocker.shutdown(socket.SHUT_RDWR)  # the client leaves: its generation stops
        reader.join(10)
        blocker.close()

    body = {"model": "agent", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    events = stream_message(server, body, on_headers=free_the_engine)
    assert waited.is_set()
    names = [e for e, _ in events]
    first = names.index("message_start")
    assert first > 0 and set(names[:first]) == {"comment"}  # it waited, with comments
    start, end = usage_of(events)
    for figure in ("input_tokens", "cache_read_input_tokens"):
        assert start[figure] == end[figure]
    assert names[-1] == "message_stop"


def test_a_wrong_key_says_do_not_retry(server):
    """Claude Code retried a 401 eight times over 75 s; the header tells it (and the SDKs)
    that a wrong key stays wrong."""
    host, _, port = server.removeprefix("http://").split("/")[0].rpartition(":")
    for path, headers in (("/v1/models", {"Authorization": "Bearer wrong"}),
                          ("/v1/messages", {"x-api-key": "wrong"})):  # fmt: skip
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST" if "messages" in path else "GET", path, "{}", headers)
        r = conn.getresponse()
        assert r.status == 401 and r.getheader("x-should-retry") == "false"
        conn.close()


def test_an_unknown_stored_response_names_the_path_parameter(server):
    r = request("GET", server + "/responses/resp_nothing")
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "response_id"


def test_the_root_answers_claude_codes_preconnect(server):
    """Claude Code 2.1.197 sends `HEAD /` to its base URL before every `claude -p` session
    (benchmarks/real_agents.py saw it in each task); it was a 404, the only error status of
    those sessions. Now `/` is a 200 with no key needed, and says nothing of the traffic."""
    host, _, port = server.removeprefix("http://").split("/")[0].rpartition(":")
    for method in ("HEAD", "GET"):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request(method, "/")
        r = conn.getresponse()
        body = r.read()
        conn.close()
        assert r.status == 200, (method, body)
        if method == "GET":
            assert json.loads(body)["status"] == "ok"
        else:
            assert body == b""
    # only GET and HEAD: a POST to / is still no endpoint
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/", "{}", {"Authorization": f"Bearer {KEY}"})
    assert conn.getresponse().status == 405
    conn.close()
