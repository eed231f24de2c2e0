"""`mlx-spec serve` for coding agents and shared machines, driven by real clients.

A tiny model built to call a tool (tests/tiny.py `write_tool_model`: it thinks, then emits
`<tool_call>{"name":"get_weather",...}</tool_call>`, and answers once the tool's result is fed
back) is served with a draft that is wrong inside the call, so the call is written by rounds
with rejections. The `openai` SDK and LangChain's `ChatOpenAI(...).bind_tools(...)` drive it.
A second server (prompt lookup, history on, two API keys) is probed across keys.
"""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest
import tiny
from test_server import metrics, serving, start_server, stop_server

from mlx_spec import generate, load_pair

KEY_A, KEY_B = "key-alice", "key-bob"
ORIGIN = "http://app.example"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    return tiny.write_tool_model(tmp_path_factory.mktemp("tool"), draft_errors=2)


@pytest.fixture(scope="module")
def tool_pair(tool_models):
    target, draft = tool_models
    return load_pair(target=str(target), draft=str(draft))


@pytest.fixture(scope="module")
def tool_server(tool_models, tmp_path_factory):
    target, draft = tool_models
    args = [
        "--target", str(target), "--draft", str(draft), "--num-draft-tokens", "3",
        "--drafter", "model", "--api-key", KEY_A, "--allow-origin", ORIGIN,
    ]  # fmt: skip
    with serving(args, tmp_path_factory.mktemp("tool_server")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server, api_key=KEY_A, max_retries=0, timeout=60)


def test_tool_call_in_the_openai_shape(client, tool_pair):
    resp = client.chat.completions.create(model="tool_target", messages=ASK, tools=TOOLS)
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert c.message.content is None
    assert c.message.model_extra["reasoning_content"] == tiny.THOUGHT
    # lossless through the call: the text parsed is the target's own text, and the call was
    # drafted with rejections (the draft is wrong at two places inside it)
    plain = generate(
        tool_pair, ASK, max_tokens=64, use_draft=False, chat_template_kwargs={"tools": TOOLS}
    )
    assert plain.text == (
        f"<think>{tiny.THOUGHT}</think><tool_call>{''.join(tiny.TOOL_CALL_PIECES)}</tool_call>"
    )
    spec = resp.model_extra["speculation"]
    assert 0 < spec["accepted"] < spec["drafted"]
    assert resp.usage.completion_tokens == len(plain.tokens)


def test_streamed_tool_call_deltas(client):
    chunks = list(
        client.chat.completions.create(
            model="tool_target", messages=ASK, tools=TOOLS, stream=True, temperature=0.7
        )
    )
    reasoning = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices
    )
    assert reasoning == tiny.THOUGHT
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_results_fed_back_through_the_template(client):
    first = client.chat.completions.create(model="tool_target", messages=ASK, tools=TOOLS)
    message = first.choices[0].message
    history = ASK + [
        message,  # the SDK's own message object, sent back as agents do
        {
            "role": "tool",
            "tool_call_id": message.tool_calls[0].id,
            "content": json.dumps({"sky": "sunny", "celsius": 24}),
        },
    ]
    resp = client.chat.completions.create(model="tool_target", messages=history, tools=TOOLS)
    assert resp.choices[0].message.content == tiny.ANSWER
    assert resp.choices[0].finish_reason == "stop"
    assert not resp.choices[0].message.tool_calls


def test_tool_choice_none_and_required(client):
    none = client.chat.completions.create(
        model="tool_target", messages=ASK, tools=TOOLS, tool_choice="none"
    )
    c = none.choices[0]
    # no tools in the prompt, nothing parsed: the model's text stays text
    assert not c.message.tool_calls and c.finish_reason == "stop"
    assert c.message.content.startswith("<tool_call>")
    required = client.chat.completions.create(
        model="tool_target", messages=ASK, tools=TOOLS, tool_choice="required"
    )
    c = required.choices[0]
    # the prompt ends with the call's start: no thinking, the target writes the call
    assert (
        c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    )
    assert "reasoning_content" not in c.message.model_extra


def test_no_tool_calling_model_refuses_required(tiny_models, tmp_path):
    """The tiny text model has no tool-call format: `required` is one clear 400."""
    log = open(tmp_path / "stderr.log", "w")  # noqa: SIM115
    proc, url = start_server(["--target", str(tiny_models.target), "--no-draft"], log)
    try:
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(
                model="target", messages=ASK, tools=TOOLS, tool_choice="required"
            )
        assert info.value.body["param"] == "tool_choice"
        # auto: answered as text (greedy: sampled, the untied tiny model may draw its end
        # token within 5 tokens, as it did once in CI)
        r = c.chat.completions.create(
            model="target", messages=ASK, tools=TOOLS, max_tokens=5, temperature=0
        )
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    finally:
        stop_server(proc)
        log.close()


def test_langchain_agent_calls_the_tool_and_reads_its_result(tool_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return json.dumps({"city": city, "sky": "sunny"})

    llm = ChatOpenAI(
        base_url=tool_server, api_key=KEY_A, model="tool_target", temperature=0.7, max_retries=0
    )
    agent = llm.bind_tools([get_weather])
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = agent.invoke(messages)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    messages += [ai]
    for call in ai.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = agent.invoke(messages)
    assert final.content == tiny.ANSWER and not final.tool_calls
    # streamed through LangChain: the chunks add up to the same call
    total = None
    for chunk in agent.stream([HumanMessage("What is the weather in Paris?")]):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


# --------------------------------------------------------------- the browser and the Host


def raw(url: str, method: str, path: str, headers: dict, body: bytes | None = None):
    hostport = url.removeprefix("http://").split("/")[0]
    host, _, port = hostport.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_foreign_host_and_origin_are_refused(tool_server):
    body = json.dumps({"model": "tool_target", "messages": ASK, "max_tokens": 1}).encode()
    auth = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    # DNS rebinding: a page on attacker.example resolved to 127.0.0.1 sends its own Host
    path = "/v1/chat/completions"
    status, _, out = raw(tool_server, "POST", path, {**auth, "Host": "attacker.example:80"}, body)
    assert status == 403 and json.loads(out)["error"]["code"] == "forbidden_host"
    status, _, out = raw(tool_server, "GET", "/health", {"Host": "attacker.example"})
    assert status == 403
    evil = {"Origin": "http://evil.example"}
    status, _, out = raw(tool_server, "POST", path, {**auth, **evil}, body)
    assert status == 403 and json.loads(out)["error"]["code"] == "forbidden_origin"
    # a preflight from a foreign origin gets no CORS grant either
    preflight = {**evil, "Access-Control-Request-Method": "POST"}
    status, headers, _ = raw(tool_server, "OPTIONS", path, preflight)
    assert status == 403 and "access-control-allow-origin" not in headers


def test_allowed_origin_gets_cors(tool_server):
    status, headers, _ = raw(
        tool_server,
        "OPTIONS",
        "/v1/chat/completions",
        {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert status == 204
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    body = json.dumps({"model": "tool_target", "messages": ASK, "max_tokens": 1}).encode()
    status, headers, _ = raw(
        tool_server,
        "POST",
        "/v1/chat/completions",
        {"Origin": ORIGIN, "Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"},
        body,
    )
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN


def test_swapping_needs_allow_swap(client):
    """A request naming another pair cannot make the server load it (no --allow-swap)."""
    assert [m.id for m in client.models.list().data] == ["tool_target"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="smollm2-demo", messages=ASK)


# --------------------------------------------------------------- no leaks between keys

SECRET = "Berlin is the capital of Germany. Speculative decoding drafts tokens with a small model"


@pytest.fixture(scope="module", params=["partitioned", "shared"])
def lookup_server(request, tiny_models, tmp_path_factory):
    """Two identical servers: on the first, Alice will paste a secret; the second (the
    control) never hears from her."""
    root = tmp_path_factory.mktemp("lookup")
    args = [
        "--target", str(tiny_models.target), "--drafter", "ngram", "--num-draft-tokens", "4",
        "--api-key", KEY_A, "--api-key", KEY_B, "--max-batch", "1",  # history: single-stream
        "--admin-key", KEY_A,  # KEY_A reads the whole server's /metrics
    ]  # fmt: skip
    if request.param == "shared":
        args.append("--shared-history")
    logs = [open(root / f"stderr{i}.log", "w") for i in range(2)]  # noqa: SIM115
    servers = [start_server(args, log) for log in logs]
    yield request.param, servers[0][1], servers[1][1]
    for (proc, _), log in zip(servers, logs, strict=True):
        stop_server(proc)
        log.close()


def observe(url: str, key: str, ids: list[int]) -> tuple:
    """Everything a client sees of a short completion: text, drafted/accepted, the chunk
    boundaries of its stream, cached tokens, a seeded sampled reply."""
    c = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
    r = c.completions.create(model="target", prompt=ids, max_tokens=2, temperature=0)
    spec = r.model_extra["speculation"]
    chunks = [
        ch.choices[0].text
        for ch in c.completions.create(
            model="target", prompt=ids, max_tokens=2, temperature=0, stream=True
        )
        if ch.choices and ch.choices[0].text
    ]
    sampled = c.completions.create(model="target", prompt=ids, max_tokens=4, seed=7).choices[0].text
    return (
        r.choices[0].text,
        spec["drafted"],
        spec["accepted"],
        tuple(chunks),
        r.usage.prompt_tokens_details.cached_tokens,
        sampled,
    )


def test_a_probe_learns_nothing_across_keys(lookup_server, pair):
    """Bob probes 3-token n-grams of Alice's text (max_tokens 2, as in the issue), before and
    after she sends it. Everything he sees after (text, drafted/accepted, stream chunk
    boundaries, cached_tokens, a seeded sampled reply) equals what he sees on a control
    server where she never spoke. Alice's own probes do draft from her history (the probe
    works), and with --shared-history Bob's do too (the leak the partitions close)."""
    mode, url, control = lookup_server
    ids = pair.tokenizer.encode(SECRET)
    probes = [ids[i : i + 3] for i in range(0, len(ids) - 3, 2)]
    for server in (url, control):
        [observe(server, KEY_B, p) for p in probes]  # Bob's own earlier requests, alike
    alice = openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0, timeout=30)
    alice.completions.create(model="target", prompt=SECRET, max_tokens=8, temperature=0)
    after = [observe(url, KEY_B, p) for p in probes]
    unheard = [observe(control, KEY_B, p) for p in probes]
    bob_full, bob_unheard = (
        openai.OpenAI(base_url=server, api_key=KEY_B, max_retries=0).completions.create(
            model="target", prompt=SECRET, max_tokens=8, temperature=0
        )
        for server in (url, control)
    )
    again = alice.completions.create(model="target", prompt=SECRET, max_tokens=8, temperature=0)
    alice_probes = [observe(url, KEY_A, p) for p in probes]
    leaked = sum(a != b for a, b in zip(after, unheard, strict=True))
    alice_drafted = sum(o[1] for o in alice_probes)
    print(
        f"{mode}: {len(probes)} probes; {leaked} differ from the control server after another"
        f" key's request; the key's own probes drafted {alice_drafted} tokens"
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # Alice's own cache works
    assert alice_drafted > 0  # Alice's own history drafts: the probe can see history
    if mode == "partitioned":
        assert leaked == 0
        # what Bob reuses is his own probes' start, as where Alice never spoke
        cached = bob_full.usage.prompt_tokens_details.cached_tokens
        assert cached == bob_unheard.usage.prompt_tokens_details.cached_tokens < 10
    else:  # --shared-history: the probe does see the other key's text (why it is opt-in)
        assert leaked > 0


def test_metrics_count_every_partition(lookup_server):
    _, url, _ = lookup_server
    m = metrics(url, KEY_A)
    assert m["mlx_spec_history_tokens"] > 0 and m["mlx_spec_prompt_cache_entries"] >= 1


@pytest.fixture(scope="module")
def queue_server(tiny_models, tmp_path_factory):
    """Plain decoding with the end-of-sequence row muted: greedy replies run to max_tokens
    (seconds), so a request is surely busy while others queue. Two keys, a queue of 4 (2 per
    key by default)."""
    root = tmp_path_factory.mktemp("queue")
    cfg = {**tiny.llama_config(320, layers=4), "max_position_embeddings": 8192}
    weights = tiny.random_weights(cfg, seed=0)
    weights["lm_head.weight"][2] = 0
    path = tiny.write_model(root / "long", cfg, weights, tiny_models.tokenizer)
    log = open(root / "stderr.log", "w")  # noqa: SIM115
    args = ["--target", str(path), "--no-draft", "--max-queue", "4", "--max-batch", "1"]
    keys = ["--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", KEY_A]  # A: all /metrics
    proc, url = start_server(args + keys, log)
    yield url
    stop_server(proc)
    log.close()


def long_running(url: str, key: str = KEY_A):
    c = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
    running = c.completions.create(
        model="long", prompt="The", max_tokens=5000, stream=True, temperature=0
    )
    next(iter(running))  # generating now, for seconds
    return running


def waiting(url: str) -> float:
    return metrics(url, KEY_A)["mlx_spec_queue_waiting"]


def wait_for(condition, what: str, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_keepalive_while_queued_and_disconnect_frees_the_slot(queue_server):
    """A stream queued behind a long job gets its headers and SSE comments before its first
    token; a queued client that leaves is out of the queue at once."""
    import socket

    url = queue_server
    running = long_running(url)
    try:
        hostport = url.removeprefix("http://").split("/")[0]
        host, _, port = hostport.rpartition(":")
        body = json.dumps({"model": "long", "prompt": "Paris", "max_tokens": 3, "stream": True})
        sock = socket.create_connection((host, int(port)))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {hostport}\r\n"
            f"Content-Type: application/json\r\nAuthorization: Bearer {KEY_B}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall((head + body).encode())
        sock.settimeout(10)
        got = b""
        start = time.monotonic()
        while b": keep-alive" not in got and time.monotonic() - start < 8:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
        assert b": keep-alive" in got and b"data: {" not in got.split(b"\r\n\r\n", 1)[1][:20]
        assert waiting(url) == 1
        sock.close()  # the queued client leaves
        wait_for(lambda: waiting(url) == 0, "the queued request kept its slot")
        assert metrics(url, KEY_A)["mlx_spec_busy"] == 1  # while the long job still runs
    finally:
        running.close()


def test_round_robin_between_keys_and_a_per_key_limit(queue_server):
    url = queue_server
    wait_for(lambda: metrics(url, KEY_A)["mlx_spec_busy"] == 0, "the server stayed busy")
    running = long_running(url)
    finished = []

    def ask(key, name):
        c = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=30)
        r = c.completions.create(model="long", prompt=f"Paris {name}", max_tokens=3, temperature=0)
        finished.append(name)
        return r

    import concurrent.futures

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = []
            for key, name in [(KEY_A, "a1"), (KEY_A, "a2"), (KEY_B, "b1")]:
                futures.append(pool.submit(ask, key, name))
                n = len(futures)
                wait_for(lambda n=n: waiting(url) >= n, f"{name} never queued")
            # Alice holds her share of the queue (2 of 4): her next one is refused, Bob's not
            a = openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0)
            with pytest.raises(openai.RateLimitError) as info:
                a.completions.create(model="long", prompt="Berlin", max_tokens=3)
            assert "this API key" in info.value.body["message"]
            futures.append(pool.submit(ask, KEY_B, "b2"))
            wait_for(lambda: waiting(url) >= 4, "b2 never queued")
            # the queue is full: refused before the body is read (the client sends only the
            # headers of an 8 MB body and still gets its 429)
            hostport = url.removeprefix("http://").split("/")[0]
            host, _, port = hostport.rpartition(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            conn.putrequest("POST", "/v1/completions")
            for k, v in {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {KEY_B}",
                "Content-Length": str(8 << 20),
            }.items():
                conn.putheader(k, v)
            conn.endheaders()
            assert conn.getresponse().status == 429
            conn.close()
            running.close()
            for f in futures:
                assert f.result().usage.completion_tokens == 3
        # round robin: Bob's first request ran before Alice's second, though it came later
        assert finished == ["a1", "b1", "a2", "b2"]
    finally:
        running.close()
