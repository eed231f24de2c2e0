"""A prompt -> checked token ids: raw text, chat messages through the template, or ids within
the target's vocabulary and context; and a constraint (schema, grammar, regex) compiled for
the pair's tokenizer.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..core.grammar import Constraint
from ..core.processors import check_vocab
from ..errors import SpecError
from .config import GenerationConfig


def check_token_ids(ids: list, vocab: int | None) -> list[int]:
    """Token ids must index the target's embedding: out of range, MLX reads past it."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise SpecError(f"token ids must be integers, got {t!r}")
        if t < 0 or (vocab is not None and t >= vocab):
            limit = f"[0, {vocab})" if vocab is not None else "non-negative"
            raise SpecError(f"token id {t} is out of range: the target's ids are {limit}")
    return [int(t) for t in ids]


def chat_text(tokenizer, messages: list, kwargs: dict) -> str:
    """The chat template's text for `messages`: a new assistant turn opened after them, or,
    with `continue_final_message` in `kwargs`, the last message (an assistant's) going on."""
    start = not kwargs.get("continue_final_message")
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=start, **kwargs
    )


def encode_prompt(
    tokenizer, prompt, system: str | None = None, template_kwargs: dict | None = None
) -> list[int]:
    """str (raw text), list of {"role", "content"} messages, or list of token ids -> ids.
    `template_kwargs` go to the chat template (e.g. Qwen3's `enable_thinking=False`;
    `continue_final_message=True`: the last message, an assistant's, goes on, no new turn)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise SpecError("the prompt is empty")
        if system is not None:
            return encode_prompt(
                tokenizer,
                [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
                template_kwargs=template_kwargs,
            )
        bos = tokenizer.bos_token
        return list(
            tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        )
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
        if not any(str(m.get("content", "")).strip() for m in prompt):
            raise SpecError("the prompt is empty")
        if system is not None and prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": system}, *prompt]
        if not tokenizer.has_chat_template:
            raise SpecError("this model's tokenizer has no chat template; pass raw text instead")
        text = chat_text(tokenizer, prompt, template_kwargs or {})
        return list(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(prompt, list | tuple | mx.array | np.ndarray):
        ids = prompt.tolist() if isinstance(prompt, mx.array | np.ndarray) else list(prompt)
        if not ids:
            raise SpecError("the prompt is empty")
        return check_token_ids(ids, None)
    raise SpecError(f"unsupported prompt type {type(prompt).__name__}")


def constraint_for(pair, schema=None, grammar=None, regex=None):
    """schema= / grammar= / regex= -> a grammar.Constraint for the pair's tokenizer (None
    without any). `grammar` may be Lark text or a Constraint compiled before."""
    if schema is None and grammar is None and regex is None:
        return None
    if pair is None:
        raise SpecError("a decoder made without its pair (make_batch_decoder) takes no grammar")
    if isinstance(grammar, Constraint):
        if schema is not None or regex is not None:
            raise SpecError("give one of schema, grammar or regex")
        return grammar
    return Constraint.compile(
        pair.tokenizer, pair.vocab_size, schema=schema, grammar=grammar, regex=regex
    )


def prompt_tokens(pair, prompt, config: GenerationConfig) -> tuple[list[int], int]:
    """The prompt's token ids, checked against the target's vocabulary and context, and the
    most tokens the reply may have there."""
    ids = encode_prompt(pair.tokenizer, prompt, config.system, config.chat_template_kwargs)
    tokens = check_token_ids(ids, pair.vocab_size)
    context = pair.context_length
    if context is None:
        return tokens, config.max_tokens
    if len(tokens) >= context:
        raise SpecError(
            f"the prompt is {len(tokens)} tokens, longer than the model's context of {context}"
        )
    return tokens, min(config.max_tokens, context - len(tokens))


def request_processors(pair, config: GenerationConfig, prompt_length: int, vocab) -> list:
    """A request's logits processors, for a single stream or a batch row alike: the grammar's
    mask (schema / grammar / regex, constraining what follows `prompt_length`) first, so the
    others see allowed tokens only, then the config's, checked against the vocabulary (MLX
    does not bounds-check a gather)."""
    processors = list(config.processors)
    check_vocab(processors, vocab)
    constraint = constraint_for(pair, config.schema, config.grammar, config.regex)
    if constraint is not None:
        processors.insert(0, constraint.processor(prompt_length))
    return processors
