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
from conftest import VOCAB
from test_eagle import head_weights, subset
from test_eagle import write_head as write_eagle
from test_server import serving
from test_server_batch import KEY_A, KEY_B, client, metrics, models, pair, wait_until  # noqa: F401

from mlx_spec import generate

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
