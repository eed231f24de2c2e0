"""`mlx-spec serve --prefill-chunk N`: a long prompt is prefilled a chunk at a time between the
batch's rounds, so a cached turn that comes during a cold prefill is answered first (issue 57).

Two servers on the long tiny target of test_server_batch (8k positions): one drafted by a
draft model (a lone request joins the batch at once) and one by an EAGLE-3 head (a lone
request runs as a single stream: its chunks must yield to a newcomer too). Chunks of 16 tokens
make a cold prompt of ~2,000 tokens take over a hundred turns beside a running reply.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import time
import urllib.parse

import pytest
import tiny
from conftest import VOCAB
from mlx_lm.utils import common_prefix_len
from test_eagle import head_weights, subset
from test_eagle import write_head as write_eagle
from test_server import serving
from test_server_batch import KEY_A, KEY_B, client, metrics, models, pair, wait_until  # noqa: F401

from mlx_spec import generate, load_pair
from mlx_spec.server.prefill import Prefill, chunk_end, order, plan, reuse_point, waits_for

CHUNK = 16
TOKENS = 12
WARM = "Paris is the capital of France. Once upon a time"


@pytest.fixture(scope="module", params=["model", "eagle3"])
def server(request, models):  # noqa: F811
    root, target, draft = models
    args = ["--target", str(target), "--num-draft-tokens", "3", "--max-batch", "4",
            "--prefill-chunk", str(CHUNK), "--api-key", KEY_A, "--api-key", KEY_B,
            "--admin-key", KEY_A]  # fmt: skip
    if request.param == "model":
        args += ["--draft", str(draft), "--drafter", "model"]
    else:
        head = root / "prefill-eagle3"
        cfg = json.loads((target / "config.json").read_text())
        write_eagle(head, cfg, head_weights(cfg, subset(VOCAB, 96, 1), seed=5, embed=False))
        args += ["--drafter", "eagle3", "--head", str(head)]
    log = root / f"prefill-{request.param}"
    log.mkdir(exist_ok=True)
    with serving(args, log) as (_, url):
        yield url


def test_a_turn_joins_what_fits_its_chunk_or_gives_one_prompt_a_whole_chunk():
    assert plan([5, 1000, 3], 256) == [(0, True), (2, True)]  # the cold one waits a turn
    assert plan([1000, 5], 256) == [(0, False)]  # its turn: a whole chunk, nothing else
    assert plan([256, 1], 256) == [(0, True)]  # the budget spent
    assert plan([0], 256) == [(0, True)]  # all but its last token cached
    assert chunk_end(0, 1000, 256) == 256 and chunk_end(900, 1000, 256) == 999


def test_prefills_take_turns_by_key_then_by_prompt():
    class Req:
        def __init__(self, partition):
            self.partition = partition

    class J:
        def __init__(self, partition):
            self.request = Req(partition)

    def prefill(key, served, started):
        return Prefill(J(key), None, [1, 2], 8, None, None, False, served=served,
                       started=started)  # fmt: skip

    a_old, a_new, b = prefill("a", 3, 0.0), prefill("a", -1, 2.0), prefill("b", 2, 1.0)
    # key b was served longest ago; within key a, the prompt never served first
    assert order([a_old, a_new, b], {"a": 3, "b": 2}) == [b, a_new, a_old]
    # a key never served goes first; ties by arrival
    c1, c2 = prefill("c", -1, 5.0), prefill("c", -1, 4.0)
    assert order([a_old, c1, c2], {"a": 3}) == [c2, c1, a_old]


def test_a_prompt_waits_for_one_ahead_on_the_part_a_copy_could_give():
    class Job:
        class request:  # noqa: N801
            partition = "a"

    class Held:  # a decoder holding a prefix of its prompt
        def __init__(self, n):
            self.n = n

        def reusable(self, tokens, use_draft=True):
            return self.n

    def prefill(tokens, held, started, marks=()):
        kept = Held(held) if held else None
        return Prefill(Job, None, tokens, 8, None, kept, False, marks, started=started)

    system = list(range(100))
    lead = prefill(system + [7, 8, 9], 48, 0.0, marks=(99,))
    follower = prefill(system + [5, 6], 0, 1.0)
    assert reuse_point(lead, follower.tokens, freely=True) == 100
    assert reuse_point(lead, follower.tokens, freely=False) == 99  # its checkpoint there
    assert waits_for(follower, [lead, follower], 32, True) is lead
    assert waits_for(lead, [lead, follower], 32, True) is None  # (the one ahead never waits)
    lead.kept.n = 100  # past the shared part: the follower copies it now
    assert waits_for(follower, [lead, follower], 32, True) is None
    other = prefill([1000] + system, 0, 2.0)  # shares nothing
    assert waits_for(other, [lead, other], 32, True) is None


def cold_prompt(pair, tag: str, tokens: int = 2000) -> str:  # noqa: F811
    """A prompt of about `tokens` tokens that no kept cache shares (`tag` first)."""
    words = "the quick brown fox jumps over the lazy dog and a tiny model predicts tokens"
    text = tag
    while len(pair.tokenizer.encode(text)) < tokens:
        text += " " + words
    return text


def first_chunk_at(url: str, key: str, prompt: str, out: dict, **kw) -> None:
    """A greedy streamed completion: when its first text came (perf_counter), and its text."""
    stream = client(url, key).completions.create(
        model="long", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True, **kw
    )
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and "first" not in out:
            out["first"] = time.perf_counter()
        text += "".join(c.text for c in chunk.choices)
    out["text"], out["done"] = text, time.perf_counter()


@contextlib.contextmanager
def posted(url: str, body: dict, key: str):
    """A request sent on a raw connection, closed when the block ends (the client leaves
    before any answer: an HTTP client waits for the stream's headers, sent with its first
    text or keep-alive)."""
    parts = urllib.parse.urlsplit(url)
    payload = json.dumps(body).encode()
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n")  # fmt: skip
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(head.encode() + payload)
        yield


def taken(url: str) -> bool:
    return metrics(url)["mlx_spec_running"] >= 1


def test_a_cached_turn_is_answered_before_a_cold_prefill_ends(server, pair):  # noqa: F811
    """A cold prompt of another key is taken first; a turn whose prompt is cached comes while
    it prefills and gets its whole reply before the cold one's first token (before chunking
    it waited for the whole cold prefill, or joined with it, both starting in one round).
    Both replies are the target's greedy ones."""
    client(server, KEY_A).completions.create(model="long", prompt=WARM, max_tokens=4)  # kept
    cold_text = cold_prompt(pair, "Zebras.")
    cold, cached = {}, {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(first_chunk_at, server, KEY_B, cold_text, cold)
        wait_until(lambda: taken(server), "the cold request was never taken")
        b = pool.submit(first_chunk_at, server, KEY_A, WARM, cached)
        a.result(), b.result()
    assert cached["first"] < cached["done"] < cold["first"]
    assert cached["text"] == generate(pair, WARM, max_tokens=TOKENS, temperature=0).text
    assert cold["text"] == generate(pair, cold_text, max_tokens=TOKENS, temperature=0).text


def test_a_client_that_leaves_mid_prefill_frees_the_engine(server, pair):  # noqa: F811
    """A client that disconnects while its cold prompt is prefilled (beside a running reply,
    a round between chunks) frees the engine between two chunks (before, the whole prompt
    was prefilled first); the chunks it had go to its key's prompt cache, so its retry
    prefills only the rest, and answers as alone."""
    anchor = client(server, KEY_B).completions.create(
        model="long", prompt="The", max_tokens=5000, stream=True, temperature=0
    )
    next(iter(anchor))  # decoding now
    before = metrics(server)
    text = cold_prompt(pair, "Otters.", 3000)
    length = len(pair.tokenizer.encode(text))
    body = {"model": "long", "prompt": text, "max_tokens": TOKENS, "temperature": 0,
            "stream": True}  # fmt: skip
    running = "mlx_spec_running"
    with posted(server + "/completions", body, KEY_A):  # (no answer is read: none came yet)
        wait_until(lambda: metrics(server)[running] >= 2, "the request was never taken")
        time.sleep(0.3)  # a few chunks in
    wait_until(lambda: metrics(server)[running] == 1, "the engine was never freed")
    after = metrics(server)
    anchor.close()
    assert after["mlx_spec_cancelled_total"] == before["mlx_spec_cancelled_total"] + 1
    wait_until(lambda: metrics(server)[running] == 0, "the anchor never left")
    retry = client(server, KEY_A).completions.create(
        model="long", prompt=text, max_tokens=TOKENS, temperature=0
    )
    reused = retry.usage.prompt_tokens_details.cached_tokens
    assert 0 < reused < length - 1, (reused, length)  # its chunks, not all of the prompt
    assert retry.choices[0].text == generate(pair, text, max_tokens=TOKENS, temperature=0).text


def test_requests_sent_together_with_one_long_system_prompt_prefill_it_once(server, pair):  # noqa: F811
    """An agent's sub-tasks sent together share a long system prompt (~40 chunks): one of them
    prefills it while the other waits, then starts from a copy of its caches (before, with
    chunks, both prefilled it). Both replies are the target's."""
    system = "(together) You are careful. " + "Cite the file you read. " * 100
    first = [{"role": "system", "content": system}, {"role": "user", "content": "What is new?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "List tests."}]

    def ask(messages):
        return client(server).chat.completions.create(
            model="long", messages=messages, max_tokens=TOKENS, temperature=0
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(ask, first), pool.submit(ask, second)
        a, b = a.result(), b.result()
    template = pair.tokenizer.apply_chat_template
    ids = [template(m, add_generation_prompt=True) for m in (first, second)]
    shared = common_prefix_len(*ids)
    assert shared > 40 * CHUNK
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in (a, b))
    assert cached[0] < CHUNK and cached[1] == shared
    for messages, r in ((first, a), (second, b)):
        expected = generate(pair, messages, max_tokens=TOKENS, temperature=0).text
        assert r.choices[0].message.content == expected


FAMILIES = ["llama_sliding", "qwen3_5", "falcon_h1"]  # a window, a recurrent state, a CacheList


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_prefilled_in_chunks_of_every_cache_kind_are_the_targets(
    tiny_models, tmp_path, family
):
    """Chunks of 8 tokens: a sliding-window target (8-token window), a hybrid recurrent one
    (its lone stream's chunks yield to a newcomer; its system checkpoint kept between chunks)
    and a CacheList one (falcon_h1) each serve a long prompt in chunks beside a running reply
    and a short request; every reply is what `generate` gives alone, and the next turn of the
    long conversation starts from what its row kept."""
    configs = {**tiny.family_configs(VOCAB), **tiny.cachelist_configs(VOCAB)}
    cfg = configs[family]
    weights = tiny.family_weights(cfg, seed=0)
    target = tiny.write_model(tmp_path / "long", cfg, weights, tiny_models.tokenizer)
    alone = load_pair(target=str(target)).configured(drafter="ngram")
    args = ["--target", str(target), "--drafter", "ngram", "--num-draft-tokens", "3",
            "--max-batch", "4", "--prefill-chunk", "8", "--api-key", KEY_A,
            "--admin-key", KEY_A]  # fmt: skip
    system = "You are terse. " + " ".join(tiny.CORPUS)
    long = [{"role": "system", "content": system}, {"role": "user", "content": tiny.CORPUS[3]}]
    with serving(args, tmp_path) as (_, url):
        anchor = client(url).completions.create(
            model="long", prompt="The", max_tokens=120, stream=True, temperature=0
        )
        chunks = iter(anchor)
        got = [next(chunks)]  # decoding now
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(
                client(url).chat.completions.create, model="long", messages=long,
                max_tokens=TOKENS, temperature=0,
            )  # fmt: skip
            b = pool.submit(
                client(url).completions.create, model="long", prompt=tiny.CORPUS[0],
                max_tokens=TOKENS, temperature=0,
            )  # fmt: skip
            first, short = a.result(), b.result()
        got += list(chunks)
        turn = long + [
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "And then?"},
        ]
        second = client(url).chat.completions.create(
            model="long", messages=turn, max_tokens=TOKENS, temperature=0
        )
    assert first.usage.prompt_tokens > 8 * 8  # many chunks
    anchor_text = "".join(ch.choices[0].text for ch in got if ch.choices)
    assert anchor_text == generate(alone, "The", max_tokens=120, temperature=0).text
    expected = generate(alone, long, max_tokens=TOKENS, temperature=0).text
    assert first.choices[0].message.content == expected
    expected = generate(alone, tiny.CORPUS[0], max_tokens=TOKENS, temperature=0).text
    assert short.choices[0].text == expected
    expected = generate(alone, turn, max_tokens=TOKENS, temperature=0).text
    assert second.choices[0].message.content == expected
    assert second.usage.prompt_tokens_details.cached_tokens > 8 * 8  # the system part at least
