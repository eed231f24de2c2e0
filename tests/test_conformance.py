"""The conformance matrix: real model configurations through every surface, from any thread.

Each family of tests/real_configs.py (a published checkpoint's config, shrunk) runs through the
Python API on the loading thread and on another thread, `mlx-spec generate`, the chat app under
`App.run_test()` (temperature 0 and 0.7, with the race), `serve` (a real process: every family
swapped in by request, two requests each), `distill` (two steps), `probe` and `bench`. Greedy
output equals mlx-lm's target alone on every row. A model whose cache cannot roll back is
refused with one line before any token, on every surface (every mlx-lm cache class rolls back
here, deepseek_v41's `LayerCache` by a snapshot: it stands for a new class, made unknown), and a
pair that cannot load (vocabularies that differ) fails `serve` in one line: at start-up, exit 2;
swapped in, HTTP 404.

Why a matrix: since MLX 0.31/0.32 an unevaluated array can only be evaluated on the thread
that built it, and the rope scaling classes real checkpoints use hold such arrays after
`mlx_lm.load` (threads.py). Tiny models with plain RoPE never showed it.
"""

from __future__ import annotations

import json
import os
import threading

import mlx.core as mx
import openai
import pytest
import real_configs
import tiny
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from test_families import reference as family_reference
from test_server import KEY, serving

import tui.app
from mlx_spec import (
    GenerationConfig,
    SpecError,
    Stats,
    generate,
    load_pair,
    make_decoder,
    stream_rounds,
)
from mlx_spec.cli import main
from mlx_spec.core import caches
from tui.app import ChatApp

VOCAB = 320
CONFIGS = real_configs.real_configs(VOCAB)
FAMILIES = list(CONFIGS)
TEXT = "Paris is the capital of France. The quick brown fox jumps over the lazy dog."
REPLY = 24
K = 3  # a fixed draft length: every row drafts, whatever this machine's timings
# the draft is the target plus noise: enough to reject often, not always, on each family
NOISE = {"gemma3": 0.01, "qwen3.5": 0.02, "phi3.5": 0.15}


@pytest.fixture(scope="module")
def models_toml(tiny_models, tmp_path_factory):
    """Each family written as target + noisy draft, and a models.toml naming them."""
    root = tmp_path_factory.mktemp("conformance")
    lines = []
    for name, config in CONFIGS.items():
        weights = real_configs.real_weights(config, seed=0)
        target = tiny.write_model(root / name, config, weights, tiny_models.tokenizer)
        noisy = tiny.noisy(weights, NOISE.get(name, 0.03))
        draft = tiny.write_model(root / f"{name}-draft", config, noisy, tiny_models.tokenizer)
        lines += [f'[pairs."{name}"]', f'target = "{target}"', f'draft = "{draft}"']
        lines += [f"num_draft_tokens = {K}", ""]
    cc = tiny.compressed_config(VOCAB)
    compressed = tiny.write_model(
        root / "compressed", cc, tiny.family_weights(cc, seed=0), tiny_models.tokenizer
    )
    lines += ['[pairs."compressed"]', f'target = "{compressed}"', f'draft = "{compressed}"', ""]
    # a draft whose vocabulary differs from its target's (ids 100 and 101 swapped)
    mismatched = [f'target = "{root / FAMILIES[0]}"', f'draft = "{tiny_models.swapped}"']
    lines += ['[pairs."mismatched"]', *mismatched, ""]
    path = root / "models.toml"
    path.write_text("\n".join(lines))
    return path


@pytest.fixture
def registry(models_toml, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_MODELS", str(models_toml))
    return models_toml


@pytest.fixture(scope="module")
def pairs(models_toml):
    os.environ["MLX_SPEC_MODELS"] = str(models_toml)
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_pair(name)
        return loaded[name]

    yield get
    os.environ.pop("MLX_SPEC_MODELS", None)


def prompt_ids(pair) -> list[int]:
    return pair.tokenizer.encode(TEXT, add_special_tokens=False)


def reference(pair, prompt, max_tokens: int = REPLY) -> list[int]:
    """Greedy tokens of mlx-lm on the target alone (its own caches)."""
    return family_reference(pair, prompt, max_tokens)


def reference_text(pair, prompt, max_tokens: int = REPLY) -> str:
    """The same reply, as mlx-lm's streaming detokenizer writes it."""
    out = stream_generate(pair.target, pair.tokenizer, prompt, max_tokens, sampler=make_sampler(0))
    return "".join(r.text for r in out)


def on_thread(fn):
    """Run fn() on a new thread; its result, or its exception raised here."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as err:  # handed back to the test
            box["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.mark.parametrize("family", FAMILIES)
def test_api_on_the_loading_thread_and_another(registry, family):
    pair = load_pair(family)  # fresh: nothing has run it yet (a run evaluates what it used)
    prompt = prompt_ids(pair)
    there = on_thread(lambda: generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=K))
    here = generate(pair, prompt, max_tokens=REPLY, num_draft_tokens=K)
    ref = reference(pair, prompt)
    assert len(set(ref)) >= 3  # the model says something, not one token forever
    assert there.tokens == here.tokens == ref
    assert here.stats.drafted > 0 and 0 < here.stats.acceptance_rate < 1
    # a kept decoder: a sampled reply on one thread, the next turn on another (its key, caches
    # and drafter state cross threads between replies)
    decoder = on_thread(lambda: make_decoder(pair, seed=1))
    on_thread(lambda: generate(pair, prompt, max_tokens=8, temperature=0.7, decoder=decoder))
    # nothing lazy is left: every array the decoder keeps evaluates on yet another thread
    # (an array still lazy there raises "There is no Stream(cpu, 0) in current thread")
    on_thread(lambda: mx.eval(kept_arrays(decoder)))
    key = decoder.key
    follow = on_thread(lambda: generate(pair, prompt, max_tokens=REPLY, decoder=decoder))
    assert follow.tokens == ref
    assert decoder.key is key  # greedy rounds draw nothing: the key is not split
    on_thread(lambda: mx.eval(kept_arrays(decoder)))


class StopAfter(Stats):
    """Stats that raise inside the stream after a few rounds, as Ctrl-C or an error would."""

    def __init__(self, rounds: int):
        super().__init__()
        self.left = rounds

    def add_round(self, *args):
        self.left -= 1
        if self.left < 0:
            raise KeyboardInterrupt
        super().add_round(*args)


@pytest.mark.parametrize("family", ["llama3.1", "qwen3.5"])
def test_a_stream_stopped_by_an_error_leaves_nothing_lazy(pairs, family):
    pair = pairs(family)
    prompt = prompt_ids(pair)
    decoder = make_decoder(pair, seed=3)
    stream = stream_rounds(
        pair, prompt, GenerationConfig(temperature=0.7), decoder=decoder, stats=StopAfter(2)
    )
    with pytest.raises(KeyboardInterrupt):
        on_thread(lambda: list(stream))
    on_thread(lambda: mx.eval(kept_arrays(decoder)))
    after = on_thread(lambda: generate(pair, prompt, max_tokens=REPLY, decoder=decoder))
    assert after.tokens == reference(pair, prompt)


def test_the_server_engine_loads_on_its_own_thread():
    from mlx_spec.server.worker import Engine

    threads = []

    def loader(name):
        threads.append(threading.current_thread())
        if name == "broken":
            raise SpecError("no such model")
        return None

    engine = Engine(None, "broken", loader, ["broken"])
    with pytest.raises(SpecError, match="no such model"):
        engine.start()
    assert threads == [engine.thread] and not engine.thread.is_alive()


def test_serve_start_up_failure_exits_2_with_one_line(models_toml):
    """The engine thread loads (and refuses) the pair; the process still exits 2, never an
    abort at interpreter exit (status 134, "terminate called without an active exception")."""
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_SPEC_MODELS": str(models_toml)}
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_spec", "serve", "--pair", "mismatched", "--port", "0"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        lines = [x for x in proc.stderr.splitlines() if not x.startswith("[transformers]")]
        assert len(lines) == 1 and "vocabularies differ" in lines[0], proc.stderr
        assert proc.stdout == ""


def kept_arrays(decoder) -> list:
    """The key and every cache array of the target and of a draft model."""
    from mlx.utils import tree_flatten

    layers = list(decoder.cache)
    model = getattr(decoder.drafter, "model", None)
    if model is not None and hasattr(decoder.drafter, "cache"):
        layers += list(decoder.drafter.cache)
    arrays = [a for c in layers for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return [decoder.key, *arrays]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_command(pairs, registry, family, capsys):
    pair = pairs(family)
    ref = reference(pair, prompt_ids(pair))
    argv = ["generate", "--pair", family, "--raw", "--max-tokens", str(REPLY), "--json", TEXT]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == ref
    assert out["stats"]["drafted"] > 0


def chat_reference(pair, text: str) -> str:
    ids = pair.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return reference_text(pair, ids)


async def finish(app, pilot):
    await app.workers.wait_for_complete()
    await pilot.pause(0.1)


async def ask(app, pilot, text: str) -> None:
    await pilot.click("#prompt")
    await pilot.press(*text)
    await pilot.press("enter")
    await finish(app, pilot)
    if app.compare:  # the race starts when the reply is done
        await finish(app, pilot)


@pytest.mark.parametrize("family", FAMILIES)
async def test_chat_app_at_two_temperatures_with_the_race(pairs, family):
    from tui.widgets import ReplyView

    pair = load_pair(family)  # loaded on this thread, never run; the app runs it on its own
    expected = chat_reference(pairs(family), "Tell me a story")
    app = ChatApp(
        pair, pair_name=family, compare=True, generation=GenerationConfig(max_tokens=REPLY, seed=0)
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await ask(app, pilot, "Tell me a story")
        replies = list(app.query(ReplyView))
        assert len(replies) == 2  # the reply and its race against plain decoding
        assert [r.text for r in replies] == [expected, expected]
        assert "race: speculation" in str(app.status_line.render())
        app.temperature = 0.7
        await ask(app, pilot, "And then?")
        replies = list(app.query(ReplyView))
        assert len(replies) == 4
        assert all("[error" not in r.text and r.text for r in replies)
        assert app.history[-1]["role"] == "assistant"


async def test_chat_app_loads_on_its_model_thread(registry, monkeypatch):
    """The app's own loader (`--pair`): loading and every reply on one thread."""
    from tui.widgets import ReplyView

    seen = set()

    def loader(name, progress):
        seen.add(threading.current_thread().name)
        return load_pair(name, progress=progress)

    def stream_rounds(*args, **kwargs):  # the engine's, noting the thread each reply runs on
        seen.add(threading.current_thread().name)
        yield from tui.app.stream_rounds.__wrapped__(*args, **kwargs)

    stream_rounds.__wrapped__ = tui.app.stream_rounds
    monkeypatch.setattr(tui.app, "stream_rounds", stream_rounds)
    app = ChatApp(
        loader=loader,
        pair_name="llama3.1",
        compare=True,
        generation=GenerationConfig(max_tokens=REPLY),
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await finish(app, pilot)
        assert app.pair is not None
        await ask(app, pilot, "Tell me a story")  # the reply, then its race
        replies = list(app.query(ReplyView))
        expected = chat_reference(app.pair, "Tell me a story")
        assert [r.text for r in replies] == [expected, expected]
        assert seen == {app.models.thread.name}  # the load and both replies


def test_serve_swaps_through_every_family(pairs, models_toml, tmp_path):
    """One server process; its start-up pair asked first, then each family swapped in by a
    request and asked again (its kept caches). Greedy text equals mlx-lm's target alone;
    a pair that cannot load gets one 404 line."""
    first = FAMILIES[0]
    args = ["--pair", first, "--api-key", KEY, "--allow-swap"]
    with serving(args, tmp_path, env={"MLX_SPEC_MODELS": str(models_toml)}) as (_, url):
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        served = {m.id for m in client.models.list().data}
        assert set(FAMILIES) <= served
        for family in FAMILIES:  # the start-up pair first: loaded at start, not by a swap
            pair = pairs(family)
            expected = reference_text(pair, prompt_ids(pair))
            for _ in range(2):
                reply = client.completions.create(
                    model=family, prompt=TEXT, max_tokens=REPLY, temperature=0
                )
                assert reply.choices[0].text == expected, family
        with pytest.raises(openai.NotFoundError) as refused:
            client.completions.create(model="mismatched", prompt=TEXT, max_tokens=4)
        message = refused.value.body["message"]
        assert "vocabularies differ" in message and "\n" not in message
        # the refused swap left no pair resident; the next request loads its own
        reply = client.completions.create(model=first, prompt=TEXT, max_tokens=4, temperature=0)
        assert reply.choices[0].text
    errors = (tmp_path / "stderr.log").read_text()
    assert "Traceback" not in errors and "internal error" not in errors


@pytest.mark.parametrize("family", FAMILIES)
def test_distill_two_steps(pairs, registry, family, tmp_path, capsys):
    out = tmp_path / "adapter"
    argv = ["--debug", "distill", "--pair", family, "--out", str(out), "--steps", "2"]
    argv += ["--max-prompts", "4", "--reply-tokens", "8", "--eval-prompts", "1", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["history"][-1]["step"] == 2
    # the trained adapter on the draft: still exactly the target's greedy output
    pair = pairs(family)
    adapted = load_pair(family, draft_adapter=out)
    res = generate(adapted, prompt_ids(pair), max_tokens=REPLY, num_draft_tokens=K)
    assert res.tokens == reference(pair, prompt_ids(pair))


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_and_bench(registry, family, capsys):
    probe = ["probe", "--pair", family, "--context", "32", "--sample-tokens", "8", "--json"]
    assert main(probe) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert result["verify_cost_curve"]["1"] == 1.0 and 0 <= result["alpha"] <= 1
    bench = ["bench", "--pair", family, "--k", str(K), "--temps", "0", "--runs", "1"]
    bench += ["--max-tokens", "8", "--only", "chat", "--json"]
    assert main(bench) == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out)["rows"]
    configs = {r["config"] for r in rows}
    assert {"mlx-lm", "mlx-spec"} <= configs
    # mlx-lm's own speculative path refuses a recurrent state (it raised before)
    assert ("mlx-lm speculative" in configs) == (family != "qwen3.5")


def test_an_unrollable_cache_is_refused_in_one_line_everywhere(
    registry, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(caches, "compressed", lambda c: False)  # LayerCache: a class unknown
    with pytest.raises(SpecError, match="LayerCache.*cannot be rolled back"):
        load_pair("compressed")
    for argv in (
        ["generate", "--pair", "compressed", "--raw", "Hello"],
        ["probe", "--pair", "compressed"],
        ["bench", "--pair", "compressed", "--runs", "1"],
        ["distill", "--pair", "compressed", "--steps", "1", "--out", str(tmp_path / "a")],
    ):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        # after any progress lines ("Finding …"), the error: one line, and the last
        *progress, error = captured.err.splitlines()
        assert captured.out == "" and "error" not in "".join(progress), (argv, captured.err)
        assert error.startswith(f"mlx-spec {argv[0]}: error: ") and "LayerCache" in error
