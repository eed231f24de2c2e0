"""The two settings objects: built from models.toml, flags and keywords, validated once there.
Nothing loads here: a PairConfig is what a pair is, before any weights are read."""

from __future__ import annotations

import pytest

from mlx_spec import GenerationConfig, PairConfig, SpecError
from mlx_spec.cli import main
from mlx_spec.core.policies import Auto, Fixed
from mlx_spec.pairs.loading import pair_config


def test_switching_kinds_on_a_named_pair_applies_the_draft_in_the_same_step():
    lookup = pair_config("smollm2-lookup")
    assert lookup.drafter == "ngram" and lookup.draft is None
    bits = pair_config("smollm2-lookup", drafter="model", draft_bits=4)
    assert (bits.drafter, bits.draft_bits, bits.target) == ("model", 4, lookup.target)
    both = pair_config("smollm2-lookup", drafter="ngram+model", draft_bits=4)
    assert both.drafter == "ngram+model"
    own = pair_config("smollm2-self")
    assert pair_config("smollm2-self", drafter="ngram").draft is None  # the model is dropped
    assert pair_config("smollm2-self", skip_draft=True).speculative is False
    assert pair_config("smollm2-self", num_draft_tokens=3).num_draft_tokens == Fixed(3)
    # a k fixed for the pair's own drafter does not follow it to another kind
    assert pair_config("smollm2-self", drafter="ngram+model").num_draft_tokens == Auto()
    assert own.draft_bits == 4  # this pair's draft is its target re-quantized


def test_the_demo_pair_drafts_with_the_head_shipped_in_the_package():
    demo = pair_config("smollm2-demo")
    assert (demo.drafter, demo.draft, demo.draft_bits) == ("eagle3", None, None)
    assert demo.head == "package:mlx_spec/heads/smollm2-135m-eagle3"
    assert demo.target == pair_config("smollm2-self").target
    assert pair_config("smollm2-demo", drafter="ngram").head is None  # the head is dropped
    assert demo.num_draft_tokens == Fixed(1)  # what paid on the CPU (models.toml)
    # k fixed for the head does not follow it to another kind
    assert pair_config("smollm2-demo", drafter="ngram").num_draft_tokens == Auto()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"skip_draft": True, "draft_adapter": "/nowhere"}, "needs a draft model"),
        ({"drafter": "ngram", "draft_adapter": "/nowhere"}, "needs a draft model"),
        ({"ngram_min": 5, "ngram_max": 2}, "ngram-min <= ngram-max"),
        ({"ngram_max": "3"}, "ngram-min <= ngram-max"),
        ({"draft_confidence": 1.5}, "draft-confidence must be in"),
        ({"drafter": "ngram", "draft_confidence": -0.1}, "draft-confidence must be in"),
        ({"name": "qwen3-8b", "draft_bits": 4}, "not both"),  # it has a draft model already
        ({"draft_bits": 7, "drafter": "model", "name": "smollm2-lookup"}, "draft bits"),
    ],
)
def test_bad_pair_settings_are_refused_where_the_config_is_built(settings, message):
    settings = {"name": "smollm2-self", **settings}
    with pytest.raises(SpecError, match=message):
        pair_config(**settings)


def test_the_cli_refuses_what_the_config_refuses(capsys):
    for flags in (
        ["--no-draft", "--draft-adapter", "/nowhere"],
        ["--drafter", "ngram", "--draft-adapter", "/nowhere"],
        ["--ngram-min", "5", "--ngram-max", "2"],
    ):
        assert main(["generate", "--pair", "smollm2-demo", *flags, "hi"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err


def test_generation_config_validates_and_names_where_a_setting_belongs():
    assert GenerationConfig(temperature=0.7).sampling.temperature == 0.7
    for bad, message in [
        ({"max_tokens": 0}, "max-tokens"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": "0"}, "temperature must be a number"),  # (was a TypeError)
        ({"top_k": 1.5}, "top-k must be an integer"),  # (was taken as it was)
        ({"top_p": "1"}, "top-p must be a number"),
        ({"logprobs": -1}, "logprobs"),
        ({"schema": {}, "regex": "a"}, "one of schema, grammar or regex"),
    ]:
        with pytest.raises(SpecError, match=message):
            GenerationConfig(**bad)
    with pytest.raises(TypeError, match="pair.configured"):
        GenerationConfig.of(draft_confidence=0.5)
    with pytest.raises(TypeError, match="by keyword"):
        GenerationConfig.of(5)
    with pytest.raises(TypeError, match="unknown generation settings: tempreature"):
        GenerationConfig.of(tempreature=0.5)
    config = GenerationConfig(max_tokens=8)
    assert GenerationConfig.of(config, seed=3) == config.replace(seed=3)
    with pytest.raises(SpecError):  # frozen copies are validated too
        config.replace(max_tokens=-1)


def test_pair_config_is_frozen_and_each_copy_checked():
    config = PairConfig("x", drafter="ngram")
    with pytest.raises(AttributeError):
        config.drafter = "model"
    with pytest.raises(SpecError, match="needs a draft model"):
        config.replace(drafter="model")
    assert config.with_drafter("ngram").num_draft_tokens == config.num_draft_tokens


def test_sampling_settings_have_one_home():
    """GenerationConfig keeps temperature / top_p / top_k / min_p in its SamplingParams only
    (it once re-declared them as fields of its own); the keywords work as ever."""
    import dataclasses

    from mlx_spec import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names == {"temperature", "top_p", "top_k", "min_p"}
    assert not names & {f.name for f in dataclasses.fields(GenerationConfig)}
    config = GenerationConfig(64, 0.7, seed=3)
    assert config.sampling == SamplingParams(0.7) and config.temperature == 0.7
    changed = config.replace(top_p=0.5, max_tokens=8)
    assert changed.sampling == SamplingParams(0.7, 0.5) and changed.seed == 3
    assert GenerationConfig.of(config, temperature=0.0).sampling.greedy
    with pytest.raises(SpecError, match="temperature"):
        GenerationConfig(temperature=float("nan"))
