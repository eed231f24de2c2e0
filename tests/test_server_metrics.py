"""Issue 45, /metrics behind the same keys: with several API keys each key sees the figures
of its own requests, and only an admin key (--admin-key) the whole server's. Real server
process on 127.0.0.1.

Finding: /metrics told key B what key A did: A's exact prompt length, reply length, history
tokens, cache entries and bytes."""

from __future__ import annotations

import openai
import pytest
from test_server import metrics, request, serving

KEY_A, KEY_B, ADMIN = "key-alice", "key-bob", "key-admin"
GLOBAL_ONLY = [
    "mlx_spec_busy",
    "mlx_spec_running",
    "mlx_spec_history_tokens",
    "mlx_spec_prompt_cache_entries",
    "mlx_spec_prompt_cache_bytes",
    "mlx_spec_batch_size",
    "mlx_spec_generation_seconds_total",
    "mlx_spec_prefill_seconds_total",
]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    args = [
        "--target", str(tiny_models.target), "--drafter", "ngram", "--num-draft-tokens", "3",
        "--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN, "--max-tokens-limit", "32",
    ]  # fmt: skip
    with serving(args, root) as (_, url):
        yield url


def test_a_key_sees_its_own_figures_and_nothing_of_another(server):
    url = server
    alice = openai.OpenAI(base_url=url, api_key=KEY_A, max_retries=0, timeout=60)
    reply = alice.chat.completions.create(
        model="target",
        messages=[{"role": "user", "content": "My secret plan has exactly this many words"}],
        max_tokens=17,
        temperature=0,
    )
    used = reply.usage
    bob = metrics(url, KEY_B)
    assert bob["mlx_spec_prompt_tokens_total"] == 0
    assert bob["mlx_spec_generated_tokens_total"] == 0
    assert bob["mlx_spec_queue_waiting"] == 0
    assert not [n for n in bob if n.startswith("mlx_spec_requests_total")]
    assert not [n for n in GLOBAL_ONLY if n in bob], sorted(bob)
    raw = request("GET", url.removesuffix("/v1") + "/metrics", key=KEY_B).text
    assert f" {used.prompt_tokens}\n" not in raw and f" {used.completion_tokens}\n" not in raw

    mine = metrics(url, KEY_A)
    assert mine["mlx_spec_prompt_tokens_total"] == used.prompt_tokens
    assert mine["mlx_spec_generated_tokens_total"] == used.completion_tokens
    assert mine['mlx_spec_requests_total{endpoint="chat",status="200"}'] == 1
    assert not [n for n in GLOBAL_ONLY if n in mine]

    everything = metrics(url, ADMIN)
    assert everything["mlx_spec_prompt_tokens_total"] >= used.prompt_tokens
    assert everything["mlx_spec_history_tokens"] > 0
    assert all(n in everything for n in GLOBAL_ONLY)


def test_errors_count_for_their_own_key(server):
    url = server
    r = request("POST", url + "/chat/completions", {"model": "target", "messages": []}, KEY_B)
    assert r.status_code == 400
    assert metrics(url, KEY_B)['mlx_spec_requests_total{endpoint="chat",status="400"}'] == 1
    assert 'status="400"' not in request("GET", url.removesuffix("/v1") + "/metrics", KEY_A).text


def test_metrics_needs_a_key(server):
    url = server.removesuffix("/v1")
    assert request("GET", url + "/metrics", key=None).status_code == 401
    assert request("GET", url + "/metrics", key="wrong").status_code == 401
    # the admin key reads /metrics only: it is no API key for generation
    r = request("POST", server + "/completions", {"model": "target", "prompt": "Hi"}, ADMIN)
    assert r.status_code == 401
