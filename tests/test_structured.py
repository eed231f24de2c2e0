"""Structured output is lossless: speculative constrained decoding equals plain constrained
decoding token for token at temperature 0, and follows the constrained target distribution
at temperature 1.

The reference here is written from scratch on mlx-lm's model and cache and llguidance's own
matcher (not mlx_spec's grammar processor): one target step per token, the logits masked to
the matcher's allowed set, argmax (or the exact masked distribution, enumerated)."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_distribution import accept_everything, chi_square

import mlx_spec.decode.rounds as rounds
from mlx_spec import Decoder, SamplingParams, SpecError, generate, load_pair
from mlx_spec.core.grammar import JSON_OPTIONS, Constraint
from mlx_spec.core.sampling import probabilities
from mlx_spec.drafters.model import ModelDrafter
from mlx_spec.drafters.ngram import NGramDrafter

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["fox", "dog", "capital"]},
        "age": {"type": "integer"},
    },
    "required": ["name", "kind", "age"],
    "additionalProperties": False,
}
CAPITALS = 'start: ("Paris" | "Berlin") " is the capital of " /[A-Z][a-z]{1,5}/ "."\n'
FOX = r"(the|a) (quick|lazy) [a-z ]{1,24}\."
GRAMMARS = {"json": ("schema", PERSON), "lark": ("grammar", CAPITALS), "regex": ("regex", FOX)}
PROMPTS = ["The quick brown fox", "Paris is the capital of France. Paris"]


def ll_grammar(kind: str, value) -> str:
    if kind == "schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    return llguidance.LLMatcher.grammar_from_regex(value)


_ll = {}


def matcher(pair, kind: str, value) -> llguidance.LLMatcher:
    key = id(pair.tokenizer)
    if key not in _ll:
        eos = sorted(pair.tokenizer.eos_token_ids)
        _ll[key] = llguidance.hf.from_tokenizer(
            pair.tokenizer._tokenizer, n_vocab=pair.vocab_size, eos_token=eos
        )
    m = llguidance.LLMatcher(_ll[key], ll_grammar(kind, value), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def allowed(m: llguidance.LLMatcher, width: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")
    return bits[:width].astype(bool)


def reference(pair, prompt: str, kind: str, value, max_tokens: int):
    """Plain constrained greedy decoding: (tokens, finish_reason). `prompt`: text or ids."""
    ids = (
        prompt
        if isinstance(prompt, list)
        else pair.tokenizer.encode(prompt, add_special_tokens=False)
    )
    m = matcher(pair, kind, value)
    cache = make_prompt_cache(pair.target)
    logits = pair.target(mx.array(ids)[None], cache=cache)[0, -1]
    out = []
    for _ in range(max_tokens):
        row = np.array(logits.astype(mx.float32))
        row = np.where(allowed(m, row.shape[0]), row, -np.inf)
        token = int(row.argmax())
        if token in pair.tokenizer.eos_token_ids:
            return out, "stop"
        out.append(token)
        assert m.consume_token(token), m.get_error()
        logits = pair.target(mx.array([[token]]), cache=cache)[0, -1]
    return out, "length"


def unconstrained(pair, prompt: str, max_tokens: int) -> list[int]:
    return generate(pair, prompt, max_tokens=max_tokens, use_draft=False).tokens


@pytest.fixture(scope="module")
def pairs(tiny_models):
    t, d = str(tiny_models.target), str(tiny_models.draft)
    return {
        "plain": load_pair(target=t),
        "model": load_pair(target=t, draft=d),
        "ngram": load_pair(target=t, drafter="ngram"),
        "ngram+model": load_pair(target=t, draft=d, drafter="ngram+model"),
        "target2": load_pair(target=str(tiny_models.target2), draft=str(tiny_models.draft2)),
    }


def check_valid(name: str, text: str, finish: str) -> None:
    if finish != "stop":
        return
    if name == "json":
        value = json.loads(text)
        assert set(value) == {"name", "kind", "age"} and value["kind"] in {"fox", "dog", "capital"}
    elif name == "lark":
        assert re.fullmatch(r"(Paris|Berlin) is the capital of [A-Z][a-z]{1,5}\.", text)
    else:
        assert re.fullmatch(FOX, text)


@pytest.mark.parametrize("name", list(GRAMMARS))
@pytest.mark.parametrize("config", ["plain", "model", "ngram", "ngram+model", "target2"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_plain_constrained_decoding(pairs, name, config, k):
    pair = pairs[config]
    kind, value = GRAMMARS[name]
    for prompt in PROMPTS:
        expected, finish = reference(pair, prompt, kind, value, 40)
        assert expected != unconstrained(pair, prompt, len(expected)), "the grammar is a no-op"
        res = generate(pair, prompt, max_tokens=40, num_draft_tokens=k, **{kind: value})
        assert res.tokens == expected
        assert res.finish_reason == finish
        assert res.stats.constrained == {"schema": "json_schema", "grammar": "lark"}.get(kind, kind)
        check_valid(name, res.text, finish)
        # forced tokens were drafted (keys, quotes, the rest of "capital of ") and counted
        assert res.stats.forced_drafted > 0 and 0 < res.stats.forced_tokens
        assert res.stats.forced_tokens <= res.stats.forced_drafted <= res.stats.drafted
        assert res.stats.masks > 0 and res.stats.mask_seconds > 0


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_without_forced_tokens_and_without_drafting_the_output_is_the_same(pairs, name):
    kind, value = GRAMMARS[name]
    expected, _ = reference(pairs["plain"], PROMPTS[0], kind, value, 40)
    plain = generate(pairs["model"], PROMPTS[0], max_tokens=40, use_draft=False, **{kind: value})
    assert plain.tokens == expected
    assert plain.stats.drafted == 0 and plain.stats.forced_drafted == 0
    model = generate(
        pairs["model"], PROMPTS[0], max_tokens=40, num_draft_tokens=3, forced_tokens=False,
        **{kind: value},
    )  # fmt: skip
    assert model.tokens == expected
    assert model.stats.forced_drafted == 0 and model.stats.drafted > 0


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_log_probabilities_under_a_grammar_without_drafting_equal_the_drafted_ones(pairs, name):
    """A grammar's plain steps (`use_draft=False`, or k = 0) read the log-probabilities too
    (once they were null there): the same tokens and values as the drafting path reads from
    its verify passes, both from the masked, processed target distribution."""
    from mlx_spec import stream

    kind, value = GRAMMARS[name]
    settings = {"max_tokens": 30, "logprobs": 2, kind: value}
    runs = [
        list(stream(pairs["model"], PROMPTS[0], **draft, **settings))
        for draft in ({"use_draft": False}, {"num_draft_tokens": 3})
    ]
    plain, drafted = runs
    assert [e.token for e in plain] == [e.token for e in drafted]
    for p, d in zip(plain, drafted, strict=True):
        assert isinstance(p.logprob, float) and p.logprob == pytest.approx(d.logprob, abs=1e-4)
        assert [t for t, _ in p.top_logprobs] == [t for t, _ in d.top_logprobs]


def test_a_reply_cut_by_max_tokens_says_length(pairs):
    full, finish = reference(pairs["model"], PROMPTS[1], "grammar", CAPITALS, 60)
    assert finish == "stop" and len(full) > 6
    res = generate(pairs["model"], PROMPTS[1], max_tokens=len(full) - 3, grammar=CAPITALS)
    assert res.tokens == full[:-3] and res.finish_reason == "length"
    done = generate(pairs["model"], PROMPTS[1], max_tokens=60, grammar=CAPITALS)
    assert done.tokens == full and done.finish_reason == "stop"


def test_lookup_guesses_outside_the_grammar_are_never_accepted(pairs):
    """The prompt repeats letters; the grammar allows digits only: lookup proposes its
    letters, the target's masked rows give them probability 0."""
    pair = pairs["ngram"]
    prompt = "abc abc abc abc abc abc abc abc"
    for temperature in (0.0, 1.0):
        res = generate(
            pair, prompt, max_tokens=24, regex=r"[0-9 ]+", temperature=temperature, seed=1,
            num_draft_tokens=4,
        )  # fmt: skip
        assert re.fullmatch(r"[0-9 ]*", res.text)
        assert res.stats.drafted > res.stats.forced_drafted  # lookup proposed
        assert res.stats.accepted < res.stats.drafted  # and was refused
        for r in res.rounds:  # every accepted guess is a token the grammar allowed
            text = pair.tokenizer.decode(r.drafted[: r.accepted])
            assert re.fullmatch(r"[0-9 ]*", text)


def test_the_draft_model_is_masked_too(pairs):
    """q of a masked draft is 0 outside the allowed set (the draft proposes only allowed
    tokens, which is what makes its acceptance high)."""
    pair = pairs["model"]
    ids = pair.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    constraint = Constraint.compile(pair.tokenizer, pair.vocab_size, regex=FOX)
    grammar = constraint.processor(len(ids))
    drafter = ModelDrafter(pair.draft, vocab=pair.vocab_size)
    drafter.prefill(ids)
    params = SamplingParams(temperature=1.0)
    tokens, q = drafter.propose(4, params, mx.random.key(0), processors=[grammar])
    m = matcher(pair, "regex", FOX)
    for i, t in enumerate(tokens.tolist()):
        ok = allowed(m, pair.vocab_size)
        assert float(mx.sum(q[i] * mx.array(~ok))) == 0.0 and ok[t]
        assert m.consume_token(t)
    bare = ModelDrafter(pair.draft, vocab=pair.vocab_size)
    bare.prefill(ids)
    _, q_bare = bare.propose(1, params, mx.random.key(0))
    assert float(mx.sum(q_bare[0] * mx.array(~allowed(matcher(pair, "regex", FOX), 320)))) > 0


def test_padding_rows_of_the_target_head_are_masked(tiny_models, tmp_path):
    """A head with rows past the tokenizer (ids no text has), made the favourites: plain
    decoding emits them, constrained decoding never does."""
    import tiny

    cfg = tiny.llama_config(330, layers=2)
    weights = tiny.random_weights(cfg, seed=5)
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = mx.concatenate([head[:320], 50 * head[320:]])
    path = tiny.write_model(tmp_path / "padded", cfg, weights, tiny_models.tokenizer)
    pair = load_pair(target=str(path), drafter="ngram")
    ids = pair.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert int(mx.argmax(pair.target(mx.array([ids]))[0, -1])) >= 320  # unmasked: a padding id
    for temperature in (0.0, 1.0):
        res = generate(pair, PROMPTS[0], max_tokens=30, regex=FOX, temperature=temperature, seed=0)
        assert res.tokens and max(res.tokens) < 320


# ------------------------------------------------------------------ the distribution


DIST_GRAMMAR = 'start: ("Paris" | "Berlin" | "quick" | "the" | "a") " " /[a-z]+/\n'
DIST_PROMPT = "Paris is the capital of France. Berlin is the capital of Germany. Paris"


def exact_joint(pair, prompt: list[int], params) -> dict:
    """P(t1, t2) of plain constrained sampling, enumerated: {(t1, t2): p}."""
    m = matcher(pair, "grammar", DIST_GRAMMAR)
    V = pair.vocab_size
    logits = pair.target(mx.array([prompt]))[0, -1]
    first = allowed(m, V)
    p1 = np.array(probabilities(mx.where(mx.array(first), logits, -mx.inf), params))
    joint = {}
    for t1 in np.nonzero(p1 > 0)[0].tolist():
        m1 = m.deep_copy()
        assert m1.consume_token(t1)
        second = allowed(m1, V)
        row = pair.target(mx.array([prompt + [t1]]))[0, -1]
        p2 = np.array(probabilities(mx.where(mx.array(second), row, -mx.inf), params))
        for t2 in np.nonzero(p2 > 0)[0].tolist():
            joint[t1, t2] = p1[t1] * p2[t2]
    return joint


def sampled_pairs(pair, prompt, params, runs, drafter, k=3, forced=True):
    constraint = Constraint.compile(pair.tokenizer, pair.vocab_size, grammar=DIST_GRAMMAR)
    decoder = Decoder(pair.target, drafter, eos_token_ids=())
    counts, forced_rounds, forced_refused = {}, 0, 0
    for seed in range(runs):
        decoder.key = mx.random.key(seed)
        decoder.prefill(prompt)
        grammar = constraint.processor(len(prompt))
        tokens = []
        for r in decoder.rounds(
            3, params, k, processors=[grammar], forced=grammar if forced else None
        ):
            forced_rounds += r.forced
            forced_refused += r.forced and r.accepted < r.drafted
            tokens += r.tokens
            if len(tokens) >= 2:
                break
        key = (tokens[0], tokens[1])
        counts[key] = counts.get(key, 0) + 1
    return counts, forced_rounds, forced_refused


def statistic(counts: dict, joint: dict) -> tuple[float, float]:
    assert set(counts) <= set(joint), "a pair the constrained target gives probability 0"
    keys = sorted(joint)
    return chi_square(
        np.array([counts.get(k, 0) for k in keys], float), np.array([joint[k] for k in keys])
    )


@pytest.fixture(scope="module")
def dist_setup(pairs):
    pair = pairs["model"]
    prompt = pair.tokenizer.encode(DIST_PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=1.0)
    return pair, prompt, params, exact_joint(pair, prompt, params)


@pytest.mark.parametrize("drafter", ["model", "lookup", "forced only"])
def test_constrained_sampling_follows_the_constrained_target(dist_setup, drafter):
    pair, prompt, params, joint = dist_setup
    assert len(joint) > 10  # enough cells to tell distributions apart
    made = {
        "model": lambda: ModelDrafter(pair.draft, vocab=pair.vocab_size),
        "lookup": lambda: NGramDrafter(3, 1),
        "forced only": lambda: None,
    }[drafter]()
    counts, forced_rounds, refused = sampled_pairs(pair, prompt, params, 1500, made)
    # the grammar forced " " after the first word; the target preferred another spelling of
    # it (" is", " the", ...) in some rounds: the residual distribution was sampled
    assert forced_rounds > 0 and refused > 0
    stat, threshold = statistic(counts, joint)
    print(f"{drafter}: chi-square {stat:.1f} (99.9% threshold {threshold:.1f})")
    assert stat < threshold


def test_trusting_forced_tokens_fails_the_same_check(dist_setup, monkeypatch):
    """Keeping every forced guess unverified is wrong (another tokenization of the forced
    bytes may be likelier); the harness sees it."""
    pair, prompt, params, joint = dist_setup
    monkeypatch.setattr(rounds, "verify_stochastic", accept_everything)
    counts, _, _ = sampled_pairs(pair, prompt, params, 1500, None)
    stat, threshold = statistic_lenient(counts, joint)
    print(f"forced guesses trusted: chi-square {stat:.1f} (threshold {threshold:.1f})")
    assert stat > threshold


def statistic_lenient(counts: dict, joint: dict) -> tuple[float, float]:
    """As `statistic`, with pairs of probability 0 (a wrong rule's) counted against it."""
    keys = sorted(set(joint) | set(counts))
    observed = np.array([counts.get(k, 0) for k in keys], float)
    probs = np.array([joint.get(k, 0.0) for k in keys])
    if observed[probs == 0].sum() > 0:
        return float("inf"), 0.0
    return chi_square(observed, probs)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"schema": {"type": "objectx"}}, "the JSON schema cannot be compiled"),
        ({"schema": "{not json"}, "not valid JSON"),
        ({"schema": [1, 2]}, "must be an object"),
        ({"grammar": "start: foo\n"}, "the grammar cannot be compiled"),
        ({"regex": "[a-"}, "the regex cannot be compiled"),
        ({"schema": PERSON, "regex": "a"}, "one of"),
    ],
)
def test_bad_grammars_are_a_spec_error(pairs, kwargs, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        generate(pairs["model"], PROMPTS[0], max_tokens=4, **kwargs)
