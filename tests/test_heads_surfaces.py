"""Drafting heads (MTP, EAGLE-3, DFlash, DSpark, Gemma 4's assistant) through every surface a
draft model goes through: `mlx-spec serve`, the chat app, bench, probe, the `auto`
controller, a models.toml pair and the memory check. One tiny Qwen3.5 target (the original
layout, its MTP head extracted) and one tiny head of each kind over it, built once for the
module; the assistant over a tiny Gemma 4 target (what it drafts for)."""

from __future__ import annotations

import json

import openai
import pytest
import tiny
from test_dflash import head_config
from test_dflash import write_head as write_dflash
from test_dflash2 import head_config as dflash2_config
from test_dflash2 import write_head as write_dflash2
from test_dspark import head_config as dspark_config
from test_dspark import write_head as write_dspark
from test_eagle import head_weights, subset
from test_eagle import write_head as write_eagle
from test_gemma4_assistant import head_config as assistant_config
from test_gemma4_assistant import target_embedding, text_of
from test_gemma4_assistant import write_head as write_assistant
from test_mtp import original_checkpoint
from test_server import serving
from test_tui import finish, send

from mlx_spec import GenerationConfig, generate, load_pair, make_decoder
from mlx_spec.cli import main
from mlx_spec.core.policies import Controller
from tui.app import ChatApp
from tui.widgets import StatsPanel

KINDS = ["mtp", "eagle3", "dflash", "dspark", "assistant"]
CHAT = [{"role": "user", "content": "Tell me a story"}]
TOKENS = 20


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    return write_heads(tmp_path_factory.mktemp("heads"), tiny_models.tokenizer)


def write_heads(root, tokenizer, kinds=KINDS) -> dict:
    """{"target": the Qwen3.5 checkpoint, KIND: its head directory}; MTP's head agrees with
    the target often (mixed rounds), the others are random (mostly rejected). `kinds` may
    add "dflash2" (a DFlash2 head, which the dflash kind reads)."""
    original_checkpoint(root / "q35", 320, tokenizer, agree=0.0)
    assert main(["heads", "extract", str(root / "q35"), str(root / "mtp")]) == 0
    cfg = tiny.family_configs(320)["qwen3_5"]
    eagle_cfg = {**cfg, "intermediate_size": 128, "rope_theta": 1e4}
    weights = head_weights(eagle_cfg, subset(320, 64, 3), seed=4, embed=True)
    write_eagle(root / "eagle3", eagle_cfg, weights, ids=[0, 1, 3])
    write_dflash(root / "dflash", head_config(cfg, [1, 2], block_size=6))
    write_dspark(root / "dspark", dspark_config(cfg, [1, 2], block_size=5))
    if "dflash2" in kinds:
        write_dflash2(root / "dflash2", dflash2_config(cfg, [1, 2], block_size=6))
    gemma4 = tiny.write_gemma4(root / "gemma4", tokenizer)
    write_assistant(root / "assistant", assistant_config(text_of(gemma4)), target_embedding(gemma4))
    return {"target": root / "q35", "gemma4": gemma4, **{kind: root / kind for kind in kinds}}


def target_of(models, kind: str):
    """The target a kind's head drafts for: Gemma 4's for the assistant, Qwen3.5's else."""
    return models["gemma4"] if kind == "assistant" else models["target"]


@pytest.fixture(scope="module")
def plains(models):
    """Each target alone, loaded once, and its greedy reply to the chat prompt."""
    loaded = {}

    def get(kind: str):
        target = target_of(models, kind)
        if target not in loaded:
            pair = load_pair(target=str(target))
            loaded[target] = (pair, generate(pair, CHAT, max_tokens=TOKENS, temperature=0.0))
        return loaded[target]

    return get


@pytest.fixture
def plain(plains, kind):
    return plains(kind)[0]


@pytest.fixture
def expected(plains, kind):
    """The target alone, greedy, on the chat prompt."""
    return plains(kind)[1]


def head_pair(models, kind, k=3):
    """`kind`'s pair ("dflash2": the dflash kind over the DFlash2 head)."""
    target, head = str(target_of(models, kind)), str(models[kind])
    drafter = "dflash" if kind == "dflash2" else kind
    return load_pair(target=target, drafter=drafter, head=head, num_draft_tokens=k)


def head_args(models, kind) -> list[str]:
    target = str(target_of(models, kind))
    return ["--target", target, "--drafter", kind, "--head", str(models[kind])]


@pytest.mark.parametrize("kind", KINDS)
def test_serve_with_a_head(models, expected, kind, tmp_path):
    args = [*head_args(models, kind), "--num-draft-tokens", "3"]
    with serving(args, tmp_path) as (_, url):
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
        resp = client.chat.completions.create(
            model=target_of(models, kind).name, messages=CHAT, max_tokens=TOKENS, temperature=0
        )
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.completion_tokens == len(expected.tokens)
    spec = resp.model_extra["speculation"]
    assert spec["drafter"] == kind and spec["num_draft_tokens"] == 3
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]


@pytest.mark.parametrize("kind", KINDS)
async def test_chat_app_with_a_head(models, expected, kind):
    pair = head_pair(models, kind)
    res = generate(pair, CHAT, max_tokens=TOKENS, decoder=make_decoder(pair))
    assert res.tokens == expected.tokens
    app = ChatApp(pair, pair_name=kind, generation=GenerationConfig(max_tokens=TOKENS))
    async with app.run_test(size=(120, 40)) as pilot:
        await send(pilot, CHAT[0]["content"])
        reply = await finish(app, pilot)
        assert reply.text == expected.text
        kinds = [k for _, k in reply.pieces if k != "rejected"]
        assert kinds == res.kinds
        from_rounds = []
        for r in res.rounds:
            n = min(r.accepted, r.emitted)
            from_rounds += ["accepted"] * n
            if r.emitted > n:
                from_rounds.append("regenerated" if r.kind == "correction" else "target")
        assert kinds == from_rounds
        stats = res.stats
        assert kinds.count("accepted") == sum(res.accepted) <= stats.accepted
        assert kinds.count("regenerated") + kinds.count("target") <= stats.target_passes
        assert "regenerated" in kinds  # every head here is wrong some of the time
        if kind == "mtp":
            assert "accepted" in kinds  # the agreeing head: mixed rounds
        panel = app.query_one(StatsPanel).render_text()
        assert f"acceptance   {stats.acceptance_rate:.0%}" in panel
        assert f"tokens       {stats.generated_tokens} in {stats.target_passes} passes" in panel
        assert app.stats_panel.strip == [(len(r.drafted), r.accepted) for r in res.rounds]


@pytest.mark.parametrize("kind", KINDS)
def test_bench_and_probe_with_a_head(models, kind, capsys):
    pair = head_args(models, kind)
    probe = ["probe", *pair, "--context", "32", "--sample-tokens", "12", "--budget", "1"]
    assert main([*probe, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # the head's draft step is measured (through its drafter's propose), not taken as free
    assert 0 < out["draft_cost_ratio"] < 100 and 0 <= out["alpha"] <= 1
    assert len(out["predictions"]) == 10 and out["verdict"].startswith("speculation")
    bench = ["bench", *pair, "--only", "chat", "--k", "2", "--temps", "0", "--runs", "1"]
    assert main([*bench, "--max-tokens", "8", "--json"]) == 0
    rows = {(r["config"], r["k"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    spec = rows["mlx-spec", 2]
    assert spec["same_output"] is True and spec["draft_steps_per_token"] > 0
    assert 0 <= spec["acceptance_rate"] <= 1 and ("mlx-lm", 0) in rows


@pytest.mark.parametrize("kind", KINDS)
def test_auto_controller_with_a_head(models, expected, kind):
    pair = head_pair(models, kind, "auto")
    res = generate(pair, CHAT, max_tokens=TOKENS)
    assert res.tokens == expected.tokens
    stats = res.stats
    assert stats.adaptive and isinstance(stats.policy, Controller)
    view = stats.controller
    assert view["state"] and view["draft_cost"] is not None and view["draft_cost"] > 0
    assert json.loads(json.dumps(stats.to_json()))["controller"]["state"] == view["state"]


@pytest.fixture
def toml_pairs(models, tmp_path, monkeypatch):
    """A user models.toml with one pair per kind, the head path relative to the file."""
    path = tmp_path / "models.toml"
    for kind in KINDS:
        (tmp_path / kind).symlink_to(models[kind])
    path.write_text(
        "".join(
            f'[pairs."tiny-{kind}"]\ntarget = "{target_of(models, kind)}"\n'
            f'draft = {{ head = "{kind}", path = "{kind}" }}\nnum_draft_tokens = 3\n\n'
            for kind in KINDS
        )
    )
    monkeypatch.setenv("MLX_SPEC_MODELS", str(path))
    return tmp_path


@pytest.mark.parametrize("kind", KINDS)
def test_a_models_toml_head_pair(toml_pairs, expected, kind, capsys):
    name = f"tiny-{kind}"
    pair = load_pair(name)
    assert pair.config.drafter == kind and pair.head is not None
    assert pair.config.head == str(toml_pairs / kind)
    assert generate(pair, CHAT, max_tokens=TOKENS).tokens == expected.tokens
    argv = ["generate", "--pair", name, "--max-tokens", str(TOKENS), "--temp", "0", "--json"]
    assert main([*argv, CHAT[0]["content"]]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == expected.tokens and out["stats"]["drafted"] > 0
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert name in listing and f"({kind} head {toml_pairs / kind})" in listing


@pytest.mark.parametrize("kind", KINDS)
def test_the_memory_check_counts_the_head(models, kind, monkeypatch, capsys):
    """Memory that holds the target and its KV cache but not the head too: refused."""
    import mlx_spec.models.memory as memory
    from mlx_spec.models.model_dir import context_length

    target = target_of(models, kind)
    config = json.loads((target / "config.json").read_text())
    context = min(context_length(config) or 4096, memory.DEFAULT_MEMORY_CONTEXT)
    alone = memory.weights_bytes(target) + memory.kv_cache_bytes(config, context)
    head = sum(f.stat().st_size for f in models[kind].glob("*.safetensors"))
    monkeypatch.setattr(memory, "machine_memory", lambda: (alone + head // 2, "test memory"))
    run = ["generate", "--max-tokens", "2", "--temp", "0", "hi"]
    assert main(["generate", "--target", str(target), *run[1:]]) == 0  # the target fits
    capsys.readouterr()
    assert main([*run[:1], *head_args(models, kind), *run[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "the models need about" in err and "test memory is" in err and "head " in err


@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_after_a_plain_reply_stays_exact(models, plain, kind):
    """A reply without drafts (the chat's race) between two drafting turns: the head's
    features stop at the gap and the next turn computes the target from there (a recurrent
    target like this Qwen3.5 cannot roll back that far, so it starts over); the turns are
    the target's own tokens either way."""
    pair = head_pair(models, kind)
    decoder = make_decoder(pair)
    first = generate(pair, CHAT, max_tokens=8, decoder=decoder)
    turn = [*CHAT, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Go"}]
    generate(pair, turn, max_tokens=8, use_draft=False, decoder=decoder)
    again = [*turn, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "More"}]
    res = generate(pair, again, max_tokens=TOKENS, decoder=decoder)
    assert res.tokens == generate(plain, again, max_tokens=TOKENS, temperature=0.0).tokens
    assert res.stats.drafted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_restart_finds_the_prompt_on_disk_with_a_head(models, expected, kind, tmp_path):
    """The prompt cache's disk tier with a head pair: after a restart over the same
    --cache-dir the reply is the target's own, and every kind's head state is stored
    (`Drafter.disk_state`: the prompt is read from disk and the head drafts on)."""
    args = [*head_args(models, kind), "--num-draft-tokens", "3", "--cache-dir", str(tmp_path / "c")]
    replies = []
    for _ in ("first", "after a restart"):
        with serving(args, tmp_path) as (_, url):
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
            replies.append(
                client.chat.completions.create(
                    model=target_of(models, kind).name,
                    messages=CHAT,
                    max_tokens=TOKENS,
                    temperature=0,
                )  # fmt: skip
            )
    first, second = replies
    for resp in replies:
        assert resp.choices[0].message.content == expected.text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.9 * second.usage.prompt_tokens, second.usage
    # the head loaded from disk drafts what it drafted before the restart, round for round
    spec = [{k: r.model_extra["speculation"][k] for k in ("drafted", "accepted")} for r in replies]
    assert spec[1] == spec[0] and spec[1]["drafted"] > 0, (cached, second.usage.prompt_tokens)
