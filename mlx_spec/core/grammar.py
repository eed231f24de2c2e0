"""Structured output: JSON Schema, Lark grammars and regular expressions, via llguidance.

`Constraint.compile(tokenizer, vocab, schema=... | grammar=... | regex=...)` checks the grammar
once (a `SpecError` naming the problem if llguidance cannot compile it). Each stream then takes
a fresh `GrammarProcessor` from `constraint.processor(prompt_length)`: a logits processor
(processors.py) that masks every row to the tokens the grammar allows after it, for the target
and the draft alike, and a source of forced tokens (`forced`), which the engine drafts for free.

The processor keeps one llguidance matcher in step with whatever sequence it is asked about:
before each call it rolls the matcher back to the longest prefix it shares with the sequence
(the emitted tokens, then the round's proposed ones) and consumes the rest. Emitted tokens must
be consumable (they were sampled under the mask): if one is not, or a roll-back fails, it raises
`GrammarStateError` rather than go on with a wrong state. Proposed tokens may be outside the
grammar (a lookup guess): they are tried without harming the matcher, and rows after the first
such token are left as they are (verification rejects that token at its own row, where its
probability is 0).
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import SpecError

# JSON is generated compact, with the separators of Python's json.dumps: no free whitespace
# (a model cannot pad the reply with newlines), and more of every reply is forced. A schema
# may override these with llguidance's "x-guidance" key, e.g. {"whitespace_flexible": true}.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
JSON_OBJECT = {"type": "object"}  # response_format json_object: any JSON object


class GrammarStateError(RuntimeError):
    """The grammar matcher could not follow the sequence: never continue with a wrong state."""


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer, vocab: int | None):
    """The llguidance view of an mlx-lm TokenizerWrapper (built once: ~1 s for 50k tokens)."""
    import llguidance

    key = (vocab, tuple(sorted(getattr(tokenizer, "eos_token_ids", ()) or ())))
    cached = _tokenizers.get(tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise SpecError(
            "structured output needs a fast (Hugging Face tokenizers) tokenizer; this model's "
            f"is {type(hf).__name__}"
        )
    from copy import copy

    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    size = max(vocab or 0, backend.get_vocab_size(with_added_tokens=True))
    eos = sorted(key[1]) or None
    try:
        tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=size, eos_token=eos)
    except Exception as err:  # a tokenizer llguidance cannot read
        raise SpecError(f"llguidance cannot use this tokenizer: {one_line(str(err))}") from None
    _tokenizers[tokenizer] = (key, tok)
    return tok


def one_line(message: str) -> str:
    """llguidance's errors carry the grammar with a caret under the fault: keep the
    message and its 'error:' lines."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    extra = [line for line in lines[1:] if line.lower().startswith("error:")]
    return " ".join([lines[0], *extra])


def read_schema(text: str, source: str = "the schema") -> dict:
    """JSON text -> a schema object (a SpecError names the line of a syntax error)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(f"{source} is not valid JSON: {err.msg} (line {err.lineno})") from None
    if not isinstance(schema, dict):
        raise SpecError(f"{source} must be a JSON object (a JSON Schema)")
    return schema


@dataclass
class Constraint:
    """A grammar compiled against one tokenizer; `processor()` starts a stream with it."""

    kind: str  # "json_schema", "lark" or "regex"
    grammar: str  # llguidance's grammar JSON
    tokenizer: object = field(repr=False)  # llguidance.LLTokenizer
    vocab: int | None = None  # the target's rows (logits width)
    eos_ids: tuple = ()

    @classmethod
    def compile(
        cls,
        tokenizer,
        vocab: int | None = None,
        *,
        schema: dict | str | None = None,
        grammar: str | None = None,
        regex: str | None = None,
    ) -> Constraint:
        given = [n for n, v in (("schema", schema), ("grammar", grammar), ("regex", regex)) if v]
        if len(given) != 1:
            raise SpecError("give one of schema, grammar or regex")
        import llguidance

        if schema is not None:
            if isinstance(schema, str):
                schema = read_schema(schema)
            if not isinstance(schema, dict):
                raise SpecError("the JSON schema must be an object")
            kind, what = "json_schema", "the JSON schema"
            try:
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except (ValueError, TypeError) as err:
                raise SpecError(f"{what} cannot be compiled: {one_line(str(err))}") from None
        elif grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip():
                raise SpecError("the grammar is empty")
            kind, what = "lark", "the grammar"
            text = llguidance.LLMatcher.grammar_from_lark(grammar)
        else:
            if not isinstance(regex, str):
                raise SpecError("the regex must be a string")
            kind, what = "regex", "the regex"
            text = llguidance.LLMatcher.grammar_from_regex(regex)
        tok = ll_tokenizer(tokenizer, vocab)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tok)
        if failed:
            raise SpecError(f"{what} cannot be compiled: {one_line(messages[0])}")
        eos = tuple(sorted(getattr(tokenizer, "eos_token_ids", ()) or ()))
        constraint = cls(kind, text, tok, vocab, eos)
        probe = constraint.processor(0)  # the first mask: a grammar that allows nothing fails
        try:
            probe.allowed_now()
        except GrammarStateError as err:
            raise SpecError(f"{what} cannot be used: {err}") from None
        return constraint

    def processor(self, prompt_length: int) -> GrammarProcessor:
        return GrammarProcessor(self, prompt_length)


def grammar_of(processors) -> GrammarProcessor | None:
    """A stream's grammar: its mask goes first among its processors (None: unconstrained)."""
    first = processors[0] if processors else None
    return first if isinstance(first, GrammarProcessor) else None


class GrammarProcessor:
    """One stream's grammar state: a logits processor and the source of forced tokens.

    `context[prompt_length:]` is what the grammar sees (the prompt is not constrained)."""

    # plain steps must not be queued ahead of it (engine.Decoder._plain_steps): the step after
    # a token is masked by what that token left, and past the grammar's end there is none
    pipelines = False

    def __init__(self, constraint: Constraint, prompt_length: int):
        import llguidance

        self.constraint = constraint
        self.tokenizer = constraint.tokenizer
        self.start = prompt_length
        self.matcher = llguidance.LLMatcher(self.tokenizer, constraint.grammar, log_level=0)
        if self.matcher.is_error():
            raise SpecError(f"the grammar cannot be compiled: {one_line(self.matcher.get_error())}")
        self.consumed: list[int] = []  # the tokens the matcher has consumed
        self.eos = np.array(constraint.eos_ids, dtype=np.int64)
        self._words = np.zeros(((self.tokenizer.vocab_size + 31) // 32,), np.int32)
        self.mask_seconds = 0.0  # computing allowed sets (llguidance + unpacking)
        self.masks = 0

    # ------------------------------------------------------------------ keeping in step

    def _fail(self, what: str) -> GrammarStateError:
        return GrammarStateError(f"{what}: {one_line(self.matcher.get_error() or 'no detail')}")

    def _sync(self, tokens: list[int]) -> None:
        """Bring the matcher to exactly `tokens` (the constrained part of the sequence)."""
        consumed = self.consumed
        n = 0
        limit = min(len(consumed), len(tokens))
        while n < limit and consumed[n] == tokens[n]:
            n += 1
        if n < len(consumed):
            if not self.matcher.rollback(len(consumed) - n) or self.matcher.is_error():
                raise self._fail(f"the grammar could not roll back {len(consumed) - n} tokens")
            del consumed[n:]
        for t in tokens[n:]:
            if not self.matcher.consume_token(t):
                raise self._fail(f"the grammar cannot take the emitted token {t}")
            consumed.append(t)

    def _try(self, token: int) -> bool:
        """Consume a proposed token if the grammar allows it (the matcher is unharmed if not)."""
        if self.matcher.is_stopped() or self.matcher.try_consume_tokens([token]) != 1:
            return False
        self.consumed.append(token)
        return True

    # ------------------------------------------------------------------ masks

    def allowed_now(self, width: int | None = None) -> np.ndarray:
        """(width,) bool: the tokens the grammar allows after what the matcher consumed."""
        start = time.perf_counter()
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little").view(bool)
        width = width or self.constraint.vocab or allowed.shape[0]
        if allowed.shape[0] >= width:
            allowed = allowed[:width]
        else:  # logits wider than the tokenizer: padding rows are never allowed
            allowed = np.concatenate([allowed, np.zeros(width - allowed.shape[0], bool)])
        if self.eos.size and allowed[self.eos[self.eos < width]].any():
            allowed[self.eos[self.eos < width]] = True  # every stop id, wherever one is allowed
        self.mask_seconds += time.perf_counter() - start
        self.masks += 1
        if self.matcher.is_error():
            raise self._fail("the grammar failed")
        if not allowed.any():
            if self.matcher.is_stopped():
                raise GrammarStateError(
                    "the grammar is complete but the model has no end-of-sequence token to stop"
                )
            raise GrammarStateError("the grammar allows no token this model can produce")
        return allowed

    def __call__(self, context: list[int], proposed: list[int], logits: mx.array) -> mx.array:
        n, width = logits.shape
        if isinstance(proposed, mx.array):  # ids the engine has not read back yet: read them
            proposed = proposed.tolist()
        self._sync(context[self.start :])
        offset = len(proposed) + 1 - n  # rows align to the end of `proposed` (processors.py)
        rows = []
        if all(self._try(int(t)) for t in proposed[:offset]):
            rows.append(self.allowed_now(width))
            for token in proposed[offset : offset + n - 1]:
                if not self._try(int(token)):
                    break  # rows after a token the grammar refuses are never reached
                rows.append(self.allowed_now(width))
        mask = np.ones((n, width), bool)
        if rows:
            mask[: len(rows)] = np.stack(rows)
        return mx.where(mx.array(mask), logits, mx.array(-mx.inf, logits.dtype))

    # ------------------------------------------------------------------ forced tokens

    def forced(self, context: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens spelling the bytes the grammar forces next (keys, quotes,
        braces, the rest of an enum value): a guess the target verifies like any draft — the
        grammar forces bytes, and another tokenization of them may be allowed too."""
        if limit <= 0:
            return []
        self._sync(context[self.start :])
        if self.matcher.is_stopped():
            return []
        forced = self.matcher.compute_ff_bytes()
        if not forced:
            return []
        guess = self.tokenizer.tokenize_bytes(forced)
        guess = guess[: self.matcher.validate_tokens(guess)]
        width = self.constraint.vocab
        out = []
        for t in guess[:limit]:
            if width is not None and t >= width:
                break
            out.append(t)
        return out

    @property
    def complete(self) -> bool:
        """Whether what was consumed is a complete match (the grammar may stop here)."""
        return self.matcher.is_accepting()
