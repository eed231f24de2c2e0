"""Issue 45: a seeded, bounded property-based run against a real `mlx-spec serve` process.

Requests are generated from the server's own /openapi.json (server/openapi.py): bodies that
follow the schemas, then mutated the ways clients and attackers get them wrong (a field
missing or of the wrong type, huge numbers, NaN / Infinity as JSON text, deep nesting, lone
surrogates and other unicode oddities, special-token text, bodies that are no JSON object,
wrong methods and paths, missing headers). Pass: no answer is a 5xx (nor a stream's error
event of the server's), the process lives, /health is ok, its log holds no traceback, and an
ordinary request afterwards gets exactly the library's greedy reply.

schemathesis is not on this machine's package index; hypothesis drives the cases (seeded, no
shrinking: a failure names its case, and the run stays within its time).
"""

from __future__ import annotations

import http.client
import json
import time

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from test_server import KEY, request, serving

from mlx_spec import generate

SEED = 45
CASES = 600  # ~10-30 s on 2 shared CPU cores, the server's start included
ODD_TEXT = [
    "\u202e\u0000\ufeff",
    "<|im_end|>\n<|im_start|>system\n",
    "<|endoftext|>",
    "e\u0301\u0301\u0301",
    "\U0001f600" * 3,
    "\udbff\udfff",  # a valid pair, written as escapes by json.dumps
    "{{ raise_exception('x') }}",
    "{% for x in range(10**9) %}",
    "\r\n\r\nHTTP/1.1 200 OK\r\n",
    "a" * 5000,
]
WRONG = [None, True, -1, 0, 1.5, "x", "", [], {}, [1, "a"], {"a": {"b": []}}, 2**70, -(2**63)]
HUGE = [10**30, -(10**30), 2**63, 2**64 + 1, 1e308, -1e308, 5e-324, 2**31, 2**53 + 1]
RAW = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    '"\\ud800"',
    '"\\udfff x"',
    '"a\\u0000b"',
    "[" * 3000 + "]" * 3000,
    '{"a":' * 3000 + "1" + "}" * 3000,
    "01",
    "1.",
    "tru",
]
PLACEHOLDER = "\u2063RAW\u2063"


def from_schema(schema: dict, depth: int = 0) -> st.SearchStrategy:
    """A hypothesis strategy for the subset of JSON Schema server/openapi.py uses."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, depth) for s in schema["anyOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, depth) for k in kind])
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if not props:
            extra = schema.get("additionalProperties") or {"type": "string"}
            values = from_schema(extra, depth + 1) if depth < 4 else st.none()
            return st.dictionaries(st.text(max_size=8), values, max_size=3)
        fields = {k: from_schema(v, depth + 1) for k, v in props.items()}
        optional = sorted(set(fields) - required)
        return st.fixed_dictionaries(
            {k: fields[k] for k in sorted(required)},
            optional={k: fields[k] for k in optional} if depth < 4 else {},
        )
    if kind == "array":
        items = from_schema(schema.get("items", {"type": "integer"}), depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "string":
        low = schema.get("minLength", 0)
        text = st.text(min_size=low, max_size=min(schema.get("maxLength", 30), 30))
        return st.one_of(text, st.sampled_from([t for t in ODD_TEXT if len(t) >= low]))
    if kind == "integer":
        lo, hi = schema.get("minimum", -(2**40)), schema.get("maximum", 2**40)
        return st.integers(lo, min(hi, max(lo, 0) + 600))  # (token ids: mostly in range)
    if kind == "number":
        lo, hi = schema.get("minimum", -1e6), schema.get("maximum", 1e6)
        above = "exclusiveMinimum" in schema
        lo = schema.get("exclusiveMinimum", lo)
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min=above)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none()


@st.composite
def mutated(draw, body_strategy, model: str, budget: str = "max_tokens") -> bytes:
    """A body from the schema, usually valid in shape, then one mutation (or none).
    `budget`: the field that bounds the reply (max_output_tokens for Responses)."""
    body = draw(body_strategy)
    if draw(st.integers(0, 2)):  # mostly few fields: each optional one may be out of place
        keep = draw(st.sets(st.sampled_from(sorted(body)), max_size=2)) if body else set()
        body = {
            k: v
            for k, v in body.items()
            if k in keep or k in ("messages", "prompt", "input", "max_tokens")
        }
    if draw(st.integers(0, 3)):  # mostly the served pair, a small reply
        body["model"] = model
        body[budget] = draw(st.integers(1, 4))
        body.pop("max_completion_tokens", None)
        if "stream_options" in body:
            body["stream"] = True
    how = draw(
        st.sampled_from(
            ["none"] * 5 + ["drop", "wrong", "huge", "raw", "odd", "nest", "not_object"]
        )
    )
    keys = sorted(body) or ["model"]
    name = draw(st.sampled_from(keys))
    if how == "drop":
        body.pop(name, None)
    elif how == "wrong":
        body[name] = draw(st.sampled_from(WRONG))
    elif how == "huge":
        body[name] = draw(st.sampled_from(HUGE))
    elif how == "odd":
        body[name] = draw(st.sampled_from(ODD_TEXT))
    elif how == "nest":
        depth = draw(st.sampled_from([50, 500, 5000]))
        value: object = "x"
        for _ in range(depth):
            value = [value] if depth % 2 else {"a": value}
        body[name] = value
    elif how == "not_object":
        return draw(st.sampled_from([b"[]", b'"x"', b"1", b"null", b"", b"{", b"\xff\xfe"]))
    if how == "raw":
        body[name] = PLACEHOLDER
        raw = draw(st.sampled_from(RAW))
        try:
            text = json.dumps(body, ensure_ascii=True)
        except (ValueError, RecursionError):
            return b"{}"
        return text.replace(json.dumps(PLACEHOLDER), raw).encode()
    try:
        return json.dumps(body).encode()
    except (ValueError, RecursionError):  # (a nesting too deep for json.dumps itself)
        return b'{"model": "' + model.encode() + b'", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"


def cases(spec: dict, model: str) -> st.SearchStrategy:
    """(method, path, headers, body) over every endpoint of the document."""
    schemas = spec["components"]["schemas"]
    chat = mutated(from_schema(schemas["ChatCompletionRequest"]), model)
    completion = mutated(from_schema(schemas["CompletionRequest"]), model)
    messages = mutated(from_schema(schemas["MessagesRequest"]), model)
    count = mutated(from_schema(schemas["CountTokensRequest"]), model)
    responses = mutated(from_schema(schemas["ResponsesRequest"]), model, "max_output_tokens")
    bodies = {
        "/v1/chat/completions": chat,
        "/v1/completions": completion,
        "/v1/messages": messages,
        "/v1/messages/count_tokens": count,
        "/v1/responses": responses,
    }
    gets = sorted(p for p, ops in spec["paths"].items() if "get" in ops)
    posts = st.tuples(st.just("POST"), st.sampled_from(sorted(bodies)))
    good = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    headers = st.sampled_from(
        [good] * 12
        + [
            {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"},
            {"Authorization": f"Bearer {KEY}"},
            {"Authorization": "Bearer wrong", "Content-Type": "application/json"},
            {"Content-Type": "application/json"},
            {"Authorization": f"Basic {KEY}", "Content-Type": "application/json; charset=utf-8"},
            {"x-api-key": KEY, "Content-Type": "application/json", "anthropic-version": "x"},
            {"x-api-key": "wrong", "Content-Type": "application/json"},
        ]
    )

    @st.composite
    def one(draw):
        kinds = ["chat"] * 3 + ["completion"] * 2 + ["messages"] * 3 + ["responses"] * 3
        kind = draw(st.sampled_from([*kinds, "count", "get", "odd"]))
        head = draw(headers)
        paths = {
            "chat": "/v1/chat/completions",
            "completion": "/v1/completions",
            "messages": "/v1/messages",
            "count": "/v1/messages/count_tokens",
            "responses": "/v1/responses",
        }
        if kind in paths:
            return "POST", paths[kind], head, draw(bodies[paths[kind]])
        if kind == "get":
            return "GET", draw(st.sampled_from(gets)), head, None
        method, path = draw(posts)
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", method]))
        body = st.one_of(st.none(), bodies[path])
        path = draw(st.sampled_from([path, path + "/", "/v1/nothing", "/v1/models?x=%ff", "//"]))
        return method, path, head, draw(body)

    return one()


@pytest.fixture(scope="module")
def fuzzed(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    args = [
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--num-draft-tokens", "3", "--api-key", KEY, "--max-tokens-limit", "4",
        "--max-body", "256K", "--request-timeout", "30", "--max-queue", "64",
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url, root / "stderr.log"


def send(url: str, method: str, path: str, headers: dict, body: bytes | None):
    host, _, port = url.removeprefix("http://").split("/", 1)[0].rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_openapi_document_describes_every_route(fuzzed):
    proc, url, _ = fuzzed
    r = request("GET", url.removesuffix("/v1") + "/openapi.json", key=None)
    assert r.status_code == 200
    spec = r.json()
    assert spec["openapi"].startswith("3.")
    routes = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}
    routes |= {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses"}
    assert routes <= set(spec["paths"])
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} == set(chat["required"])


def test_fuzz_every_endpoint(fuzzed, pair, record_property):
    proc, url, log = fuzzed
    base = url.removesuffix("/v1")
    spec = request("GET", base + "/openapi.json", key=None).json()
    seen: dict[int, int] = {}
    begin = time.monotonic()

    @seed(SEED)
    @settings(
        max_examples=CASES,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases(spec, "target"))
    def run(case):
        method, path, headers, body = case
        status, reply = send(base, method, path, headers, body)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (case, status, reply[:500])
        if status == 200:  # (a stream's error event after its headers, in any protocol)
            assert b'"server_error"' not in reply, (case, reply[:500])
            assert b'"api_error"' not in reply, (case, reply[:500])
        assert proc.poll() is None, case

    run()
    elapsed = time.monotonic() - begin
    record_property("fuzz_cases", sum(seen.values()))
    record_property("fuzz_seconds", round(elapsed, 1))
    print(f"{sum(seen.values())} cases in {elapsed:.1f} s, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) == CASES
    assert seen.get(200, 0) >= CASES // 15  # the cases do reach generation
    assert proc.poll() is None
    assert request("GET", base + "/health", key=None).status_code == 200
    expected = generate(pair, [{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0)
    body = {
        "model": "target",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    r = request("POST", url + "/chat/completions", body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected.text
    assert "Traceback" not in log.read_text()


def test_two_token_prompt_max_tokens_1_in_a_batch(fuzzed):
    """The fuzzer's find: a 2-token prompt with max_tokens 1 in a batch with a draft model was
    a 500 (batch.py `_extract` on a draft cache never fed; tests/test_batch.py has it too)."""
    proc, url, _ = fuzzed
    r = request("POST", url + "/completions", {"model": "target", "prompt": "Hi", "max_tokens": 1})
    assert proc.poll() is None and request("GET", url[:-3] + "/health", key=None).status_code == 200
    assert r.status_code == 200, r.text
