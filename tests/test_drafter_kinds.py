"""Drafters as kinds: a kind from outside the package is registered, validated and lossless
on every surface that names kinds; a drafter that reads the target's hidden states gets
them from the verify pass itself, row for row equal to a full forward of the sequence."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from example_kind import RepeatKind, RepeatLast
from test_distribution import chi_square, exact_joint, first_two
from test_greedy_equality import PROMPTS, reference

from mlx_spec import (
    Decoder,
    PairConfig,
    SamplingParams,
    SpecError,
    generate,
    load_pair,
    make_decoder,
)
from mlx_spec.cli import main
from mlx_spec.core.caches import TIMED_STEPS
from mlx_spec.core.hidden import FINAL_NORM, capturing
from mlx_spec.core.policies import Fixed
from mlx_spec.drafters import KINDS, register


@pytest.fixture(autouse=True)
def repeat_kind():
    register(RepeatKind)  # the one registry line
    yield
    KINDS.pop(RepeatKind.name)  # other modules see the package's kinds only


def test_a_registered_kind_is_validated_where_the_config_is_built(tiny_models):
    assert KINDS["repeat"] is RepeatKind
    target = str(tiny_models.target)
    config = PairConfig(target, drafter="repeat", num_draft_tokens=3)
    assert config.speculative and config.kind is RepeatKind
    with pytest.raises(SpecError, match="at most 4 tokens"):
        PairConfig(target, drafter="repeat", num_draft_tokens=6)
    with pytest.raises(SpecError, match="needs no draft model"):
        PairConfig(target, draft=str(tiny_models.draft), drafter="repeat")
    with pytest.raises(SpecError, match="the repeat drafter has no draft-confidence setting"):
        PairConfig(target, drafter="repeat", draft_confidence=0.5)  # (the kind declares none)
    with pytest.raises(
        SpecError, match="drafter must be one of model, ngram, ngram\\+model, .*repeat"
    ):
        PairConfig(target, drafter="nope")
    with pytest.raises(SpecError, match="needs a draft model"):
        PairConfig(target, drafter="model")


@pytest.mark.parametrize("k", [2, 4, "auto"])
def test_the_example_kind_is_lossless_greedy(tiny_models, k):
    pair = load_pair(target=str(tiny_models.target), drafter="repeat")
    decoder = make_decoder(pair)
    assert isinstance(decoder.drafter, RepeatLast)
    assert decoder.policy_for(Fixed(4) if k != "auto" else pair.config.num_draft_tokens).k_max <= 4
    drafted = accepted = 0
    for prompt in PROMPTS:
        res = generate(pair, prompt, max_tokens=40, num_draft_tokens=k)
        assert res.tokens == reference(pair, prompt, 40)
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    if k != "auto":  # the controller may pause a draft this poor: no counts to promise
        assert drafted > 0


def test_the_example_kind_keeps_the_distribution(tiny_models):
    pair = load_pair(target=str(tiny_models.small_target))
    params = SamplingParams(temperature=1.0)
    counts = first_two(pair, params, 800, k=2, drafter=RepeatLast())
    stat, threshold = chi_square(counts, exact_joint(pair, params))
    assert stat < threshold


def test_the_cli_offers_a_registered_kind(tiny_models, capsys):
    common = ["generate", "--target", str(tiny_models.target), "--max-tokens", "24", "--json"]
    assert main([*common, "--drafter", "repeat", "--num-draft-tokens", "3", "one two two"]) == 0
    speculative = json.loads(capsys.readouterr().out)
    assert main([*common, "--no-draft", "one two two"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert speculative["tokens"] == plain["tokens"]
    assert speculative["stats"]["drafted"] > 0
    assert main([*common, "--drafter", "repeat", "--num-draft-tokens", "9", "x"]) == 2
    assert "at most 4 tokens" in capsys.readouterr().err


class HiddenRecorder(RepeatLast):
    """Reads layers 0 and -1 of the target and its final norm; keeps every row it is handed
    by position."""

    hidden_layers = (0, -1, FINAL_NORM)
    max_draft = None

    def prefill(self, tokens, timed=False, output=None):
        # the target hands the rows from here on (a continued sequence keeps what is before:
        # a drafting turn after a plain one resumes where the rows stopped, not from 0)
        start = len(tokens) - 1 - (output.fed if output is not None else 0)
        kept = getattr(self, "states", {})  # position in the sequence -> {layer: (hidden,)}
        self.states = {p: rows for p, rows in kept.items() if p < start}
        self.filled = start
        self.take(output)
        return super().prefill(tokens, timed)

    def take(self, output) -> None:
        if output is None:  # an end-of-sequence step: nothing fed after it
            return
        for row in range(output.kept):
            assert self.filled not in self.states, "a position was handed twice"
            self.states[self.filled] = {i: output.hidden[i][row] for i in self.hidden_layers}
            self.filled += 1

    def commit(self, kept, output=None):
        self.take(output)
        super().commit(kept, output)


@pytest.fixture(scope="module")
def family_pair(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hidden")
    configs = tiny.family_configs(320)

    def get(name):
        if name == "llama":
            return load_pair(target=str(tiny_models.target), drafter="repeat")
        cfg = configs[name]
        target = tiny.write_model(
            root / name, cfg, tiny.family_weights(cfg, 0), tiny_models.tokenizer
        )
        return load_pair(target=str(target), drafter="repeat")

    return get


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
@pytest.mark.parametrize("k", [3, "auto"])
def test_hidden_states_come_from_the_verify_pass(family_pair, family, k, monkeypatch):
    """Every position of the final sequence is handed once, equal to the same layers of one
    forward over the whole sequence; the target runs once per round (no second pass).
    Gemma 3 slides its window across the reply; Qwen3.5 replays rejected rounds."""
    pair = family_pair(family)
    recorder = HiddenRecorder()
    decoder = Decoder(pair.target, recorder, pair.tokenizer.eos_token_ids)
    decoder.pair = pair
    calls = []
    model_call = type(pair.target).__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return model_call(self, *args, **kwargs)

    monkeypatch.setattr(type(pair.target), "__call__", counted)
    prompt = PROMPTS[1]
    res = generate(pair, prompt, max_tokens=30, num_draft_tokens=k, decoder=decoder)
    monkeypatch.undo()
    sequence = decoder.sequence
    # the cache holds all but the last token; the recorder has a row for each of them
    assert sorted(recorder.states) == list(range(len(sequence) - 1))
    if k == 3:  # prefill: one chunk, then its last TIMED_STEPS tokens one at a time (a fixed
        # k times a target step once, for the verdict: payoff.py), then one pass per round
        assert len(calls) == 1 + TIMED_STEPS + res.stats.target_passes
        assert res.stats.drafted > 0
    with capturing(pair.target, recorder.hidden_layers) as full:
        pair.target(mx.array(sequence[:-1])[None])
    for layer in recorder.hidden_layers:
        rows = mx.stack([recorder.states[i][layer] for i in range(len(sequence) - 1)])
        np.testing.assert_allclose(np.array(rows), np.array(full[layer][0]), atol=2e-4, rtol=1e-3)


class HeadKind(RepeatKind):
    """A kind that reads a head directory (as MTP, EAGLE-3 and DFlash do)."""

    name = "repeat-head"
    needs_head = True

    @classmethod
    def load_head(cls, path, target, target_config):
        import mlx.nn as nn

        head = nn.Linear(4, 4)
        head.load_weights(str(path / "head.safetensors"))
        return head


def test_a_head_kind_is_named_loaded_and_counted(tiny_models, tmp_path, monkeypatch):
    import mlx.nn as nn

    import mlx_spec.pairs.loading as loading

    monkeypatch.setitem(KINDS, HeadKind.name, HeadKind)  # registered for this test only
    target = str(tiny_models.target)
    with pytest.raises(SpecError, match="needs a head directory"):
        PairConfig(target, drafter="repeat-head")
    with pytest.raises(SpecError, match="reads no head"):
        PairConfig(target, drafter="repeat", head=str(tmp_path))
    with pytest.raises(SpecError, match="a head needs a drafter kind"):
        PairConfig(target, head=str(tmp_path))
    head_dir = tmp_path / "head"
    head_dir.mkdir()
    nn.Linear(4, 4).save_weights(str(head_dir / "head.safetensors"))
    with pytest.raises(SpecError, match="is not a directory"):
        load_pair(target=target, drafter="repeat-head", head=str(tmp_path / "missing"))
    counted = []
    real = loading.check_memory
    monkeypatch.setattr(loading, "check_memory", lambda *a: counted.append(a[-1]) or real(*a))
    pair = load_pair(target=target, drafter="repeat-head", head=str(head_dir))
    assert counted == [head_dir]  # the memory check saw the head's weights
    assert isinstance(pair.head, nn.Linear) and pair.config.head == str(head_dir)
    # the same models under another kind that reads no head: the head is dropped
    assert pair.config.with_drafter("repeat").head is None
    res = generate(pair, PROMPTS[0], max_tokens=20, num_draft_tokens=2)
    assert res.tokens == reference(pair, PROMPTS[0], 20)
    # models.toml names a head as the draft: { head = "KIND", path = "DIR" } beside the file
    toml = tmp_path / "models.toml"
    toml.write_text(
        f'[pairs.headed]\ntarget = "{target}"\ndraft = {{ head = "repeat-head", path = "head" }}\n'
    )
    monkeypatch.setenv("MLX_SPEC_MODELS", str(toml))
    config = loading.pair_config("headed")
    assert config.drafter == "repeat-head" and config.head == str(head_dir)
    assert loading.pair_config("headed", skip_draft=True).head is None


def test_hidden_states_cover_every_position_across_turns(family_pair):
    """A turn ended by end-of-sequence in a plain step, then a turn without the draft, then a
    drafting turn: the drafter still holds every position once, equal to one forward."""
    pair = family_pair("llama")
    recorder = HiddenRecorder()
    decoder = Decoder(pair.target, recorder, pair.tokenizer.eos_token_ids)
    decoder.pair = pair
    eos = pair.tokenizer.eos_token_ids
    ids = pair.tokenizer.encode(PROMPTS[0])
    first = generate(pair, ids, max_tokens=12, num_draft_tokens=2, decoder=decoder)
    ids = ids + first.tokens + [7, 8]
    second = generate(pair, ids, max_tokens=6, use_draft=False, decoder=decoder)
    ids = ids + second.tokens + [9]
    generate(pair, ids, max_tokens=10, num_draft_tokens=3, decoder=decoder)
    sequence = decoder.sequence
    assert sorted(recorder.states) == list(range(len(sequence) - 1))
    with capturing(pair.target, (0,)) as full:
        pair.target(mx.array(sequence[:-1])[None])
    rows = mx.stack([recorder.states[i][0] for i in range(len(sequence) - 1)])
    np.testing.assert_allclose(np.array(rows), np.array(full[0][0]), atol=2e-4, rtol=1e-3)
    assert eos  # the tiny tokenizer declares its end-of-sequence ids


def test_a_plain_step_that_ends_the_reply_hands_its_row():
    """The end-of-sequence token's pass was fed the token before it: that row is handed too
    (a round of one plain step, no model: the Round carries the pass's output)."""
    import mlx_spec.decode.engine as engine

    seen = []

    class Target:
        def __call__(self, x, cache=None):
            seen.append(x.shape[1])
            logits = mx.zeros((1, x.shape[1], 8))
            return logits + (mx.arange(8) == 2)  # always token 2: the end of sequence

    decoder = engine.Decoder.__new__(engine.Decoder)  # only the plain-step machinery
    decoder.target, decoder.cache, decoder.recurrent = Target(), [], False
    decoder.sequence, decoder.unfed, decoder.eos, decoder.epoch = [1, 5], 1, {2}, 0
    decoder.hidden_layers, decoder.stale, decoder.key = (), False, mx.random.key(0)
    rounds = list(decoder._plain_steps(4, SamplingParams()))
    assert rounds[-1].finished and rounds[-1].target_output is not None
    assert rounds[-1].target_output.kept == 1


def test_a_head_named_by_hub_id_that_is_not_here_is_one_line(tiny_models, monkeypatch):
    monkeypatch.setitem(KINDS, HeadKind.name, HeadKind)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpecError, match="not downloaded and HF_HUB_OFFLINE is set"):
        load_pair(target=str(tiny_models.target), drafter="repeat-head", head="someone/no-head")


def test_the_curated_head_pairs_parse():
    from mlx_spec.pairs.registry import load_registry

    heads = {n: p for n, p in load_registry().pairs.items() if p.head is not None}
    assert {"llama3.1-8b-eagle3", "llama3.1-8b-dflash", "qwen3-8b-dflash"} <= set(heads)
    assert heads.pop("smollm2-demo").head == "package:mlx_spec/heads/smollm2-135m-eagle3"
    for pair in heads.values():  # hub ids, kept as ids (not made paths beside models.toml)
        assert pair.head.count("/") == 1 and pair.kind.needs_head


@pytest.mark.parametrize("kind", ["ngram", "eagle3", "mtp", "dflash"])
def test_a_setting_a_kind_does_not_read_is_refused_alike(tiny_models, tmp_path, kind):
    """draft_confidence on a kind that does not read it: one message for every kind (ngram
    once ignored it silently; the head kinds said it three different ways)."""
    head = {"head": str(tmp_path)} if KINDS[kind].needs_head else {}
    with pytest.raises(SpecError) as info:
        PairConfig(str(tiny_models.target), drafter=kind, draft_confidence=0.5, **head)
    assert str(info.value) == f"the {kind} drafter has no draft-confidence setting"
    # switching a confident model pair to such a kind drops the setting it cannot use
    config = PairConfig(str(tiny_models.target), draft=str(tiny_models.draft), draft_confidence=0.5)
    assert config.with_drafter(kind, **head).draft_confidence is None
