"""Issue 45, connections bounded: what a client can hold open, against a real server process on
127.0.0.1 (raw sockets: no client library sends half a request head). Each loop here is
bounded and stops itself.

Findings: 2,300 connections that never finish their headers reached the 2,048-descriptor
limit, /health and chat timed out, the log got 308,090 "Too many open files" lines in 75 s;
silent connections were never closed; a client that stopped reading a stream kept its
generation running and the requests behind it waiting."""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import socket
import time

import pytest
import tiny
from conftest import VOCAB
from test_server import KEY, request, serving

PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def address(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").split("/", 1)[0].rpartition(":")
    return host, int(port)


def timed_health(url: str, timeout: float = 5) -> tuple[int, float]:
    begin = time.monotonic()
    try:
        status = request("GET", url.removesuffix("/v1") + "/health", key=None, timeout=timeout)
        status = status.status_code
    except OSError:
        status = 0
    return status, time.monotonic() - begin


def open_sockets(url: str, n: int, payload: bytes | None) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(address(url), timeout=5)
        if payload:
            s.sendall(payload)
        out.append(s)
    return out


def closed_by_server(s: socket.socket) -> bool:
    """The server closed (or reset) this socket: a read returns EOF or fails at once."""
    s.setblocking(False)
    try:
        data = s.recv(4096)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return data == b"" or data.startswith(b"HTTP/1.1 408")


def close_all(socks) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


@pytest.fixture(scope="module")
def loris(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("loris")
    args = [
        "--target", str(tiny_models.target), "--no-draft", "--api-key", KEY,
        "--max-tokens-limit", "16", "--header-timeout", "3",
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url


def test_slowloris_heads_are_closed_and_health_answers_meanwhile(loris, record_property):
    """300 sockets with half a request head, 50 silent ones and 5 that trickle a byte a
    second: /health answers within a second throughout, and after the 3 s head timeout the
    server has closed every one of them (the trickling ones too: the bound is on the whole
    head, not between bytes). On the base commit none was ever closed."""
    proc, url = loris
    begin = time.monotonic()
    partial = open_sockets(url, 300, PARTIAL_HEAD)
    silent = open_sockets(url, 50, None)
    trickle = open_sockets(url, 5, PARTIAL_HEAD)
    held = partial + silent + trickle
    latencies = []
    try:
        while time.monotonic() - begin < 2.5:  # all still within their head timeout
            for s in trickle:
                s.sendall(b"a")
            status, seconds = timed_health(url)
            assert status == 200
            latencies.append(seconds)
            time.sleep(0.25)
        deadline = begin + 3 + 6  # the timeout, plus slack for a loaded machine
        while time.monotonic() < deadline:
            for s in trickle:
                with contextlib.suppress(OSError):
                    s.sendall(b"a")
            if all(closed_by_server(s) for s in held):
                break
            time.sleep(0.5)
        still_open = sum(not closed_by_server(s) for s in held)
    finally:
        close_all(held)
    record_property("connections_held", len(held))
    record_property("health_latency_max_s", round(max(latencies), 3))
    print(f"held {len(held)} connections; /health max {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 1.0, latencies
    assert still_open == 0, f"{still_open} of {len(held)} connections are still open"
    assert proc.poll() is None
    r = request("POST", url + "/chat/completions", chat_body(), timeout=30)
    assert r.status_code == 200, r.text


def chat_body(**extra) -> dict:
    return {
        "model": "target",
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


def test_a_request_body_that_stalls_gets_408(loris):
    """A head that announces a body, then silence: 408 after the timeout, not held for ever."""
    proc, url = loris
    s = socket.create_connection(address(url), timeout=15)
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model"'
        )
        reply = s.recv(4096)
    finally:
        s.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply  # within the socket's 15 s


# ------------------------------------------------------------------------ the connection cap


@pytest.fixture(scope="module")
def capped(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("capped")
    args = [
        "--target", str(tiny_models.target), "--no-draft", "--api-key", KEY,
        "--max-tokens-limit", "16", "--max-connections", "40", "--header-timeout", "20",
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url


def busy_request(url: str) -> socket.socket:
    """A connection in the middle of a request: its head sent, its body not yet (not a
    connection the cap may close for another)."""
    s = socket.create_connection(address(url), timeout=5)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    return s


def test_past_the_cap_a_clean_503_and_health_again_after(capped):
    """40 connections busy with requests fill the cap: the next connection gets an HTTP 503
    in OpenAI's error format (not a reset, not a hang); once they close, /health is 200."""
    proc, url = capped
    busy = [busy_request(url) for _ in range(40)]
    try:
        time.sleep(0.5)
        r = request("GET", url.removesuffix("/v1") + "/health", key=None, timeout=5)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "too_many_connections"
    finally:
        close_all(busy)
    deadline = time.monotonic() + 10
    while timed_health(url, 1)[0] != 200:
        assert time.monotonic() < deadline, "/health never answered again"
        time.sleep(0.1)
    assert proc.poll() is None


def test_past_the_cap_silent_connections_make_room(capped):
    """100 half heads on a server capped at 40: the longest-waiting one is closed for each
    newcomer, so /health and a chat request are still served at once."""
    proc, url = capped
    held = open_sockets(url, 100, PARTIAL_HEAD)
    try:
        status, seconds = timed_health(url)  # within its 5 s timeout
        assert status == 200, (status, seconds)
        r = request("POST", url + "/chat/completions", chat_body(), timeout=30)
        assert r.status_code == 200, r.text
        assert sum(closed_by_server(s) for s in held) >= 60
    finally:
        close_all(held)


# ------------------------------------------------------- the open-file limit and the log


@contextlib.contextmanager
def descriptors(n: int):
    """This process may open `n` files for the block (mlx-lm sets the limits to 2048 / 4096
    when imported, in the server as here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(n, hard)), hard))
    try:
        yield min(n, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_more_silent_connections_than_descriptors(tiny_models, tmp_path, record_property):
    """The finding itself: 2,300 connections that never finish their heads against a server
    whose open-file limit is 2,048 (mlx-lm's). /health answers throughout and the log stays
    short; on the base commit accept() failed with EMFILE, /health timed out and the log
    filled with "Too many open files"."""
    count = 2300
    args = ["--target", str(tiny_models.target), "--no-draft"]
    held, latencies = [], []
    with descriptors(count + 200) as allowed, serving(args, tmp_path) as (proc, url):
        assert allowed > count + 50, f"this machine allows {allowed} files per process"
        begin = time.monotonic()
        for i in range(count):
            try:
                held += open_sockets(url, 1, PARTIAL_HEAD)
            except OSError:
                pass  # refused or reset: the server is full
            if i % 250 == 249:
                status, seconds = timed_health(url, 5)
                latencies.append((status, round(seconds, 3)))
        opened = time.monotonic() - begin
        for _ in range(4):
            status, seconds = timed_health(url, 5)
            latencies.append((status, round(seconds, 3)))
            time.sleep(0.25)
        closed = sum(closed_by_server(s) for s in held)
        close_all(held)
    lines = (tmp_path / "stderr.log").read_text().splitlines()
    record_property("health_latencies", latencies)
    print(
        f"{count} connections ({len(held)} accepted, {closed} closed by the server) opened in"
        f" {opened:.1f} s: /health {latencies}; {len(lines)} log lines"
    )
    # answered within timed_health's 5 s every time (on the base commit it timed out); how
    # fast is not asserted: the machine running the suite may be loaded
    assert all(status == 200 for status, _ in latencies), latencies
    assert not [line for line in lines if "Too many open files" in line]
    assert len(lines) < 100, lines[:20]


def test_the_default_cap_leaves_room_below_the_open_file_limit():
    from mlx_spec.server.connections import default_max_connections

    assert default_max_connections(2048) == 1536
    assert default_max_connections(256) == 192
    assert default_max_connections(100) == 36
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_connections() < soft


def test_the_log_rate_limit_counts_what_it_drops():
    from mlx_spec.server.connections import RateLimit

    now = [0.0]
    limit = RateLimit(burst=3, interval=10, clock=lambda: now[0])

    def record(msg, name="asyncio"):
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None)

    passed = [limit.filter(record(f"socket.accept() out of system resource\nsocket {i}"))
              for i in range(1000)]  # fmt: skip
    assert sum(passed) == 3
    assert limit.filter(record("another message"))
    again = record("same %s", "x")
    assert limit.filter(again) and limit.filter(again)  # decided once per record
    now[0] = 11.0
    first = record("socket.accept() out of system resource\nsocket")
    assert limit.filter(first)
    assert "997 more like this were dropped" in first.getMessage()


# ------------------------------------------------------------------- a client that stops reading


@pytest.fixture(scope="module")
def endless(tiny_models, tmp_path_factory):
    """A model whose replies never end (<|im_end|> is never chosen), plain decoding, one
    request at a time (a stuck one would hold the next), a 2 s send timeout."""
    root = tmp_path_factory.mktemp("endless")
    cfg = {**tiny.llama_config(VOCAB, layers=2), "max_position_embeddings": 16384}
    weights = tiny.random_weights(cfg, seed=0)
    weights["lm_head.weight"][2] = 0
    path = tiny.write_model(root / "endless", cfg, weights, tiny_models.tokenizer)
    args = [
        "--target", str(path), "--no-draft", "--max-batch", "1", "--send-timeout", "2",
        "--request-timeout", "300",
    ]  # fmt: skip
    with serving(args, root) as (proc, url):
        yield proc, url


def metric(url: str, name: str) -> float:
    r = request("GET", url.removesuffix("/v1") + "/metrics", key=None)
    for line in r.text.splitlines():
        if line.startswith(f"mlx_spec_{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_stream_whose_client_stops_reading_is_cancelled(endless, record_property):
    """A stream client with a 4 KB receive buffer reads the first chunk, then nothing (its
    socket open). Once the server's writes have waited 2 s (--send-timeout) its job is
    cancelled, and the next request is served. On the base commit the reply ran on to
    max_tokens with nobody reading it while the next request waited."""
    proc, url = endless
    body = json.dumps(
        {"model": "endless", "messages": [{"role": "user", "content": "Go"}],
         "max_tokens": 12000, "temperature": 0, "stream": True, "logprobs": True,
         "top_logprobs": 20}
    ).encode()  # fmt: skip
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect(address(url))
    cancelled_before = metric(url, "cancelled_total")
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        got = b""
        while b"data: " not in got:
            got += s.recv(1024)
        begin = time.monotonic()
        while metric(url, "cancelled_total") == cancelled_before:  # reading nothing now
            assert time.monotonic() - begin < 60, "the stream was never cancelled"
            time.sleep(0.2)
        cancelled_after = time.monotonic() - begin
        asked = time.monotonic()
        r = request(
            "POST",
            url + "/chat/completions",
            {"model": "endless", "messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 5, "temperature": 0},
            key=None,
            timeout=30,
        )  # fmt: skip
        served_after = time.monotonic() - asked
    finally:
        s.close()
    record_property("cancelled_after_s", round(cancelled_after, 2))
    print(f"slow reader cancelled {cancelled_after:.1f} s after its first chunk;"
          f" the next request answered in {served_after:.2f} s")  # fmt: skip
    assert r.status_code == 200, r.text
    assert cancelled_after < 2 + 20  # the send timeout, plus the time to fill the buffers
    assert served_after < 10
    assert proc.poll() is None
