"""`mlx-spec serve --max-batch`: concurrent requests share one batch that still drafts.

One server (a tiny target whose end-of-sequence row is muted, so greedy replies run to
max_tokens, and a noisy copy of it as the draft, k fixed at 3, two API keys). A long "anchor"
stream keeps the batch running while the other requests join at staggered times and leave;
every reply must equal the same request decoded alone by the single-stream engine
(`mlx_spec.generate`) or served alone. Requests a batch cannot take (logprobs, penalties) wait
for the batch to finish and run single-stream, still equal to `generate`.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time

import mlx.core as mx
import openai
import pytest
import tiny
from conftest import VOCAB
from mlx_lm.utils import common_prefix_len
from real_configs import _llama3_rope
from test_eagle import head_weights, subset
from test_eagle import write_head as write_eagle
from test_mtp import original_checkpoint
from test_server import metrics as read_metrics
from test_server import serving

from mlx_spec import generate, load_pair
from mlx_spec.cli import main as cli_main
from mlx_spec.core.processors import make_processors

KEY_A, KEY_B = "key-a", "key-b"
K = 3
TOKENS = 40
LONG = 200  # a reply that runs for a second or so (the grace period is 10 s)
ANCHOR_TOKENS = 400  # next_turn_beside_others' long request
PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "Paris is the capital of France. Berlin is the capital of",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch_models")
    # Llama 3.1's rope scaling: its frequencies stay lazy after load (threads.py), so the
    # batch must run where the pair was loaded
    cfg = {
        **tiny.llama_config(VOCAB, layers=4),
        "max_position_embeddings": 8192,
        "rope_scaling": _llama3_rope(8.0),
    }
    weights = tiny.random_weights(cfg, seed=0)
    weights["lm_head.weight"][2] = 0  # <|im_end|>: never the argmax of a peaked head
    draft = tiny.noisy(weights, 0.05)
    draft["lm_head.weight"][2] = 0
    target = tiny.write_model(root / "long", cfg, weights, tiny_models.tokenizer)
    draft = tiny.write_model(root / "long-draft", cfg, draft, tiny_models.tokenizer)
    return root, target, draft


@pytest.fixture(scope="module")
def pair(models):
    _, target, draft = models
    return load_pair(target=str(target), draft=str(draft))


@pytest.fixture(scope="module")
def server(models):
    root, target, draft = models
    args = [
        "--target", str(target), "--draft", str(draft), "--drafter", "model",
        "--num-draft-tokens", str(K), "--max-batch", "4", "--api-key", KEY_A, "--api-key", KEY_B,
        "--max-queue", "16", "--admin-key", KEY_A,  # KEY_A reads the whole server's /metrics
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url


def client(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def streamed(url: str, key: str, kind: str, text: str, delay: float = 0.0, **kw) -> dict:
    """A streaming request after `delay` seconds: its text, finish reason, usage, speculation."""
    time.sleep(delay)
    c = client(url, key)
    common = {"model": "long", "max_tokens": TOKENS, "stream": True, **kw}
    common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        chunks = list(c.chat.completions.create(messages=chat(text), **common))
        out = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        chunks = list(c.completions.create(prompt=text, **common))
        out = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    return {
        "text": out,
        "finish": finish,
        "tokens": chunks[-1].usage.completion_tokens,
        "spec": chunks[-1].model_extra["speculation"],
    }


def metrics(url: str) -> dict[str, float]:
    return read_metrics(url, KEY_A)


def wait_until(condition, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_batched_requests_equal_each_alone(server, pair):
    """Rows of two keys join a running batch at staggered times and leave; then a logprobs and
    a penalty request join the anchor's batch as rows of their own (once they waited and ran
    alone), and the anchor's client leaves. Every reply equals its request decoded alone."""
    _, url = server
    anchor = client(url).completions.create(
        model="long", prompt="The", max_tokens=5000, stream=True, temperature=0
    )
    anchor_chunks = iter(anchor)
    next(anchor_chunks)  # generating now (greedy, no end of sequence: for seconds)
    jobs = [  # (key, kind, prompt, settings)
        (KEY_A, "chat", PROMPTS[0], {"temperature": 0}),
        (KEY_B, "completion", PROMPTS[1], {"temperature": 0}),
        (KEY_A, "completion", PROMPTS[2], {"temperature": 0.8, "seed": 5}),
        (KEY_B, "chat", PROMPTS[3], {"temperature": 0}),
        (KEY_A, "completion", PROMPTS[0], {"temperature": 0, "max_tokens": 9}),  # leaves early
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(streamed, url, key, kind, text, 0.05 * i, **kw)
            for i, (key, kind, text, kw) in enumerate(jobs)
        ]
        wait_until(lambda: metrics(url)["mlx_spec_batch_size"] >= 3, "the rows never batched")
        batched = [f.result() for f in futures]  # while the anchor still runs
        wait_until(lambda: metrics(url)["mlx_spec_batch_size"] == 1, "the anchor is not alone")
        # logprobs and a penalty: rows beside the anchor, each with its own processors
        featured = [
            pool.submit(streamed, url, KEY_B, "chat", PROMPTS[1], temperature=0, logprobs=True),
            pool.submit(
                streamed, url, KEY_A, "chat", PROMPTS[2], temperature=0, frequency_penalty=0.5
            ),
        ]
        single = [f.result() for f in featured]
        anchor.close()  # the client leaves: the batch ends
    for (_, kind, text, kw), got in zip(jobs, batched, strict=True):
        settings = {"max_tokens": TOKENS, **kw}
        expected = generate(pair, chat(text) if kind == "chat" else text, **settings)
        if "seed" not in kw:  # greedy: the target's own reply, whatever the batch
            assert got["text"] == expected.text
        assert got["tokens"] == settings["max_tokens"] and got["finish"] == "length"
        assert got["spec"]["batched"] is True
        assert got["spec"]["drafted"] > 0  # the rows did draft
        assert got["spec"]["target_passes"] <= got["tokens"]  # its own rounds, not the batch's
    m = metrics(url)
    assert m["mlx_spec_batch_size_max"] >= 3 and m["mlx_spec_batch_size"] == 0
    assert m["mlx_spec_cancelled_total"] >= 1
    assert 1 < m["mlx_spec_batch_rows_per_pass"] <= 4
    assert m["mlx_spec_batch_size_passes_count"] == m["mlx_spec_batch_passes_total"] > 0
    assert m['mlx_spec_batch_size_passes_bucket{le="4"}'] == m["mlx_spec_batch_passes_total"]
    # the single-stream requests, beside the batch's: equal to generate with their settings
    expected = generate(pair, chat(PROMPTS[1]), max_tokens=TOKENS, temperature=0)
    assert single[0]["text"] == expected.text and single[0]["spec"]["batched"] is True
    penalty = make_processors(frequency_penalty=0.5)
    expected = generate(
        pair, chat(PROMPTS[2]), max_tokens=TOKENS, temperature=0, processors=penalty
    )
    assert single[1]["text"] == expected.text and single[1]["spec"]["batched"] is True
    # the seeded sampled row: served alone (a batch of one), it samples what it did in the batch
    key, kind, text, kw = jobs[2]
    again = streamed(url, key, kind, text, **kw)
    assert again["text"] == batched[2]["text"] and again["spec"]["batched"] is True
    sampled = generate(pair, text, max_tokens=TOKENS, num_draft_tokens=K, **kw)
    assert again["text"] == sampled.text


def test_a_stop_string_ends_a_row_and_the_others_go_on(server, pair):
    _, url = server
    expected = [generate(pair, chat(t), max_tokens=TOKENS, temperature=0).text for t in PROMPTS]
    stop = expected[0][len(expected[0]) // 2 :][:3]  # a piece of the first reply's second half
    cut = expected[0][: expected[0].find(stop)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(
                streamed,
                url,
                KEY_A,
                "chat",
                t,
                temperature=0,
                **({"stop": [stop]} if i == 0 else {}),
            )
            for i, t in enumerate(PROMPTS)
        ]
        got = [f.result() for f in futures]
    assert got[0]["text"] == cut and got[0]["finish"] == "stop"
    for g, e in zip(got[1:], expected[1:], strict=True):
        assert g["text"] == e  # the others ran to max_tokens, unchanged
    wait_until(lambda: metrics(url)["mlx_spec_batch_size"] == 0, "a row stayed in the batch")


def test_a_conversation_goes_on_from_its_kept_cache(server, pair):
    """Turn 2 of a conversation, batched, starts from the cache turn 1 left (its usage and
    /metrics count the reused prompt tokens); turn 3 (logprobs, a row too) starts from the
    cache the batched row handed back. Every reply equals `generate` (what the serial server
    answers); another key sending the same conversation reuses nothing of it."""
    _, url = server
    messages = chat("Tell me about a lighthouse keeper and the sea")
    expected = [generate(pair, messages, max_tokens=TOKENS, temperature=0).text]
    c = client(url)
    first = c.chat.completions.create(
        model="long", messages=messages, max_tokens=TOKENS, temperature=0
    )
    assert first.choices[0].message.content == expected[0]
    before = metrics(url)["mlx_spec_prompt_tokens_cached_total"]
    cached, previous = [], first.usage.prompt_tokens
    for turn, extra in ((2, {}), (3, {"logprobs": True})):
        messages = messages + [
            {"role": "assistant", "content": expected[-1]},
            {"role": "user", "content": f"And in part {turn}?"},
        ]
        expected.append(generate(pair, messages, max_tokens=TOKENS, temperature=0).text)
        r = c.chat.completions.create(
            model="long", messages=messages, max_tokens=TOKENS, temperature=0, **extra
        )
        assert r.choices[0].message.content == expected[-1]
        assert r.model_extra["speculation"]["batched"] is True
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        # the previous turn's prompt at least (a random model's reply may be tokenized
        # otherwise when the template renders it back)
        assert cached[-1] >= previous, (turn, cached[-1], previous)
        previous = r.usage.prompt_tokens
        if turn == 2:
            assert metrics(url)["mlx_spec_prompt_tokens_cached_total"] - before == cached[-1]
    other = client(url, KEY_B).chat.completions.create(
        model="long", messages=messages, max_tokens=4, temperature=0
    )
    assert other.usage.prompt_tokens_details.cached_tokens < 10  # the template's start at most


SECRET = "Berlin is the capital of Germany. Speculative decoding drafts tokens with a small model"


def test_rows_look_up_only_their_own_text(models, pair):
    """Prompt lookup in a batch is per row and per key: Bob's probes of Alice's text (3-token
    slices), batched beside her running request, draft exactly what they draft with nobody
    beside; and his rows search his key's history (his earlier replies), not hers."""
    root, target, _ = models
    args = ["--target", str(target), "--drafter", "ngram", "--num-draft-tokens", "4",
            "--max-batch", "4", "--api-key", KEY_A, "--api-key", KEY_B,
            "--admin-key", KEY_A]  # fmt: skip
    ids = pair.tokenizer.encode(SECRET)
    probes = [ids[i : i + 3] for i in range(0, len(ids) - 3, 3)]
    (root / "lookup").mkdir(exist_ok=True)
    with serving(args, root / "lookup") as (_, url):

        def observe() -> list[tuple]:
            out = []
            for probe in probes:
                r = client(url, KEY_B).completions.create(
                    model="long", prompt=probe, max_tokens=3, temperature=0
                )
                spec = r.model_extra["speculation"]
                assert spec["batched"] is True and spec["history_lookup"] is True
                out.append((r.choices[0].text, spec["drafted"], spec["accepted"]))
            return out

        first = observe()  # fills Bob's history with his probes and replies
        alone = observe()
        # the second time his history proposes each reply he got the first time
        assert sum(a for *_, a in alone) > sum(a for *_, a in first)
        alice = client(url, KEY_A).completions.create(
            model="long", prompt=SECRET * 3, max_tokens=5000, stream=True, temperature=0
        )
        chunks = iter(alice)
        next(chunks)  # her row runs, her text in its lookup
        beside = observe()
        assert metrics(url)["mlx_spec_batch_size_max"] >= 2  # the probes shared her passes
        alice.close()
    assert beside == alone


@pytest.fixture(scope="module")
def head_server(models):
    """The long target drafted by a random EAGLE-3 head (k fixed at 3), --max-batch 4: the
    head drafts inside the batch (decode/batch_head.py)."""
    root, target, _ = models
    head = root / "eagle3"
    cfg = json.loads((target / "config.json").read_text())
    write_eagle(head, cfg, head_weights(cfg, subset(VOCAB, 96, 1), seed=5, embed=False))
    args = ["--target", str(target), "--drafter", "eagle3", "--head", str(head),
            "--num-draft-tokens", str(K), "--max-batch", "4", "--api-key", KEY_A]  # fmt: skip
    log = root / "head_server"
    log.mkdir()
    with serving(args, log) as (_, url):
        yield url, head, log


def long_anchor(url: str):
    """A long greedy stream, decoding when this returns: on a pair whose lone request runs
    as a single stream (a head's), it runs so until the next request comes, then goes on as
    a batch row beside it."""
    anchor = client(url).completions.create(
        model="long", prompt="The", max_tokens=5000, stream=True, temperature=0
    )
    next(iter(anchor))
    return anchor


def wait_taken(url: str, n: int, futures: list) -> None:
    """Until `n` requests have arrived: taken, queued or answered (`futures`' done ones).
    Sent one by one so, they are taken in that order (rows join the batch as they are
    taken, the rest wait for a free row)."""

    def arrived():
        m = metrics(url)
        return m["mlx_spec_running"] + m["mlx_spec_queue_waiting"] + sum(f.done() for f in futures)

    wait_until(lambda: arrived() >= n, f"{n} requests never arrived")


def test_a_head_pair_drafts_alone_and_in_a_batch(head_server, pair):
    """The default demo pair drafts with an EAGLE-3 head. A lone request runs as a single
    stream (a batch of one ran at 0.68x of it); requests that queue while one runs share
    one batch in which the head drafts for every row, greedy and seeded sampled alike: each
    greedy reply is the target's, the seeded one samples what it does alone with the head.
    The turn after a batched one starts from the caches and head state that row handed back
    (once, the head's features were lost and the whole prompt was prefilled again)."""
    url, head, log = head_server
    assert "batch without drafts" not in (log / "stderr.log").read_text()
    # nobody beside it (not the seeded row's prompt below: a row that starts from a kept
    # decoder drafts from its head's state, so its samples may differ from a fresh run's)
    lone = streamed(url, KEY_A, "chat", PROMPTS[1], temperature=0)
    assert lone["text"] == generate(pair, chat(PROMPTS[1]), max_tokens=TOKENS, temperature=0).text
    assert lone["spec"]["batched"] is False and lone["spec"]["drafted"] > 0
    anchor = long_anchor(url)  # alone; the next ones join it in a batch, one by one
    seeded = {"temperature": 0.8, "seed": 7}
    short = 4  # the first row's reply: its prompt is most of what its caches hold
    jobs = [(PROMPTS[1], {"temperature": 0, "max_tokens": short})]
    jobs += [(text, {"temperature": 0}) for text in PROMPTS[2:]] + [(PROMPTS[0], seeded)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        for i, (text, kw) in enumerate(jobs):  # one by one: the queue's order is known
            futures.append(pool.submit(streamed, url, KEY_A, "chat", text, **kw))
            wait_taken(url, i + 2, futures)
        anchor.close()  # (the fourth waited for a free row: the anchor's)
        queued = [f.result() for f in futures]
    for (text, kw), got in zip(jobs[:3], queued[:3], strict=True):
        settings = {"max_tokens": TOKENS, **kw}
        assert got["text"] == generate(pair, chat(text), **settings).text
        assert got["spec"]["batched"] is True and got["spec"]["drafted"] > 0
        assert got["spec"]["drafter"] == "eagle3"  # the head drafted in the batch
        assert got["tokens"] == settings["max_tokens"]
    assert metrics(url)["mlx_spec_batch_size_max"] >= 3
    # the seeded sampled row: batched too, it samples what it samples alone with the head
    head_pair = load_pair(
        target=str(pair.config.target), drafter="eagle3", head=str(head), num_draft_tokens=K
    )
    alone = generate(head_pair, chat(PROMPTS[0]), max_tokens=TOKENS, **seeded)
    assert queued[3]["text"] == alone.text and queued[3]["spec"]["batched"] is True
    assert queued[3]["spec"]["drafted"] > 0
    # the first row's prompt again, alone: it starts from the caches and the head state
    # that row handed back: all of the prompt but its last token is reused, the head drafts
    again = streamed(url, KEY_A, "chat", PROMPTS[1], temperature=0)
    assert again["text"] == generate(pair, chat(PROMPTS[1]), max_tokens=TOKENS).text
    assert again["spec"]["batched"] is False and again["spec"]["drafted"] > 0
    prompt = len(pair.tokenizer.apply_chat_template(chat(PROMPTS[1]), add_generation_prompt=True))
    assert again["spec"]["prompt_tokens_reused"] == prompt - 1


def test_a_head_batch_drained_to_one_row_runs_it_as_a_stream(head_server, pair):
    """Two requests share a batch, the head drafting for both; once the short one ends the
    long one goes on as a single stream (a head's batch of one ran at 0.68x of it), and when
    a third request comes it joins a batch again from its caches. Its reply, seeded and
    sampled, is what it samples alone with the head; the others' are the target's."""
    url, head, _ = head_server
    before = metrics(url)
    anchor = long_anchor(url)  # alone; the next two join it in a batch
    seeded = {"temperature": 0.8, "seed": 3, "max_tokens": 800}
    # a prompt that shares no prefix with any kept one: a row that starts from another
    # request's caches drafts from a head state computed otherwise, so a seeded reply could
    # sample otherwise than a fresh run (the same distribution)
    text = "Zebras and the sea"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long = pool.submit(streamed, url, KEY_A, "completion", text, **seeded)
        wait_taken(url, 2, [long])
        short = pool.submit(streamed, url, KEY_A, "chat", PROMPTS[1], temperature=0, max_tokens=4)
        wait_taken(url, 3, [long, short])
        anchor.close()
        first = short.result()
        alone = "mlx_spec_batch_rows_alone_total"
        wait_until(lambda: metrics(url)[alone] > before[alone], "the long row never went alone")
        late = pool.submit(streamed, url, KEY_A, "chat", PROMPTS[3], temperature=0)
        third, got = late.result(), long.result()
    after = metrics(url)
    rejoined = "mlx_spec_batch_rows_rejoined_total"
    assert after[rejoined] > before[rejoined]
    assert first["text"] == generate(pair, chat(PROMPTS[1]), max_tokens=4, temperature=0).text
    assert third["text"] == generate(pair, chat(PROMPTS[3]), max_tokens=TOKENS).text
    assert third["spec"]["batched"] is True
    head_pair = load_pair(
        target=str(pair.config.target), drafter="eagle3", head=str(head), num_draft_tokens=K
    )
    assert got["text"] == generate(head_pair, text, **seeded).text
    assert got["spec"]["prompt_tokens_reused"] == 0
    assert got["spec"]["batched"] is True and got["spec"]["drafted"] > 0


def beside_a_short_one(url: str, stream, prompt: str) -> tuple[list, dict]:
    """`stream` decodes alone; a short greedy request comes and is answered while it goes on
    (it was not waited for): the stream's chunks and the short one's result."""
    chunks = iter(stream)
    got = [next(chunks)]  # decoding alone now
    short = streamed(url, KEY_A, "chat", prompt, temperature=0, max_tokens=4)
    assert metrics(url)["mlx_spec_running"] == 1  # the long reply goes on
    return got + list(chunks), short


def test_a_lone_stream_moves_into_the_batch_when_another_comes(head_server, pair):
    """A lone request decodes as a single stream (a head's batch of one is slower); one that
    comes while it runs does not wait for its whole reply (once, an 8-token reply of the demo
    pair waited 6 s behind a 150-token one): the stream pauses between rounds and goes on as
    a batch row from its caches beside the newcomer. Each reply is what it is alone: the
    newcomer's the target's, the seeded sampled stream's what it samples alone with the head."""
    url, head, _ = head_server
    before = metrics(url)
    seeded = {"temperature": 0.8, "seed": 11, "max_tokens": 1000}
    text = "Otters and the moon"  # no kept prefix: a fresh run's head state
    stream = client(url, KEY_A).completions.create(
        model="long", prompt=text, stream=True, stream_options={"include_usage": True}, **seeded
    )
    got, short = beside_a_short_one(url, stream, PROMPTS[1])
    assert short["text"] == generate(pair, chat(PROMPTS[1]), max_tokens=4, temperature=0).text
    assert short["spec"]["batched"] is True
    head_pair = load_pair(
        target=str(pair.config.target), drafter="eagle3", head=str(head), num_draft_tokens=K
    )
    out = "".join(ch.choices[0].text for ch in got if ch.choices)
    assert out == generate(head_pair, text, **seeded).text
    spec = got[-1].model_extra["speculation"]
    assert spec["batched"] is True and spec["drafted"] > 0 and spec["prompt_tokens_reused"] == 0
    moved = "mlx_spec_batch_streams_moved_total"
    assert metrics(url)[moved] == before[moved] + 1


def test_a_lone_stream_with_a_schema_and_penalties_moves_and_goes_alone_again(head_server, pair):
    """A lone request with a JSON schema, a frequency penalty and log-probabilities moves into
    the batch when another comes (its grammar from where its reply began, its matcher
    caught up on what it emitted), and goes on alone again, its processors with it, when the
    other leaves: its text is what it is alone."""
    url, _, _ = head_server
    before = metrics(url)
    story = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400}},
             "required": ["story"], "additionalProperties": False}  # fmt: skip
    messages = chat("Tell a story about otters")
    stream = client(url, KEY_A).chat.completions.create(
        model="long", messages=messages, max_tokens=120, temperature=0, stream=True,
        frequency_penalty=0.5, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": story}},
    )  # fmt: skip
    got, short = beside_a_short_one(url, stream, PROMPTS[3])
    assert short["text"] == generate(pair, chat(PROMPTS[3]), max_tokens=4, temperature=0).text
    penalty = make_processors(frequency_penalty=0.5)
    expected = generate(
        pair, messages, max_tokens=120, temperature=0, processors=penalty, schema=story
    )
    deltas = [ch.choices[0] for ch in got if ch.choices and ch.choices[0].delta.content]
    assert "".join(c.delta.content for c in deltas) == expected.text
    assert expected.text.startswith('{"story": "') or expected.text.startswith('{"story":"')
    assert all(c.logprobs is not None and c.logprobs.content for c in deltas)
    assert all(isinstance(t.logprob, float) for c in deltas for t in c.logprobs.content)
    after = metrics(url)
    moved, alone = "mlx_spec_batch_streams_moved_total", "mlx_spec_batch_rows_alone_total"
    assert after[moved] == before[moved] + 1 and after[alone] == before[alone] + 1


@pytest.mark.parametrize("which", ["server", "head_server"])
def test_requests_with_one_system_prompt_prefill_it_once(which, request, pair):
    """An agent's sub-tasks come together with one long system prompt: the second starts from
    a copy of the first's caches while that one runs (a batch row; with a head, its head's
    state too), so only what follows the shared prefix is prefilled; another key's request
    shares nothing. Every reply is the target's."""
    fixture = request.getfixturevalue(which)
    url = fixture[1] if which == "server" else fixture[0]
    system = f"({which}) You are a careful assistant. " + "Cite the file you read. " * 16
    first = [{"role": "system", "content": system}, {"role": "user", "content": "What is new?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "List tests."}]
    stream = client(url).chat.completions.create(
        model="long", messages=first, max_tokens=LONG, temperature=0, stream=True
    )
    chunks = iter(stream)
    got = [next(chunks)]  # decoding (alone, on a head's pair: it moves into the batch)
    if which == "server":  # (the head's server has one key)
        other = client(url, KEY_B).chat.completions.create(
            model="long", messages=second, max_tokens=4, temperature=0
        )
        # (its own key's earlier requests may share the template's first tokens, no more)
        assert other.usage.prompt_tokens_details.cached_tokens < 8
    reply = client(url).chat.completions.create(
        model="long", messages=second, max_tokens=TOKENS, temperature=0
    )
    got += list(chunks)
    ids = [
        pair.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in (first, second)
    ]
    shared = common_prefix_len(*ids)
    assert shared > 100
    assert reply.usage.prompt_tokens_details.cached_tokens == shared
    expected = generate(pair, second, max_tokens=TOKENS, temperature=0).text
    assert reply.choices[0].message.content == expected
    text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
    assert text == generate(pair, first, max_tokens=LONG, temperature=0).text


def next_turn_beside_others(url: str, messages: list[dict], jobs: list) -> tuple:
    """A long request runs; a conversation's next turn (`messages`) and `jobs` ((kind, text)
    each, streamed) are sent while it does and share a batch: their results, the turn's
    response and the long request's whole text (greedy: ANCHOR_TOKENS of PROMPTS[0])."""
    anchor = client(url).completions.create(
        model="long", prompt=PROMPTS[0], max_tokens=ANCHOR_TOKENS, stream=True, temperature=0
    )
    chunks = iter(anchor)
    text = [next(chunks)]  # a row runs (or a lone stream, which moves into the batch)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        turn = pool.submit(
            lambda: client(url).chat.completions.create(
                model="long", messages=messages, max_tokens=TOKENS, temperature=0
            )
        )
        others = [
            pool.submit(streamed, url, KEY_A, kind, text, 0.05 * i, temperature=0)
            for i, (kind, text) in enumerate(jobs)
        ]
        wait_until(lambda: metrics(url)["mlx_spec_batch_size"] >= 2, "the rows never batched")
        got = [f.result() for f in others]
        r = turn.result()
    text += list(chunks)
    assert metrics(url)["mlx_spec_batch_size_max"] >= 2
    return got, r, "".join(c.choices[0].text for c in text if c.choices)


def test_a_sliding_window_pair_batches(tiny_models, tmp_path):
    """A Mistral-style sliding-window target (8-token window) and its noisy copy as the
    draft: concurrent requests share one drafting batch (before, such a pair was served one
    request at a time), a conversation's turn 2 joins the batch from the windowed caches its
    turn 1 left, and every reply (each crosses the window) equals `generate` alone."""
    cfg = tiny.family_configs(VOCAB)["llama_sliding"]
    weights = tiny.family_weights(cfg, seed=0)
    target = tiny.write_model(tmp_path / "long", cfg, weights, tiny_models.tokenizer)
    noisy = tiny.noisy(weights, 0.05)
    draft = tiny.write_model(tmp_path / "long-draft", cfg, noisy, tiny_models.tokenizer)
    sliding = load_pair(target=str(target), draft=str(draft))
    args = ["--target", str(target), "--draft", str(draft), "--drafter", "model",
            "--num-draft-tokens", str(K), "--max-batch", "4", "--api-key", KEY_A,
            "--admin-key", KEY_A]  # fmt: skip
    with serving(args, tmp_path) as (_, url):
        messages = chat(PROMPTS[2])
        first = client(url).chat.completions.create(
            model="long", messages=messages, max_tokens=TOKENS, temperature=0
        )
        turn1 = generate(sliding, messages, max_tokens=TOKENS, temperature=0).text
        assert first.choices[0].message.content == turn1
        assert first.model_extra["speculation"]["batched"] is True  # a batch of one
        messages = messages + [
            {"role": "assistant", "content": turn1},
            {"role": "user", "content": "And then?"},
        ]
        jobs = [("completion", PROMPTS[1]), ("chat", PROMPTS[3])]
        got, r, anchor = next_turn_beside_others(url, messages, jobs)
    long = generate(sliding, PROMPTS[0], max_tokens=ANCHOR_TOKENS, temperature=0)
    assert anchor == long.text  # however it ran (a row, a lone stream, moved between)
    for (kind, text), g in zip(jobs, got, strict=True):
        prompt = chat(text) if kind == "chat" else text
        assert g["text"] == generate(sliding, prompt, max_tokens=TOKENS, temperature=0).text
        assert g["spec"]["batched"] is True and g["spec"]["drafted"] > 0
    expected = generate(sliding, messages, max_tokens=TOKENS, temperature=0).text
    assert r.choices[0].message.content == expected
    assert r.model_extra["speculation"]["batched"] is True
    # turn 1's prompt at least, from the windowed caches its row handed back
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_a_hybrid_recurrent_pair_batches(tiny_models, tmp_path, drafter):
    """A Qwen3.5-shaped hybrid (Gated DeltaNet and attention layers) drafted by prompt lookup
    or a draft model (the tiny Llama draft, an attention model):
    concurrent requests share one batch (before, such a target was served one request at a
    time), rows that reject restore their own recurrent state and replay, and every reply
    equals `generate` alone; a conversation's turn 2 too, its batch row continuing the
    recurrent state the prompt cache kept at the end of turn 1's prompt (which turn 2's
    extends: only the new tokens are prefilled). (Turn 1's reply is not sent back: a random model's
    text can hold special-token markup, which the server tokenises as plain text and
    `generate` does not: the server's prompt was 135 tokens, generate's 124.)"""
    target = write_hybrid(tiny_models, tmp_path)
    args = ["--target", str(target), "--drafter", drafter, "--num-draft-tokens", str(K),
            "--max-batch", "4", "--api-key", KEY_A, "--admin-key", KEY_A]  # fmt: skip
    if drafter == "model":
        hybrid = load_pair(target=str(target), draft=str(tiny_models.draft))
        args += ["--draft", str(tiny_models.draft)]
    else:
        hybrid = load_pair(target=str(target)).configured(drafter="ngram")
    jobs = [("completion", PROMPTS[1]), ("chat", PROMPTS[3]), ("completion", PROMPTS[2])]
    with serving(args, tmp_path) as (_, url):
        messages = chat(PROMPTS[0])
        first = client(url).chat.completions.create(
            model="long", messages=messages, max_tokens=TOKENS, temperature=0
        )
        turn1 = generate(hybrid, messages, max_tokens=TOKENS, temperature=0).text
        assert first.choices[0].message.content == turn1
        messages = messages + [
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "And then?"},
        ]
        got, r, anchor = next_turn_beside_others(url, messages, jobs)
        # a recurrent target's lone request runs alone (it keeps the system checkpoint as it
        # prefills): the long one did, and moved into the batch when the others came
        assert metrics(url)["mlx_spec_batch_streams_moved_total"] >= 1
    long = generate(hybrid, PROMPTS[0], max_tokens=ANCHOR_TOKENS, temperature=0)
    assert anchor == long.text  # however it ran (a row, a lone stream, moved between)
    for (kind, text), g in zip(jobs, got, strict=True):
        prompt = chat(text) if kind == "chat" else text
        assert g["text"] == generate(hybrid, prompt, max_tokens=TOKENS, temperature=0).text
        assert g["spec"]["batched"] is True and g["spec"]["drafter"] == drafter
    expected = generate(hybrid, messages, max_tokens=TOKENS, temperature=0).text
    assert r.choices[0].message.content == expected
    assert r.model_extra["speculation"]["batched"] is True
    # turn 1's prompt but its last token (the checkpoint kept where its prefill ended)
    assert r.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


def write_hybrid(tiny_models, root):
    """A tiny Qwen3.5-shaped hybrid target (Gated DeltaNet and attention layers)."""
    cfg = tiny.family_configs(VOCAB)["qwen3_5"]
    weights = tiny.family_weights(cfg, seed=0)
    weights["language_model.lm_head.weight"][2] = 0  # <|im_end|>: rows run to max_tokens
    return tiny.write_model(root / "long", cfg, weights, tiny_models.tokenizer)


def test_a_hybrid_pairs_rows_share_a_system_prompt_as_they_come(tiny_models, tmp_path):
    """A recurrent state cannot go back to a shared part later, so a batch row keeps a copy
    of its state where its system prompt ends as it prefills (as a single stream does), and
    a sub-task that comes next starts from it: only its own part is prefilled (before, each
    row prefilled the whole system prompt). Both replies are the target's."""
    target = write_hybrid(tiny_models, tmp_path)
    args = ["--target", str(target), "--drafter", "ngram", "--num-draft-tokens", str(K),
            "--max-batch", "4"]  # fmt: skip
    hybrid = load_pair(target=str(target)).configured(drafter="ngram")
    system = "You are a careful assistant. " + "Cite the file you read. " * 16
    asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("What is new?", "List the tests.")]  # fmt: skip
    with serving(args, tmp_path) as (_, url):
        anchor = long_anchor(url)  # (another prompt) the next ones are admitted as rows
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = []
            for i, messages in enumerate(asks):  # one by one: the first is admitted first
                futures.append(
                    pool.submit(
                        client(url).chat.completions.create,
                        model="long",
                        messages=messages,
                        max_tokens=TOKENS,
                        temperature=0,
                    )  # fmt: skip
                )
                wait_taken(url, i + 2, futures)
            first, second = [f.result() for f in futures]
        anchor.close()
    ids = [hybrid.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in asks]
    shared = common_prefix_len(*ids)
    assert shared > 100
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert shared - 8 <= second.usage.prompt_tokens_details.cached_tokens <= shared
    for messages, reply in zip(asks, (first, second), strict=True):
        expected = generate(hybrid, messages, max_tokens=TOKENS, temperature=0).text
        assert reply.choices[0].message.content == expected
        assert reply.model_extra["speculation"]["batched"] is True


def test_a_hybrid_pair_with_its_mtp_layer_drafts_in_the_batch(tiny_models, tmp_path):
    """Qwen3.5 with its own MTP layer (the original layout, extracted by `mlx-spec heads
    extract`): concurrent requests share one batch in which the head drafts for every row
    (before, such a pair batched plainly), and every reply equals `generate` alone."""
    target, head = tmp_path / "long", tmp_path / "head"
    original_checkpoint(target, VOCAB, tiny_models.tokenizer, agree=0.0)
    for shard in target.glob("*.safetensors"):  # <|im_end|> never wins: rows run to the end
        tensors = mx.load(str(shard))
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"][2] = 0
            mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    assert cli_main(["heads", "extract", str(target), str(head)]) == 0
    pair = load_pair(target=str(target), drafter="mtp", head=str(head))
    args = ["--target", str(target), "--drafter", "mtp", "--head", str(head),
            "--num-draft-tokens", str(K), "--max-batch", "4", "--api-key", KEY_A]  # fmt: skip
    jobs = [("completion", PROMPTS[1]), ("chat", PROMPTS[3]), ("completion", PROMPTS[2])]
    messages = chat("Tell me a story about a fox")
    with serving(args, tmp_path) as (_, url):
        got, r, anchor = next_turn_beside_others(url, messages, jobs)
    long = generate(pair, PROMPTS[0], max_tokens=ANCHOR_TOKENS, temperature=0)
    assert anchor == long.text  # however it ran (a row, a lone stream, moved between)
    for (kind, text), g in zip(jobs, got, strict=True):
        prompt = chat(text) if kind == "chat" else text
        assert g["text"] == generate(pair, prompt, max_tokens=TOKENS, temperature=0).text
        assert g["spec"]["batched"] is True and g["spec"]["drafter"] == "mtp"
    assert sum(g["spec"]["drafted"] for g in got) > 0
    expected = generate(pair, messages, max_tokens=TOKENS, temperature=0).text
    assert r.choices[0].message.content == expected


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_batch_must_be_positive(value, tiny_models):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_spec", "serve", "--target", str(tiny_models.target),
         f"--max-batch={value}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-batch" in lines[0] and value in lines[0]


@pytest.mark.parametrize("flag", ["--keep-alive-timeout", "--header-timeout", "--request-timeout"])
def test_a_timeout_must_be_finite(flag, tiny_models):
    """inf was taken: an idle connection (or a slow request head) kept for ever."""
    r = subprocess.run(
        [sys.executable, "-m", "mlx_spec", "serve", "--target", str(tiny_models.target),
         flag, "inf"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "finite" in lines[0], r.stderr


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused_not_dropped(key, tiny_models):
    """`--api-key "$KEY"` with the variable unset: the empty key was dropped and the server
    started with no key at all, saying nothing (found by an adversarial run)."""
    r = subprocess.run(
        [sys.executable, "-m", "mlx_spec", "serve", "--target", str(tiny_models.target),
         "--api-key", "sk-one", "--api-key", key],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key must not be empty" in lines[0]


def test_sigterm_lets_the_running_rows_finish(server, pair):
    """Last (it stops the server): rows running when SIGTERM comes finish within the grace
    period, as a single stream does; the process then exits cleanly."""
    proc, url = server
    streams = [
        iter(
            client(url).completions.create(
                model="long", prompt=t, max_tokens=LONG, stream=True, temperature=0
            )
        )
        for t in PROMPTS[:2]
    ]
    firsts = [next(s) for s in streams]
    wait_until(lambda: metrics(url)["mlx_spec_running"] == 2, "the rows never ran together")
    proc.send_signal(signal.SIGTERM)
    for text, first, chunks in zip(PROMPTS[:2], firsts, streams, strict=True):
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        out = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert out == generate(pair, text, max_tokens=LONG, temperature=0).text
    assert proc.wait(20) == 0


def mtp_pair_dir(tiny_models, root):
    """A tiny GLM-4.5 target with its own MTP layer (tests/test_batch_mtp.py's), its end rows
    muted so replies run long: (the target named "long", the head)."""
    from test_mtp_nextn import build

    original, _, head, _ = build(root, "glm-4.5", tiny_models.tokenizer, agree=0.3)
    index = json.loads((original / "model.safetensors.index.json").read_text())
    shard = original / index["weight_map"]["lm_head.weight"]
    tensors = dict(mx.load(str(shard)))
    for eos in (2, *load_pair(target=str(original)).tokenizer.eos_token_ids):
        tensors["lm_head.weight"][eos] = 0  # never the argmax of a peaked head
    mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    target = root / "long"  # the name the requests ask for
    target.symlink_to(original)
    return target, head


@pytest.fixture(scope="module", params=["mtp", "dflash", "dspark", "dflash2"])
def own_head_server(request, tiny_models, models, tmp_path_factory):
    """A pair whose head drafts from the target's own states inside the batch
    (decode/batch_head.py): the target's MTP layer, or a random DFlash, DSpark or DFlash2
    head over the long target (DFlash2's read by the dflash kind); k fixed at 3, --max-batch 4."""
    root = tmp_path_factory.mktemp(f"{request.param}_server")
    drafter = "dflash" if request.param == "dflash2" else request.param
    if request.param == "mtp":
        target, head = mtp_pair_dir(tiny_models, root)
    else:  # test_dflash's, test_dspark's or test_dflash2's writer
        module = __import__(f"test_{request.param}")
        target = models[1]
        cfg = json.loads((target / "config.json").read_text())
        head = module.write_head(root / request.param, module.head_config(cfg, [0, 2]))
    args = ["--target", str(target), "--drafter", drafter, "--head", str(head),
            "--num-draft-tokens", str(K), "--max-batch", "4", "--api-key", KEY_A,
            "--admin-key", KEY_A]  # fmt: skip
    pair = load_pair(target=str(target), drafter=drafter, head=str(head), num_draft_tokens=K)
    with serving(args, root) as (_, url):
        yield url, pair, root


def test_an_own_head_pair_drafts_alone_and_in_a_batch(own_head_server):
    """The target's own MTP layer, or a DFlash head: a lone request runs as a single stream
    (as with an EAGLE-3 head); requests that queue while one runs share one batch in which
    the head drafts for every row, greedy and seeded sampled alike: each greedy reply is the
    target's, the seeded one samples what it does alone with the head. The turn after a
    batched one starts from the caches and head state that row handed back."""
    url, head_pair, root = own_head_server
    drafter = head_pair.config.drafter
    assert "batch without drafts" not in (root / "stderr.log").read_text()
    lone = streamed(url, KEY_A, "chat", PROMPTS[3], temperature=0)
    assert lone["text"] == generate(head_pair, chat(PROMPTS[3]), max_tokens=TOKENS).text
    assert lone["spec"]["batched"] is False and lone["spec"]["drafted"] > 0
    anchor = long_anchor(url)  # alone; the next ones join it in a batch, one by one
    seeded = {"temperature": 0.8, "seed": 7}
    jobs = [(text, {"temperature": 0}) for text in PROMPTS[1:3]] + [(PROMPTS[0], seeded)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = []
        for i, (text, kw) in enumerate(jobs):  # one by one: the queue's order is known
            futures.append(pool.submit(streamed, url, KEY_A, "chat", text, **kw))
            wait_taken(url, i + 2, futures)
        anchor.close()
        got = [f.result() for f in futures]
    for (text, kw), reply in zip(jobs, got, strict=True):
        assert reply["text"] == generate(head_pair, chat(text), max_tokens=TOKENS, **kw).text
        assert reply["spec"]["batched"] is True and reply["spec"]["drafted"] > 0
        assert reply["spec"]["drafter"] == drafter  # the head drafted in the batch
    assert metrics(url)["mlx_spec_batch_size_max"] >= 3
    # the first row's prompt again, alone: from the caches and head state it handed back
    again = streamed(url, KEY_A, "chat", PROMPTS[1], temperature=0)
    assert again["text"] == generate(head_pair, chat(PROMPTS[1]), max_tokens=TOKENS).text
    assert again["spec"]["batched"] is False and again["spec"]["drafted"] > 0
    prompt = len(
        head_pair.tokenizer.apply_chat_template(chat(PROMPTS[1]), add_generation_prompt=True)
    )
    assert again["spec"]["prompt_tokens_reused"] == prompt - 1


def test_a_suffix_head_pair_drafts_in_the_batch(models, pair, tmp_path):
    """`--drafter suffix+eagle3` batches (it was served one stream at a time): a request
    asked again while another runs joins the batch and drafts its earlier reply from its
    key's suffix history, the head drafting the other rows; every reply is the target's."""
    _, target, _ = models
    head = tmp_path / "eagle3"
    cfg = json.loads((target / "config.json").read_text())
    write_eagle(head, cfg, head_weights(cfg, subset(VOCAB, 96, 1), seed=5, embed=False))
    args = ["--target", str(target), "--drafter", "suffix+eagle3", "--head", str(head),
            "--max-batch", "4", "--api-key", KEY_A, "--admin-key", KEY_A]  # fmt: skip
    with serving(args, tmp_path) as (_, url):
        log = (tmp_path / "stderr.log").read_text()
        assert "not batched" not in log and "batch without drafts" not in log
        first = streamed(url, KEY_A, "completion", PROMPTS[2], temperature=0)
        anchor = long_anchor(url)  # alone; the next ones join it in a batch
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            again = pool.submit(streamed, url, KEY_A, "completion", PROMPTS[2], temperature=0)
            other = pool.submit(streamed, url, KEY_A, "chat", PROMPTS[0], temperature=0)
            again, other = again.result(), other.result()
        size = metrics(url)["mlx_spec_batch_size_max"]
        anchor.close()
    assert first["text"] == again["text"] == generate(pair, PROMPTS[2], max_tokens=TOKENS).text
    assert other["text"] == generate(pair, chat(PROMPTS[0]), max_tokens=TOKENS).text
    assert size >= 2
    for got in (again, other):
        assert got["spec"]["batched"] is True and got["spec"]["drafter"] == "suffix+eagle3"
    # the repeated request drafted its reply from the history in the batch (unloaded: 2 passes,
    # 19 tokens drafted a round; alone, 13 passes; 2026-12-06). How long its rounds are follows
    # the measured pass costs (under the suite's load: 7.2 a round): past K_MAX by pinned costs
    # in test_suffix.py
    assert again["spec"]["accepted"] >= 0.7 * TOKENS
