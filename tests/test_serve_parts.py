"""The server's parts without a server: the history index, lookup over it, stop strings,
sandboxed chat templates."""

from __future__ import annotations

import pytest
from test_greedy_equality import reference

from mlx_spec import generate, load_pair, make_decoder
from mlx_spec.decode.history import HistoryIndex
from mlx_spec.drafters.ngram import NGramDrafter
from mlx_spec.server.stops import StopText


def test_history_finds_each_ngram_at_its_latest_occurrence():
    h = HistoryIndex(ngram_min=2, ngram_max=3)
    h.add([1, 2, 3, 4, 9, 2, 3, 5, 6])
    assert h.after([2, 3], 2) == [5, 6]  # "2 3" most recently continued with 5
    assert h.after([1, 2, 3], 2) == [4, 9]  # "1 2 3" continued with 4
    assert h.after([3], 2) == []  # single tokens are not indexed (ngram_min 2)
    assert h.after([7, 2, 3, 4], 2) == []  # nor n-grams past ngram_max


def test_history_adds_only_what_a_follow_up_adds_and_stays_bounded():
    h = HistoryIndex(max_tokens=10, ngram_min=2, ngram_max=2)
    h.add([1, 2, 3])
    h.add([1, 2, 3, 4, 5])  # the same conversation, one turn later
    assert h.tokens == [1, 2, 3, 4, 5]
    h.add(list(range(20, 28)))  # past 10 tokens: the older half goes
    assert len(h) <= 10 and h.tokens[-1] == 27
    assert h.after([1, 2], 1) == []  # forgotten with the dropped half
    assert h.after([25, 26], 1) == [27]


def test_lookup_prefers_its_context_then_history():
    history = HistoryIndex(ngram_min=2, ngram_max=4)
    history.add([5, 6, 7, 8, 9, 10])
    d = NGramDrafter(ngram_max=2, ngram_min=1, history=history)
    d.prefill([5, 6, 2, 1, 5, 6])
    # "5 6" is in both; the context's continuation wins at equal length
    assert d.lookup(3) == [2, 1, 5]
    d.prefill([1, 2, 3, 7, 8])
    assert d.lookup(2) == [9, 10]  # "7 8" only in the history
    plain = NGramDrafter(ngram_max=2, ngram_min=1)  # no history: as before
    plain.prefill([1, 2, 3, 7, 8])
    assert plain.lookup(2) == []


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_lookup_with_history_equals_target_alone(tiny_models, k):
    pair = load_pair(target=str(tiny_models.target))
    pair = pair.configured(drafter="ngram")
    prompt = "The quick brown fox jumps over the lazy dog."
    history = HistoryIndex()
    decoder = make_decoder(pair)
    decoder.drafter.history = history
    first = generate(pair, prompt, max_tokens=40, num_draft_tokens=k, decoder=decoder)
    history.add(decoder.sequence)
    fresh = make_decoder(pair)  # a new conversation: only the history knows the reply
    fresh.drafter.history = history
    again = generate(pair, prompt, max_tokens=40, num_draft_tokens=k, decoder=fresh)
    expected = reference(pair, prompt, 40)
    assert first.tokens == again.tokens == expected
    # the prompt does not repeat itself: only the history has a continuation for its end
    assert first.rounds[0].drafted == []
    guess = again.rounds[0].drafted
    assert guess and guess == first.tokens[: len(guess)]


def feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], str, bool]:
    s = StopText(stops)
    out = [s.feed(p) for p in pieces]
    return out, ("" if s.stopped else s.flush()), s.stopped


def test_stop_string_split_across_pieces_is_cut_before_it():
    out, tail, stopped = feed_all(["o w"], ["Hel", "lo", " wo", "rld"])
    assert "".join(out) == "Hell" and stopped and tail == ""
    assert out[1] == "l"  # "o" is held back: it may begin the stop string


def test_a_false_start_is_released():
    out, tail, stopped = feed_all(["abc"], ["xa", "b", "d", "ab"])
    assert not stopped
    assert "".join(out) + tail == "xabdab"
    assert out[-1] == "" and tail == "ab"  # held until the end, then flushed


def test_the_earliest_of_several_stops_wins():
    out, _, stopped = feed_all(["END", "\n\n"], ["one\n", "\ntwo END"])
    assert "".join(out) == "one" and stopped


def test_chat_templates_render_in_a_sandbox(tiny_models):
    """A chat template is code from the model's files: the server renders it through the
    tokenizer's apply_chat_template, which compiles it in jinja2's ImmutableSandboxedEnvironment
    (transformers), never a plain Environment: reaching Python internals is refused."""
    import jinja2
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    from mlx_spec.decode.prompts import encode_prompt

    hf = AutoTokenizer.from_pretrained(str(tiny_models.tokenizer))
    hf.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        encode_prompt(TokenizerWrapper(hf), [{"role": "user", "content": "hi"}])
    hf.chat_template = "{% for m in messages %}{{ m.content.upper() }}{% endfor %}"
    ids = encode_prompt(TokenizerWrapper(hf), [{"role": "user", "content": "hi"}])
    assert hf.decode(ids) == "HI"  # ordinary templates still render


# ----------------------------------------------------------------- reply text on the wire


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    import tiny

    from mlx_spec import load_pair

    target, _ = tiny.write_tool_model(tmp_path_factory.mktemp("tool"))
    return load_pair(target=str(target)).tokenizer


def chat_request(**kw):
    from mlx_spec.server.protocol import GenRequest

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    return GenRequest(kind="chat", model="m", prompt=[], max_tokens=10, tools=tools, **kw)


def split_all(out, pieces):
    deltas = [out.feed(p) for p in pieces] + [out.finish()]
    return (
        "".join(d.content for d in deltas),
        "".join(d.reasoning for d in deltas),
        [c for d in deltas for c in d.tool_calls],
    )


def test_reasoning_and_a_call_split_across_any_pieces(tool_tokenizer):
    from mlx_spec.server.output import Output

    call = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    text = f"<think>hmm</think>Sure.<tool_call>{call}</tool_call>"
    for size in (1, 3, 7, len(text)):  # markers cut anywhere
        out = Output(tool_tokenizer, chat_request(), prompt=[])
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        content, reasoning, calls = split_all(out, pieces)
        assert (content, reasoning) == ("Sure.", "hmm")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("get_weather", '{"city": "Oslo"}')
        ]


def test_a_truncated_call_stays_text_and_raw_reasoning_stays_content(tool_tokenizer):
    from mlx_spec.server.output import Output

    out = Output(tool_tokenizer, chat_request(), prompt=[])
    content, _, calls = split_all(out, ['<tool_call>{"name":"get_we'])  # max_tokens cut it
    assert not calls and content == '<tool_call>{"name":"get_we'
    raw = Output(tool_tokenizer, chat_request(), prompt=[], raw_reasoning=True)
    content, reasoning, _ = split_all(raw, ["<think>hmm</think>ok"])
    assert content == "<think>hmm</think>ok" and reasoning == ""


def test_a_named_tool_choice_parses_what_follows_the_forced_head(tool_tokenizer):
    from mlx_spec.server.output import Output, forced_prefix

    choice = {"type": "function", "function": {"name": "get_weather"}}
    head = forced_prefix(tool_tokenizer, choice)
    assert head.startswith("<tool_call>") and '"get_weather"' in head
    out = Output(tool_tokenizer, chat_request(tool_choice=choice), prompt=[])
    _, _, calls = split_all(out, ['{"city": "Rome"}}', "</tool_call>"])
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_a_template_that_opens_thinking_starts_in_reasoning(tool_tokenizer):
    from mlx_spec.server.output import Output

    prompt = tool_tokenizer.encode("<|im_start|>assistant\n<think>", add_special_tokens=False)
    out = Output(tool_tokenizer, chat_request(), prompt=prompt)
    content, reasoning, _ = split_all(out, ["let me see</think>It is 4."])
    assert (content, reasoning) == ("It is 4.", "let me see")


def test_prefill_stops_between_chunks_and_the_decoder_recovers(pair):
    """abort() is asked between prefill chunks; the half-filled caches are not reused."""
    from mlx_spec.decode.config import GenerationConfig
    from mlx_spec.decode.generate import stream_rounds
    from mlx_spec.errors import Aborted

    prompt = pair.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)[:300]
    decoder = make_decoder(pair)
    asked = []

    def abort():
        asked.append(1)
        return len(asked) > 1  # the first chunk runs, then stop

    from mlx_spec.core.caches import prefill_cache as real

    chunks = []

    def small_chunks(model, cache, tokens, step=2048, **kwargs):
        chunks.append(len(tokens))
        return real(model, cache, tokens, step=64, **kwargs)

    import mlx_spec.decode.engine as engine

    engine.prefill_cache, saved = small_chunks, engine.prefill_cache
    try:
        with pytest.raises(Aborted):
            next(stream_rounds(pair, prompt, GenerationConfig(10), decoder=decoder, abort=abort))
    finally:
        engine.prefill_cache = saved
    assert len(asked) == 2  # stopped after one chunk of 64, not after the whole prompt
    again = generate(pair, prompt, max_tokens=10, decoder=decoder)
    assert again.text == generate(pair, prompt, max_tokens=10).text
    assert again.stats.prompt_tokens_reused == 0


def test_the_tool_grammar_continues_the_forced_head_to_the_end_of_turn(tool_tokenizer):
    """The grammar picks up exactly where forced_prefix ends: the arguments (valid against the
    parameters), `}`, a newline, the end tag, then only end of turn."""
    import numpy as np

    from mlx_spec.core.grammar import Constraint
    from mlx_spec.server.output import tool_grammar
    from mlx_spec.server.protocol import GenRequest

    days = {"days": {"type": "integer", "minimum": 1, "maximum": 9}}
    params = {"type": "object", "properties": days, "required": ["days"]}
    at = {
        "$defs": {"P": {"type": "object", "properties": days, "required": ["days"]}},
        "type": "object",
        "properties": {"when": {"$ref": "#/$defs/P"}},
        "required": ["when"],
    }
    tools = [
        {"type": "function", "function": {"name": "forecast", "parameters": params}},
        {"type": "function", "function": {"name": "noop"}},  # no parameters: {}
        {"type": "function", "function": {"name": "any", "parameters": {}}},  # any object
        {"type": "function", "function": {"name": "at", "parameters": at}},  # its own $refs
    ]

    def matcher(choice):
        req = GenRequest(kind="chat", model="m", prompt=[], max_tokens=9, tools=tools)
        req.tool_choice = choice
        lark = tool_grammar(tool_tokenizer, None, req)
        return Constraint.compile(tool_tokenizer, None, grammar=lark).processor(0)

    def takes(choice, text):
        p = matcher(choice)
        ids = tool_tokenizer.encode(text, add_special_tokens=False)
        return p.matcher.try_consume_tokens(ids) == len(ids) and p.matcher.is_accepting(), p

    named = {"type": "function", "function": {"name": "forecast"}}
    ok, p = takes(named, '{"days": 3}}\n</tool_call>')
    assert ok
    assert np.flatnonzero(p.allowed_now()).tolist() == sorted(tool_tokenizer.eos_token_ids)
    assert not takes(named, '{"days": 10}}\n</tool_call>')[0]  # outside the schema
    assert not takes(named, '{"days": 3}}')[0]  # the call ends with its end tag
    assert not takes(named, '{"days":3}}\n</tool_call>')[0]  # compact, as the template writes
    two = (
        '\n{"name": "noop", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "forecast", "arguments": {"days": 3}}\n</tool_call>'
    )
    assert takes("required", two)[0]
    assert takes("required", '\n{"name": "any", "arguments": {"x": [1]}}\n</tool_call>')[0]
    assert not takes("required", '\n{"name": "noop", "arguments": {"x": 1}}\n</tool_call>')[0]
    assert not takes("required", '\n{"name": "any", "arguments": [1]}\n</tool_call>')[0]
    assert not takes("required", '\n{"name": "other", "arguments": {}}\n</tool_call>')[0]
    assert takes("required", '\n{"name": "at", "arguments": {"when": {"days": 2}}}\n</tool_call>')[
        0
    ]
    assert not takes("required", '\n{"name": "at", "arguments": {"when": {}}}\n</tool_call>')[0]


@pytest.mark.parametrize("use_draft", [True, False])
def test_a_paused_stream_goes_on_from_its_decoder(pair, use_draft):
    """stream_rounds' pause() stops a reply between rounds (the server moves a lone stream
    into its batch so): it returns what is left, the decoder holds exactly the prompt and the
    tokens emitted (plain decoding's step queued ahead is undone), and the reply goes on from
    there as the whole reply would have (greedy)."""
    from mlx_spec.decode.config import GenerationConfig
    from mlx_spec.decode.generate import Paused, stream_rounds

    prompt = pair.tokenizer.encode("Paris is the capital of France. Berlin is")
    config = GenerationConfig(24, temperature=0.0, use_draft=use_draft)
    full = generate(pair, prompt, config)
    decoder, asked = make_decoder(pair), []
    rounds = stream_rounds(pair, prompt, config, decoder=decoder, pause=lambda: len(asked) > 2)
    events, paused = [], None
    while paused is None:
        try:
            events += next(rounds)
        except StopIteration as stop:
            paused = stop.value
        asked.append(1)
    assert isinstance(paused, Paused)
    emitted = decoder.sequence[len(prompt) :]
    assert 0 < len(emitted) == 24 - paused.max_tokens and not decoder.active
    assert emitted == full.tokens[: len(emitted)]
    assert [e.token for e in events] == emitted[: len(events)]  # (one may be held back)
    rest = generate(pair, decoder.sequence, config.replace(max_tokens=paused.max_tokens),
                    decoder=decoder)  # fmt: skip
    assert rest.tokens == full.tokens[len(emitted) :]
    assert rest.stats.prompt_tokens_reused == len(decoder.sequence) - len(rest.tokens) - 1
