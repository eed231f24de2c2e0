"""The stream and wrapper layers over the decoders, as mlx_lm.generate's `stream_generate`,
`generate` and `batch_generate` over its step generators:

- `make_decoder` / `make_batch_decoder`: a pair's `engine.Decoder` (one stream, its drafter
  built by its kind) or `batch.BatchDecoder` (many rows, drafting as the kind says a batch
  drafts);
- `stream_rounds` / `stream`: one request: prompt handling, its processors and grammar,
  detokenization, timing and stats; a list of `Event`s per round, or one `Event` per token;
- `generate`: a stream collected into a `Result`; `batch_generate`: many prompts in one
  continuous batch, each `Result` as `generate` gives it alone.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import wired_limit

from ..core.grammar import grammar_of
from ..core.policies import Auto, Controller, DraftLength, Fixed, draft_length
from ..core.stats import Stats
from ..drafters import Drafter, batched_kinds
from ..errors import SpecError
from ..models import distributed
from .batch import BatchDecoder
from .batch_rows import row_k_max
from .config import GenerationConfig
from .engine import Decoder
from .events import Event, EventMaker, Result
from .prompts import prompt_tokens, request_processors


def make_drafter(pair) -> Drafter | None:
    """The pair's drafter, built by its kind (drafters.KINDS); None for the target alone."""
    kind = pair.config.kind
    return kind.build(pair) if kind is not None else None


def make_decoder(pair, seed: int | None = None) -> Decoder:
    seed = distributed.agreed_seed(pair, seed)  # a sharded target: every rank, one seed
    decoder = Decoder(pair.target, make_drafter(pair), pair.tokenizer.eos_token_ids, seed=seed)
    decoder.pair = pair
    return decoder


def make_batch_decoder(pair, num_draft_tokens=None, plain: bool = False) -> BatchDecoder:
    """A BatchDecoder over a loaded pair; refuses (SpecError) what cannot be batched yet.
    `plain`: no drafts at all (continuous batching of the target), as the server batches a
    pair whose drafter a batch cannot take (a kind that does not say how)."""
    if getattr(pair, "link", None) is not None:
        raise SpecError("a target sharded over several machines cannot be batched yet")
    kind = None if plain else pair.config.kind
    drafting = kind.batch_drafting(pair) if kind is not None else {}
    if drafting is None:
        raise SpecError(
            f"the {kind.name} drafter is not batched yet (batches draft with: "
            f"{', '.join(batched_kinds())}); use generate for this pair"
        )
    length = num_draft_tokens or pair.config.num_draft_tokens
    decoder = BatchDecoder(
        pair.target,
        **drafting,
        eos_token_ids=pair.tokenizer.eos_token_ids,
        num_draft_tokens=length,
        vocab=pair.vocab_size,
    )
    decoder.pair = pair  # a row's schema / grammar / regex compiles for its tokenizer
    return decoder


# ------------------------------------------------------------------------------ one stream


def stream_rounds(
    pair,
    prompt,
    config: GenerationConfig | None = None,
    *,
    decoder: Decoder | None = None,
    stats: Stats | None = None,
    abort=None,
    marks: tuple[int, ...] = (),
    on_mark=None,
    pause=None,
) -> Generator[list[Event], None, Paused | None]:
    """Generate from `pair` as `config` asks, one list of `Event`s per verify round (see
    `stream`). `decoder` (from `make_decoder`) keeps the caches across calls; `stats` is
    filled live; `abort()` is asked between prefill chunks; `marks` and `on_mark`: see
    `Decoder.prefill`. `pause()`, asked after each round while the reply is not over:
    True stops the stream there, between rounds, and the generator returns a `Paused`
    from which the reply goes on elsewhere (the server moves a lone request into its batch
    when another comes); it returns None when the reply ended."""
    config = GenerationConfig.of(config)
    params, seed = config.sampling, config.seed
    length = config.draft_length(pair.config)
    length = distributed.agreed_length(pair, length)  # a sharded target: `auto` follows rank 0
    tokens, max_tokens = prompt_tokens(pair, prompt, config)
    speculative = config.use_draft and pair.speculative
    processors = request_processors(pair, config, len(tokens), pair.vocab_size)
    grammar = grammar_of(processors)
    if decoder is None:
        decoder = make_decoder(pair, seed)
    elif not isinstance(decoder, Decoder):
        raise SpecError(f"decoder must be a Decoder (make_decoder(pair)), not {decoder!r}")
    elif decoder.pair is not None and decoder.pair is not pair:
        raise SpecError("this decoder was made for another pair; make one with make_decoder(pair)")
    elif seed is not None:
        decoder.key = mx.random.key(seed)
    epoch = decoder.begin()
    policy = decoder.policy_for(length)

    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(tokens)
    stats.num_draft_tokens = policy.k_max if speculative else 0
    stats.adaptive = speculative and isinstance(policy, Controller)
    stats.policy = policy if speculative else None
    detokenizer = pair.tokenizer.detokenizer
    detokenizer.reset()
    mx.reset_peak_memory()
    start = time.perf_counter()
    timed = speculative and policy.wants_timing()
    stats.prompt_tokens_reused = decoder.prefill(
        tokens, use_draft=speculative, timed=timed, abort=abort, marks=marks, on_mark=on_mark
    )
    mx.synchronize()
    stats.prefill_seconds = time.perf_counter() - start
    if timed:
        policy.calibrate(*decoder.step_seconds)
    stats.watch(pair.link)  # a sharded target: count its collectives from here
    start = time.perf_counter()

    rounds = decoder.rounds(
        max_tokens,
        params,
        policy,
        use_draft=speculative,
        processors=processors,
        logprobs=config.logprobs,
        forced=config.forcing(grammar),
    )
    maker = EventMaker(detokenizer, stats, start, max_tokens)
    try:
        # as mlx-lm does: on Metal, keep the weights wired while generating
        with wired_limit(pair.target):
            for r in rounds:
                batch = maker.feed(r)
                stats.read_grammar(grammar)
                if batch:
                    yield batch
                if decoder.epoch != epoch:  # checked before the next round touches the caches
                    raise SpecError("another stream took over this decoder; this one cannot go on")
                left = max_tokens - stats.generated_tokens
                if pause is not None and not r.finished and left > 0 and pause():
                    _between_rounds(rounds, decoder, epoch)
                    return Paused(maker, left, processors)
            if last := maker.close():
                yield last
    except GeneratorExit:  # the caller stopped early: every yield is between rounds
        _between_rounds(rounds, decoder, epoch)
        raise
    except BaseException:  # an error, Ctrl-C: the next stream starts over (begin); leave
        if decoder.epoch == epoch:  # nothing lazy for it either, if that can still be done
            try:
                decoder.settle()
            except Exception:  # the error at hand is the one to report
                pass
        raise
    decoder.active = False
    decoder.settle()
    return None


@dataclass
class Paused:
    """A reply `stream_rounds` stopped between rounds (`pause`): its decoder holds the prompt
    and the tokens emitted so far; `maker` holds its detokenizer's state (a token whose text
    is not complete yet); `max_tokens` are left; `processors` (their state: a grammar's
    matcher) go on with the reply (`BatchDecoder.add(processors=...)`)."""

    maker: EventMaker
    max_tokens: int
    processors: list


def _between_rounds(rounds, decoder: Decoder, epoch: int) -> None:
    """Stop `rounds` between two rounds, the caches consistent for whoever goes on."""
    rounds.close()  # plain decoding rolls back its look-ahead step here
    if decoder.epoch == epoch:
        decoder.active = decoder.stale
        decoder.settle()


def stream(
    pair,
    prompt,
    config: GenerationConfig | None = None,
    *,
    decoder: Decoder | None = None,
    stats: Stats | None = None,
    abort=None,
    **settings,
) -> Iterator[Event]:
    """Generate from `pair`, one `Event` per emitted token.

    The settings are a `GenerationConfig` or its fields as keywords (on top of `config` when
    both are given): max_tokens (256), temperature, top_p, top_k, min_p, seed,
    num_draft_tokens (an int, "auto" or a policies.Fixed / policies.Auto; default: the
    pair's, `auto` unless models.toml fixes k), system, chat_template_kwargs (for the chat
    template, e.g. {"enable_thinking": False} for Qwen3), processors (processors.py:
    penalties, logit bias; applied to the target's and the draft's logits alike, so the
    output follows the processed target distribution exactly), logprobs (None: off; N >= 0:
    each event's `logprob` and its `top_logprobs`, N of them, from the target's processed
    distribution before temperature), schema (a JSON Schema, dict or JSON text), grammar (a
    Lark grammar, as llguidance reads it) or regex: the reply is constrained to it exactly,
    target and draft masked alike (grammar.py); forced_tokens (default True: where the
    grammar forces the next tokens they are drafted for free; with use_draft=False nothing
    is drafted), use_draft (False: plain decoding with the same pair).

    The drafter's own settings (draft_confidence, n-gram lengths) belong to the pair:
    `pair.configured(draft_confidence=0.5)`. `decoder` (from `make_decoder`) keeps KV caches
    across calls, so a prompt that extends the previous conversation only prefills its new
    tokens; `stats` (a `Stats`) holds the totals afterwards (every event also carries them,
    live); `abort()` is asked between prefill chunks.
    """
    config = GenerationConfig.of(config, **settings)
    for batch in stream_rounds(pair, prompt, config, decoder=decoder, stats=stats, abort=abort):
        yield from batch


def generate(pair, prompt, config: GenerationConfig | None = None, **settings) -> Result:
    """Run `stream` to the end; `res.text`, `res.tokens`, `res.accepted`, `res.kinds`,
    `res.rounds` (what each round drafted and kept), `res.stats`."""
    stats = settings.pop("stats", None) or Stats()
    events = list(stream(pair, prompt, config, stats=stats, **settings))
    return Result.of(events, stats)


# ------------------------------------------------------------------------------ many streams


def batch_length(lengths: list) -> DraftLength:
    """One policy for rows that each ask their own k: `auto` up to the longest when any row
    asks `auto`, else the longest fixed k (each row capped to its own by `row_k_max`)."""
    lengths = [draft_length(x) for x in lengths]
    longest = max(row_k_max(x) for x in lengths)
    return Auto(longest) if any(isinstance(x, Auto) for x in lengths) else Fixed(longest)


def batch_generate(
    pair, prompts: list, config=None, *, max_batch: int | None = None, **settings
) -> list[Result]:
    """Generate for every prompt in one continuous batch: a `Result` per prompt, in order,
    with the same fields and stats as `generate` gives it alone (and, greedy, the same tokens;
    seeded, the same samples). `config`: one GenerationConfig (or keyword settings) for all
    prompts, or a list of them, one per prompt (each its own k: a row drafts at most its
    num_draft_tokens, `auto` rows as the batch's controller chooses). `max_batch`: rows
    decoded together at most (None: all); the others join as rows finish. Not batched yet
    (SpecError): a drafter kind that does not say how a batch drafts with it, a cache
    class the batch does not know (sliding windows, recurrent states, CacheLists and chunked
    attention batch; gpt_bigcode and Llama 4 row by row)."""
    if isinstance(prompts, str):  # (it ran as one prompt per character)
        raise SpecError("batch_generate takes a list of prompts; for one, use generate")
    prompts = list(prompts)
    if isinstance(config, list | tuple):
        if len(config) != len(prompts):
            raise SpecError(f"{len(config)} configs for {len(prompts)} prompts")
        configs = [GenerationConfig.of(c, **settings) for c in config]
    else:
        configs = [GenerationConfig.of(config, **settings)] * len(prompts)
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
        raise SpecError(f"max_batch must be an integer >= 1, got {max_batch!r}")
    if not prompts:
        return []
    # every row drafts at most its own k (row_k_max): the batch's policy covers the longest
    configs = [c.replace(num_draft_tokens=c.draft_length(pair.config)) for c in configs]
    decoder = make_batch_decoder(pair, batch_length([c.num_draft_tokens for c in configs]))
    encoded = [prompt_tokens(pair, p, c) for p, c in zip(prompts, configs, strict=True)]
    waiting = list(range(len(prompts)))
    live: dict[int, tuple] = {}  # row id -> (prompt index, its EventMaker, its events so far)
    results: list[Result | None] = [None] * len(prompts)
    mx.reset_peak_memory()  # (each row's stats: the batch's peak until its last round)
    limit = max_batch or len(prompts)
    while waiting or live:
        while waiting and len(live) < limit:
            i = waiting.pop(0)
            tokens, max_tokens = encoded[i]
            stats = Stats(prompt_tokens=len(tokens))
            longest = decoder.controller.k_max if decoder.controller else decoder.fixed_k
            stats.num_draft_tokens = min(longest or 0, row_k_max(configs[i].num_draft_tokens))
            stats.adaptive = decoder.controller is not None
            if not (decoder.drafting and configs[i].use_draft):
                stats.num_draft_tokens, stats.adaptive = 0, False
            begin = time.perf_counter()
            row = decoder.add(tokens, configs[i], max_tokens=max_tokens)
            stats.prefill_seconds = time.perf_counter() - begin
            maker = EventMaker(pair.tokenizer.detokenizer, stats, time.perf_counter(), max_tokens)
            live[row] = (i, maker, [])
        grammars = {r.id: grammar_of(r.processors) for r in decoder.rows}  # (leaving ones')
        for row, u in decoder.step().items():
            i, maker, events = live[row]
            events += maker.feed(u.round)
            maker.stats.read_grammar(grammars[row])
            if u.done:
                maker.stats.finish_reason = u.finish_reason
                results[i] = Result.of(events + maker.close(), maker.stats)
                del live[row]
    return results
