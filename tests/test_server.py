"""`mlx-spec serve` as a real process on 127.0.0.1, driven by the official `openai` client.

Two servers per module: a fast one (the tiny target, drafted by lookup then the tiny draft
model, history lookup on) for equality, parameters and errors, and a slow one (plain decoding,
long replies, a queue of three, a short timeout) for the queue, 429, timeouts and SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time

import openai
import pytest
import tiny
from conftest import VOCAB
from mlx_lm.utils import common_prefix_len

from mlx_spec import generate

KEY = "test-key"
MAX_TOKENS_LIMIT = 400
SLOW_QUEUE = 3


class Reply:
    def __init__(self, status: int, body: bytes, headers: dict | None = None):
        self.status_code, self.text = status, body.decode()
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}

    def json(self):
        return json.loads(self.text)


def request(method: str, url: str, body=None, key: str | None = KEY, timeout=10) -> Reply:
    """A raw HTTP request with the standard library (bodies the client would not send)."""
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, "/" + path, body=body, headers=headers)
        r = conn.getresponse()
        return Reply(r.status, r.read())
    finally:
        conn.close()


def raw_post(url: str, body: bytes, headers: dict, timeout=10) -> Reply:
    rest = url.removeprefix("http://")
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/" + path, body=body, headers=headers)
        r = conn.getresponse()
        return Reply(r.status, r.read(), dict(r.getheaders()))
    finally:
        conn.close()


def health(url: str) -> int:
    return request("GET", url.removesuffix("/v1") + "/health", key=None, timeout=1).status_code


def start_server(args: list[str], log, env=None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "mlx_spec", "serve", "--port", "0", "--log-level", "warning"]
    if "--cache-dir" not in args and "--no-disk-cache" not in args:
        # a disk tier of its own: no server finds another test's entries
        # (inside the tests' cache folder, which conftest removes at exit)
        folder = tempfile.mkdtemp(prefix="mlx-spec-cache-", dir=os.environ.get("XDG_CACHE_HOME"))
        args = [*args, "--cache-dir", folder]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_SPEC_API_KEY": "", **(env or {})}
    proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=60):
        proc.kill()
        raise RuntimeError("the server printed nothing within 60 s")
    line = proc.stdout.readline()
    match = re.search(r"on (http://\S+/v1)", line)
    assert match, f"unexpected first line: {line!r} (rc {proc.poll()})"
    url = match.group(1)
    for _ in range(100):  # the socket is bound before the line; uvicorn may still be starting
        try:
            if health(url) == 200:
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server never answered /health")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def serving(args: list[str], log_dir, env=None):
    """A server process for the `with` block, its stderr in `log_dir`/stderr.log: (proc, url)."""
    with open(log_dir / "stderr.log", "w") as log:
        proc, url = start_server(args, log, env)
        try:
            yield proc, url
        finally:
            stop_server(proc)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    # a user models.toml with one more pair: requests for it load it on demand
    models = root / "models.toml"
    models.write_text(
        f'[pairs."tiny2"]\ntarget = "{tiny_models.target2}"\ndraft = "{tiny_models.draft2}"\n'
    )
    args = [
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--drafter", "ngram+model", "--num-draft-tokens", "4", "--api-key", KEY,
        "--max-body", "64K", "--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--max-queue", "32",
        "--allow-swap",
    ]  # fmt: skip
    with serving(args, root, env={"MLX_SPEC_MODELS": str(models)}) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def metrics(url: str, key: str | None = KEY) -> dict[str, float]:
    r = request("GET", url.removesuffix("/v1") + "/metrics", key=key)
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PROMPTS = ["The quick brown fox", "Paris is the capital of"]


def test_models_lists_the_served_pair_first(client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "target"
    assert {"smollm2-demo", "tiny2"} <= set(ids)  # curated and user pairs load on demand


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", PROMPTS)
def test_chat_equals_generate(client, pair, text, stream):
    expected = generate(pair, chat(text), max_tokens=40, temperature=0.0)
    kwargs = dict(model="target", messages=chat(text), max_tokens=40, temperature=0)
    if stream:
        chunks = list(
            client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
        )
        text_out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert not chunks[-1].choices  # the usage chunk comes last, with no choices
    else:
        resp = client.chat.completions.create(**kwargs)
        text_out, finish, usage = (
            resp.choices[0].message.content,
            resp.choices[0].finish_reason,
            resp.usage,
        )
    assert text_out == expected.text
    assert usage.completion_tokens == len(expected.tokens)
    assert usage.prompt_tokens == expected.stats.prompt_tokens
    assert finish == expected.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_generate(client, pair, stream):
    text = "def add(a, b):\n    return"
    expected = generate(pair, text, max_tokens=30, temperature=0.0)
    kwargs = dict(model="target", prompt=text, max_tokens=30, temperature=0)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        out = "".join(c.choices[0].text for c in chunks)
        assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    else:
        resp = client.completions.create(**kwargs)
        out = resp.choices[0].text
        assert resp.usage.completion_tokens == len(expected.tokens)
    assert out == expected.text


def test_token_ids_as_prompt(client, pair):
    ids = pair.tokenizer.encode("Once upon a time")
    expected = generate(pair, ids, max_tokens=20, temperature=0.0)
    resp = client.completions.create(model="target", prompt=ids, max_tokens=20, temperature=0)
    assert resp.choices[0].text == expected.text


def stop_across_tokens(pair, prompt) -> tuple[str, str]:
    """A reply, and a stop string in it that starts inside one token and ends in another."""
    events = list(generate_events(pair, prompt))
    text = "".join(e.text for e in events)
    ends, at = [], 0
    for e in events:
        at += len(e.text)
        ends.append(at)
    for i in range(1, len(ends) - 1):
        a, b = ends[i - 1], ends[i]
        if b - a >= 2 and ends[i + 1] > b:  # a token of 2+ characters with one after it
            stop = text[b - 1 : b + 1]
            if text.find(stop) == b - 1:
                return text, stop
    pytest.fail("no reply text to cut across a token boundary")


def generate_events(pair, prompt):
    from mlx_spec import stream

    return stream(pair, prompt, max_tokens=60, temperature=0.0)


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_across_a_token_boundary(client, pair, streaming):
    prompt = "Speculative decoding drafts tokens"
    text, stop = stop_across_tokens(pair, prompt)
    kwargs = dict(model="target", prompt=prompt, max_tokens=60, temperature=0, stop=["zzz", stop])
    if streaming:
        chunks = list(client.completions.create(**kwargs, stream=True))
        out = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        resp = client.completions.create(**kwargs)
        out, finish = resp.choices[0].text, resp.choices[0].finish_reason
    assert out == text[: text.index(stop)]
    assert finish == "stop"


def test_usage_and_speculation_object(client, pair):
    text = "Once upon a time there was"
    expected = generate(pair, text, max_tokens=50, temperature=0.0)
    resp = client.completions.create(model="target", prompt=text, max_tokens=50, temperature=0)
    u, spec = resp.usage, resp.model_extra["speculation"]
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.completion_tokens == len(expected.tokens)
    assert spec["drafter"] == "ngram+model" and spec["history_lookup"] is True
    assert spec["num_draft_tokens"] == 4 and spec["adaptive"] is False
    assert 0 <= spec["accepted"] <= spec["drafted"] <= 4 * spec["target_passes"]
    if spec["drafted"]:
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"], 1e-3)
    # every target pass emits its own token plus the accepted drafts (one pass may end at EOS)
    assert u.completion_tokens <= spec["target_passes"] + spec["accepted"]
    assert spec["tokens_per_target_pass"] == pytest.approx(
        u.completion_tokens / spec["target_passes"], 1e-3
    )


def test_history_lookup_drafts_an_earlier_reply(client, pair):
    """The same question in a fresh context: the reply is drafted from the earlier one."""
    question = "Berlin is the capital of Germany. The quick brown"
    kwargs = dict(model="target", prompt=question, max_tokens=60, temperature=0)
    first = client.completions.create(**kwargs)
    # another conversation in between: the next request cannot reuse the first one's decoder
    client.completions.create(model="target", prompt="def add(a, b):", max_tokens=5)
    again = client.completions.create(**kwargs)
    assert again.choices[0].text == first.choices[0].text
    n = again.usage.completion_tokens
    accepted = again.model_extra["speculation"]["accepted"]
    assert accepted >= 0.7 * n > first.model_extra["speculation"]["accepted"]


def plain_events(pair, prompt, **kwargs):
    from mlx_spec import stream

    return list(stream(pair, prompt, temperature=0.0, use_draft=False, **kwargs))


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_logprobs_are_the_targets(client, pair, streaming):
    """Speculating (k = 4), the server's log-probabilities are the target's own."""
    expected = plain_events(pair, chat("The quick brown fox"), max_tokens=24, logprobs=2)
    kwargs = dict(
        model="target", messages=chat("The quick brown fox"), max_tokens=24, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    if streaming:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]  # fmt: skip
    else:
        resp = client.chat.completions.create(**kwargs)
        entries = resp.choices[0].logprobs.content
        assert resp.model_extra["speculation"]["accepted"] > 0  # drafts were kept
    assert len(entries) == len(expected)
    for got, e in zip(entries, expected, strict=True):
        assert got.logprob == pytest.approx(e.logprob, abs=1e-4)
        assert got.token == pair.tokenizer.decode([e.token])
        assert bytes(got.bytes) == got.token.encode()
        assert [t.token for t in got.top_logprobs] == [
            pair.tokenizer.decode([t]) for t, _ in e.top_logprobs
        ]


def test_completion_logprobs_legacy_shape(client, pair):
    expected = plain_events(pair, "Once upon a time", max_tokens=10, logprobs=3)
    resp = client.completions.create(
        model="target", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-4)
    # a dict by token text: ids that decode alike (partial bytes) share an entry
    assert all(1 <= len(t) <= 3 and w in t for t, w in zip(lp.top_logprobs, lp.tokens, strict=True))
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_penalties_and_logit_bias_equal_the_library(client, pair):
    from mlx_spec.core.processors import make_processors

    settings = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"60": 3.0})
    prompt = "def add(a, b):\n    return a + b\n"
    processors = make_processors(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={60: 3.0})
    expected = generate(pair, prompt, max_tokens=30, temperature=0.0, processors=processors)
    resp = client.completions.create(
        model="target", prompt=prompt, max_tokens=30, temperature=0, **settings,
        extra_body={"repetition_penalty": 1.0},
    )  # fmt: skip
    assert resp.choices[0].text == expected.text
    assert expected.text != generate(pair, prompt, max_tokens=30, temperature=0.0).text


def test_follow_up_prefills_only_its_new_tokens(client, pair):
    turn1 = chat("Paris is the capital of France.")
    r1 = client.chat.completions.create(
        model="target", messages=turn1, max_tokens=20, temperature=0
    )
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And Berlin?"},
    ]
    r2 = client.chat.completions.create(
        model="target", messages=turn2, max_tokens=20, temperature=0
    )
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    assert r2.choices[0].message.content == generate(pair, turn2, max_tokens=20, temperature=0).text


def test_a_sub_task_keeps_the_shared_part_and_the_parent_its_conversation(client, pair):
    """An agent's sub-task (the parent's system prompt, then another conversation) between two
    turns of the parent: it reuses the system part, and the parent's next turn still reuses its
    whole first turn (the prompt cache keeps both branches; it once handed the parent's caches
    to the sub-task, and the parent prefilled all again)."""
    from mlx_spec.decode.prompts import encode_prompt

    system = {"role": "system", "content": "You are a careful coding agent. " * 6}
    parent = [system, {"role": "user", "content": "Fix the parser in parse.py."}]
    sub = [system, {"role": "user", "content": "List every file under src."}]
    shared = common_prefix_len(
        encode_prompt(pair.tokenizer, parent), encode_prompt(pair.tokenizer, sub)
    )
    assert shared > 40  # the system part

    def ask(messages):
        r = client.chat.completions.create(
            model="target", messages=messages, max_tokens=12, temperature=0
        )
        assert (
            r.choices[0].message.content
            == generate(pair, messages, max_tokens=12, temperature=0).text
        )
        return r

    r1 = ask(parent)
    rs = ask(sub)
    assert rs.usage.prompt_tokens_details.cached_tokens >= shared - 1
    turn2 = parent + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Now add a test."},
    ]
    r2 = ask(turn2)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"n": 2}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "a lot"}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"logit_bias": {"7": 101}}, "logit_bias"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": "x" * 1025}, "stop"),
        ({"stop": ["x" * 1000] * 17}, "stop"),  # past the total bound
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_unsupported_or_bad_parameters_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="target", messages=chat("hi"), extra_body=extra)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_unknown_fields_are_ignored_and_named_in_a_header(client, pair):
    """Open WebUI and LiteLLM add fields of their own: answered, not refused."""
    raw = client.chat.completions.with_raw_response.create(
        model="target", messages=chat("hi"), max_tokens=5, temperature=0,
        extra_body={"frobnicate": 1, "metadata_of_some_ui": {"x": 1}},
    )  # fmt: skip
    assert raw.headers["x-ignored-fields"] == "frobnicate, metadata_of_some_ui"
    expected = generate(pair, chat("hi"), max_tokens=5, temperature=0.0).text
    assert raw.parse().choices[0].message.content == expected


def test_many_stop_strings_are_honoured(client, pair):
    prompt = "Speculative decoding drafts tokens"
    text, stop = stop_across_tokens(pair, prompt)
    stops = [f"never-{i}" for i in range(40)] + [stop]
    resp = client.completions.create(
        model="target", prompt=prompt, max_tokens=60, temperature=0, stop=stops
    )
    assert resp.choices[0].text == text[: text.index(stop)]


def test_bad_json_is_400_and_a_non_json_body_415(server):
    url = server + "/chat/completions"
    r = request("POST", url, b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    body = json.dumps({"model": "target", "messages": chat("hi")}).encode()
    # a web page's form or fetch without a preflight sends text/plain: never parsed
    r = raw_post(url, body, {"Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = raw_post(url, body, {"Authorization": f"Bearer {KEY}"})  # no type at all
    assert r.status_code == 415


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},  # the client's template
        {"tokenize": True},  # an argument of apply_chat_template, not a template variable
        {"enable_thinking": ["a list"]},
    ],
)
def test_chat_template_kwargs_are_variables_only(server, kwargs):
    body = {"model": "target", "messages": chat("hi"), "chat_template_kwargs": kwargs}
    r = request("POST", server + "/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_deeply_nested_json_is_400(server):
    r = request("POST", server + "/chat/completions", b"[" * 50_000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_wrong_or_missing_key_is_401(server):
    bad = openai.OpenAI(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="target", messages=chat("hi"))
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = request("GET", server + "/models", key=None)  # no header at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert health(server) == 200  # open to all


def test_unknown_model_and_path_are_404(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-pair", messages=chat("hi"))
    assert info.value.body["code"] == "model_not_found"
    # a curated pair that is not on this machine is not offered: a request never downloads
    assert "qwen3-8b" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="qwen3-8b", messages=chat("hi"))
    r = request("GET", server + "/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_oversized_body_is_413(server):
    body = {"model": "target", "messages": chat("x" * 70_000)}
    r = request("POST", server + "/chat/completions", body)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_client_disconnect_mid_stream_frees_the_engine(client, server, pair):
    before = metrics(server)
    stream = client.completions.create(
        model="target", prompt="The quick brown fox", max_tokens=MAX_TOKENS_LIMIT, stream=True,
        temperature=0,
    )  # fmt: skip
    next(iter(stream))
    stream.close()  # the client leaves after the first chunk
    expected = generate(pair, "Paris is", max_tokens=10, temperature=0.0)
    resp = client.completions.create(
        model="target", prompt="Paris is", max_tokens=10, temperature=0
    )
    assert resp.choices[0].text == expected.text
    after = metrics(server)
    assert after["mlx_spec_cancelled_total"] == before["mlx_spec_cancelled_total"] + 1
    generated = after["mlx_spec_generated_tokens_total"] - before["mlx_spec_generated_tokens_total"]
    assert generated < MAX_TOKENS_LIMIT  # the abandoned reply stopped early


def test_twenty_concurrent_clients_all_answered_none_mixed(client, server, pair):
    prompts = [f"{tiny.CORPUS[i % 5][: 10 + i]}" for i in range(20)]
    expected = [generate(pair, p, max_tokens=12, temperature=0.0).text for p in prompts]
    before = metrics(server)

    def ask(p):
        stream = client.completions.create(
            model="target", prompt=p, max_tokens=12, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        got = list(pool.map(ask, prompts))
    assert got == expected
    after = metrics(server)
    key = 'mlx_spec_requests_total{endpoint="completions",status="200"}'
    assert after[key] == before.get(key, 0) + 20


def test_metrics_are_prometheus_text_with_totals(server):
    m = metrics(server)
    assert m["mlx_spec_generated_tokens_total"] > 0
    assert 0 <= m["mlx_spec_accepted_tokens_total"] <= m["mlx_spec_drafted_tokens_total"]
    assert m["mlx_spec_queue_waiting"] == 0 and m["mlx_spec_busy"] == 0
    assert 0 < m["mlx_spec_prompt_cache_bytes"] <= 2 << 30
    assert m["mlx_spec_history_tokens"] > 0
    assert request("GET", server.removesuffix("/v1") + "/metrics", key=None).status_code == 401


def test_another_pair_loads_on_demand_one_resident(client, server, tiny_models):
    """Last for this server: it swaps the resident pair (caches and history start over)."""
    from mlx_spec import load_pair

    other = load_pair(target=str(tiny_models.target2), draft=str(tiny_models.draft2))
    expected = generate(other, "The quick brown fox", max_tokens=20, temperature=0.0)
    resp = client.completions.create(
        model="tiny2", prompt="The quick brown fox", max_tokens=20, temperature=0
    )
    assert resp.choices[0].text == expected.text
    assert resp.model == "tiny2"
    assert [m.id for m in client.models.list().data][0] == "tiny2"
    back = client.completions.create(model="target", prompt="Paris is", max_tokens=5, temperature=0)
    assert back.usage.completion_tokens == 5  # the startup pair, loaded again


# --------------------------------------------------------------- the slow server: limits


@pytest.fixture(scope="module")
def long_model(tiny_models, tmp_path_factory):
    """Plain decoding with the end-of-sequence row muted and a long context: greedy replies
    run to max_tokens (thousands of tokens, seconds; checked for the prompts used here), so a
    request is surely busy while others come."""
    root = tmp_path_factory.mktemp("long")
    cfg = {**tiny.llama_config(VOCAB, layers=4), "max_position_embeddings": 8192}
    weights = tiny.random_weights(cfg, seed=0)
    weights["lm_head.weight"][2] = 0  # <|im_end|>: never the argmax of a peaked head
    return tiny.write_model(root / "long", cfg, weights, tiny_models.tokenizer)


@pytest.fixture(scope="module")
def slow(long_model, tmp_path_factory):
    yield from slow_server(long_model, tmp_path_factory.mktemp("slow"), request_timeout=2)


@pytest.fixture(scope="module")
def queueing(long_model, tmp_path_factory):
    """The same with a request timeout long enough for a queue to form and drain on a loaded
    machine (beside a second test worker, queued requests ran past 2 s)."""
    yield from slow_server(long_model, tmp_path_factory.mktemp("queueing"), request_timeout=60)


def slow_server(path, root, request_timeout: float, shutdown_timeout: float = 8):
    args = [
        "--target", str(path), "--no-draft", "--max-queue", str(SLOW_QUEUE), "--max-batch", "1",
        "--request-timeout", str(request_timeout),
        "--shutdown-timeout", str(shutdown_timeout),
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url


def slow_client(url):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)


def wait_until(condition, what: str, seconds: float = 5) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_queue_is_first_in_first_out_and_past_its_limit_429(queueing):
    _, url = queueing
    c = slow_client(url)
    running = c.completions.create(
        model="long", prompt="The", max_tokens=5000, stream=True, temperature=0
    )
    next(iter(running))  # generating now, for seconds (greedy: no end of sequence)
    finished = []

    def ask(i):
        r = c.completions.create(model="long", prompt=f"Paris {i}", max_tokens=5, temperature=0)
        finished.append(i)
        return r

    with concurrent.futures.ThreadPoolExecutor(SLOW_QUEUE) as pool:
        queued = []
        for i in range(SLOW_QUEUE):  # one at a time, so the arrival order is known
            queued.append(pool.submit(ask, i))
            wait_until(
                lambda n=i + 1: metrics(url, None)["mlx_spec_queue_waiting"] >= n,
                f"request {i} never queued",
            )
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model="long", prompt="Berlin", max_tokens=5)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.body["code"] == "rate_limit_exceeded"
        running.close()  # frees the engine for the queued ones
        assert all(f.result().usage.completion_tokens == 5 for f in queued)
    assert finished == list(range(SLOW_QUEUE))


def test_request_timeout_is_504(slow):
    _, url = slow
    with pytest.raises(openai.InternalServerError) as info:  # greedy: no end of sequence
        slow_client(url).completions.create(
            model="long", prompt="The", max_tokens=5000, temperature=0
        )
    assert info.value.status_code == 504
    assert info.value.body["code"] == "request_timeout"


def test_a_response_the_timeout_cuts_fails_with_its_item_incomplete(slow):
    """A streamed Responses reply cut by the request timeout ends in response.failed; the
    message item it cut says incomplete (it said completed), in its done event and in the
    failed response."""
    _, url = slow
    with slow_client(url).responses.stream(
        model="long", input="The", max_output_tokens=5000, temperature=0
    ) as stream:
        events = list(stream)
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message.startswith("the request timed out")
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.type == "message" and done.item.status == "incomplete"
    assert [i.status for i in events[-1].response.output] == ["incomplete"]


@pytest.fixture
def draining(long_model, tmp_path):
    """A server of its own (the test stops it), its request timeout and shutdown grace long
    enough for a 300-token reply on a slow machine (with `slow`'s 2 s that reply timed out on a
    2-core one)."""
    yield from slow_server(long_model, tmp_path, request_timeout=60, shutdown_timeout=40)


def test_sigterm_finishes_the_running_request_then_exits_cleanly(draining):
    proc, url = draining
    stream = slow_client(url).completions.create(
        model="long", prompt="The", max_tokens=300, stream=True, temperature=0
    )
    chunks = iter(stream)
    first = next(chunks)
    proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text  # the whole reply arrived
    assert proc.wait(20) == 0
    with pytest.raises(OSError):
        health(url)


def test_no_network_bind_without_key_warns(tiny_models, tmp_path):
    """Binding beyond loopback without --api-key warns (here on a port that is busy, so the
    command stops right after the warning, with one clear error line)."""
    import socket

    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    r = subprocess.run(
        [sys.executable, "-m", "mlx_spec", "serve", "--target", str(tiny_models.target),
         "--host", "0.0.0.0", "--port", str(busy.getsockname()[1])],
        capture_output=True, text=True, env={**os.environ, "MLX_SPEC_API_KEY": ""},
    )  # fmt: skip
    busy.close()
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert "warning" in lines[0] and "--api-key" in lines[0]
    assert lines[-1].startswith("mlx-spec serve: error: cannot listen on 0.0.0.0")
