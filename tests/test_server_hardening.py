"""Issue 45: what once killed or froze `mlx-spec serve` with one request, each against a real
server process (plus the engine's own guard, in-process). Every test here failed on the main
of 2026-12-03: the process died (logit_bias), the engine thread died and later requests hung
(NaN), or the answer was a 500."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest
import tiny
from conftest import VOCAB
from test_server import KEY, health, request, serving, slow_client, slow_server

from mlx_spec.server.jobs import Job
from mlx_spec.server.protocol import GenRequest
from mlx_spec.server.worker import Engine


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    args = [
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--num-draft-tokens", "3", "--api-key", KEY, "--max-tokens-limit", "64",
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url


def chat_body(**extra) -> dict:
    return {
        "model": "target",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def still_serving(proc, url) -> None:
    """The process lives, /health is ok and an ordinary request is answered."""
    assert proc.poll() is None, "the server process died"
    assert health(url) == 200
    r = request("POST", url + "/chat/completions", chat_body(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def one_400(r, *words) -> str:
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "\n" not in message
    for w in words:
        assert w in message, message
    return message


@pytest.mark.parametrize("token", [VOCAB, VOCAB + 1, 10**6, 2**31 - 1, 2**31, 10**30])
def test_logit_bias_past_the_vocabulary_is_400_not_a_heap_corruption(server, token):
    proc, url = server
    r = request("POST", url + "/chat/completions", chat_body(logit_bias={str(token): 1}))
    one_400(r, "logit_bias")
    still_serving(proc, url)


def test_logit_bias_at_the_last_id_still_works(server):
    proc, url = server
    r = request("POST", url + "/chat/completions", chat_body(logit_bias={str(VOCAB - 1): 100}))
    assert r.status_code == 200, r.text
    still_serving(proc, url)


NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"]
NUMERIC = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("value", NON_FINITE)
def test_non_finite_numbers_are_400_and_the_engine_lives(server, field, value):
    proc, url = server
    raw = json.dumps(chat_body(**{field: 12345})).encode().replace(b"12345", value)
    r = request("POST", url + "/chat/completions", raw)
    one_400(r, "finite")
    still_serving(proc, url)


def test_non_finite_inside_logit_bias_and_completions(server):
    proc, url = server
    raw = b'{"model": "target", "prompt": "Hi", "max_tokens": 4, "logit_bias": {"5": NaN}}'
    one_400(request("POST", url + "/completions", raw), "finite")
    still_serving(proc, url)


def test_lone_surrogate_is_400(server):
    proc, url = server
    raw = b'{"model": "target", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    one_400(request("POST", url + "/chat/completions", raw), "surrogate")
    still_serving(proc, url)


@pytest.mark.parametrize(
    "name",
    ["messages", "range", "raise_exception", "namespace", "self", "conversations"]
    + ["sanitize_control_tokens"],
)
def test_template_kwargs_cannot_replace_the_templates_own_names(server, name):
    proc, url = server
    r = request("POST", url + "/chat/completions", chat_body(chat_template_kwargs={name: "x"}))
    one_400(r, "chat_template_kwargs")
    still_serving(proc, url)


# ------------------------------------------------------------ the engine thread's own guard


def run_job(engine: Engine, loop, req: GenRequest, seconds: float = 60) -> tuple:
    """Submit a job and wait for its last item ("done" or "error")."""
    job = Job(req, loop, time.monotonic() + seconds)
    engine.submit(job)
    return last_item(job, loop, seconds)


def last_item(job: Job, loop, seconds: float = 60) -> tuple:
    """A submitted job's last item ("done" or "error"), waited for at most `seconds`."""

    async def last():
        while True:
            item = await asyncio.wait_for(job.items.get(), seconds)
            if item[0] in ("done", "error"):
                return item

    return asyncio.run_coroutine_threadsafe(last(), loop).result(seconds + 5)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def gen_request(text="Hello") -> GenRequest:
    return GenRequest("chat", "tiny", [{"role": "user", "content": text}], 4, temperature=0)


def test_an_error_before_serving_fails_that_request_alone(pair, loop):
    """Once `batchable` raised on a NaN temperature, the thread ended and every later request
    waited for its timeout. Now that request gets a 500 and the next is served."""
    engine = Engine(pair, "tiny", lambda name: pair, ["tiny"])
    engine.start()
    real = engine.batchable
    calls = []

    def broken(req):
        calls.append(req)
        if len(calls) == 1:
            raise ValueError("a bug before the request is served")
        return real(req)

    engine.batchable = broken
    try:
        kind, err = run_job(engine, loop, gen_request())
        assert kind == "error" and err.status == 500 and "a bug" in err.message
        kind, outcome = run_job(engine, loop, gen_request())
        assert kind == "done", outcome
        assert engine.alive and engine.thread.is_alive()
    finally:
        engine.stop(timeout=10)


def test_a_row_that_fails_to_join_the_batch_again_fails_with_the_request_it_took(tiny_models, loop):
    """A recurrent target's batch drained to one row runs it alone; a request that comes is
    taken from the queue and the row joins the batch again beside it. Should that fail (a
    bug), both answer 500 and the next request is served: the request taken once waited for
    its deadline, answered by nobody (found by reading, after an adversarial run)."""
    from mlx_spec import load_pair

    pair = load_pair(target=str(tiny_models.mamba), drafter="ngram")
    engine = Engine(pair, "tiny", lambda name: pair, ["tiny"], max_batch=4)
    never_ends = {"logit_bias": {t: -100.0 for t in pair.tokenizer.eos_token_ids}}
    long = GenRequest("chat", "tiny", [{"role": "user", "content": "A long story"}], 4000,
                      temperature=0, penalties=never_ends)  # fmt: skip
    jobs = [Job(r, loop, time.monotonic() + 60) for r in (long, gen_request("Hi"))]
    for job in jobs:  # queued before the engine starts: they share a batch
        engine.submit(job)
    engine.start()
    try:
        assert last_item(jobs[1], loop)[0] == "done"
        deadline = time.monotonic() + 30
        while engine.metrics.rows_alone < 1:  # the long row goes on alone
            assert time.monotonic() < deadline, "the long row never went alone"
            time.sleep(0.01)
        batch = engine.resident.batch

        def broken(*args, **kwargs):
            raise RuntimeError("a bug as the row joins the batch again")

        batch.add = broken
        kind, err = run_job(engine, loop, gen_request("Late"), seconds=20)
        assert kind == "error" and err.status == 500, (kind, err)
        kind, err = last_item(jobs[0], loop)
        assert kind == "error" and err.status == 500 and "joins the batch again" in err.message
        assert engine.metrics.rows_rejoined == 0
        del batch.add  # (the batch is made anew after a failure anyway)
        kind, outcome = run_job(engine, loop, gen_request("Next"))
        assert kind == "done", outcome
        assert engine.alive
    finally:
        engine.stop(timeout=10)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("where", ["_take", "_serve"])
def test_a_dead_engine_fails_its_jobs_and_says_so(pair, loop, where):
    """If the thread's loop itself ever breaks, the running job gets a 503, new ones are
    refused, `alive` turns false (/health answers 503) and the server is told to exit."""
    engine = Engine(pair, "tiny", lambda name: pair, ["tiny"])
    died = threading.Event()
    engine.on_death = died.set
    engine.start()

    def broken(job, *_):
        raise SystemExit("the loop broke")  # not an Exception: _take's own guard lets it pass

    setattr(engine, where, broken)  # _serve: inside _take, with the job among the running
    kind, err = run_job(engine, loop, gen_request())
    assert kind == "error" and err.status == 503 and "engine stopped" in err.message
    assert died.wait(5)
    engine.thread.join(5)
    assert not engine.alive
    with pytest.raises(Exception) as info:
        engine.check_capacity()
    assert info.value.status == 503


# ------------------------------------------------------------------------ shutdown wording


@pytest.fixture
def draining(tiny_models, tmp_path):
    cfg = {**tiny.llama_config(VOCAB, layers=4), "max_position_embeddings": 8192}
    weights = tiny.random_weights(cfg, seed=0)
    weights["lm_head.weight"][2] = 0  # <|im_end|> is never chosen: replies run to max_tokens
    path = tiny.write_model(tmp_path / "long", cfg, weights, tiny_models.tokenizer)
    yield from slow_server(path, tmp_path, request_timeout=120, shutdown_timeout=1)


def test_sigterm_cutting_a_stream_says_shutting_down_not_timed_out(draining):
    proc, url = draining
    stream = slow_client(url).completions.create(
        model="long", prompt="The", max_tokens=5000, stream=True, temperature=0
    )
    chunks = iter(stream)
    next(chunks)
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(Exception) as info:
        for _ in chunks:
            pass
    assert "shutting down" in str(info.value), info.value
    assert "timed out" not in str(info.value)
    assert proc.wait(30) == 0


def test_health_tells_nothing_of_the_traffic(server):
    """/health needs no key: it says whether the server lives and what it serves, not whether
    it is busy (a key could time another's requests by it; /metrics has it, behind the keys)."""
    proc, url = server
    r = request("GET", url.removesuffix("/v1") + "/health", key=None)
    assert r.status_code == 200 and set(r.json()) == {"status", "model"}


@pytest.mark.parametrize("field", NUMERIC)
def test_an_integer_too_big_for_a_float_is_400(server, field):
    """A 400-digit integer: `math.isfinite` raised OverflowError on it (a 500)."""
    proc, url = server
    raw = json.dumps(chat_body(**{field: 12345})).encode().replace(b"12345", b"9" * 400)
    one_400(request("POST", url + "/chat/completions", raw), field)
    still_serving(proc, url)


def test_deeply_nested_tools_are_400(server):
    """Hundreds of levels of nesting inside tools: the template's renderer recursed past
    Python's limit (600 levels made a 500); the body's nesting is bounded first."""
    proc, url = server
    nested: dict = {"type": "string"}
    for _ in range(200):  # (400 levels: json.dumps on this side stops near 1000)
        nested = {"type": "object", "properties": {"x": nested}}
    tool = {"type": "function", "function": {"name": "f", "parameters": nested}}
    r = request("POST", url + "/chat/completions", chat_body(tools=[tool]))
    one_400(r, "nests deeper")
    still_serving(proc, url)


def test_an_unknown_field_named_with_crlf_is_still_answered(server):
    """Unknown fields are named in X-Ignored-Fields; a name holding CR/LF once made h11 refuse
    the header after the whole generation (a 500). Now the name is cleaned."""
    proc, url = server
    body = json.dumps({**chat_body(), "x\r\ninjected: 1": 1, "caf\u00e9": 2}).encode()
    r = request("POST", url + "/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    still_serving(proc, url)


def test_one_key_cannot_push_anothers_stored_responses_out():
    """The Responses store is shared and bounded; a key that stores many responses evicts its
    own oldest first, past its share, and another key's conversation stays."""
    from mlx_spec.server.responses import PER_KEY_SHARE, ResponseStore

    store = ResponseStore(max_items=8, max_bytes=1 << 20)
    store.put("b", "resp_b", {"output": ["b's"]})
    for i in range(50):
        store.put("a", f"resp_a{i}", {"output": [i]})
    assert store.get("b", "resp_b") == {"output": ["b's"]}
    assert sum(1 for p, _ in store.entries if p == "a") == 8 // PER_KEY_SHARE
    assert store.get("a", "resp_a49") is not None and store.get("a", "resp_a0") is None
    assert store.get("a", "resp_b") is None  # another key's id: not found for this one
