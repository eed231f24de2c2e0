"""A request's prompt as token ids: the chat template rendered and tokenised (or raw text, or
ids), with the text clients send kept as plain text.

Two things issue 45 found here. Tokenising ran on the engine thread, so a 7.9 MB prompt was
refused only after 8-31 s of tokenising while a one-word request waited behind it: now the HTTP
side renders and tokenises in a small thread pool (`prepare`) after a cheap bound on the
characters (the context times MAX_CHARS_PER_TOKEN), and the engine receives token ids. And a
user message holding `<|im_end|>` was tokenised as the special token, so user text could forge
a turn boundary: now the text of the messages and tools (every string a client sends) is
tokenised with special tokens read as plain text, and only the template's own markup yields
special ids. A prompt with no special-token text in it tokenises exactly as before (one
`encode` of the rendered text); `--parse-special-in-content` restores the old behaviour.
Completions' raw text is the client's own rendering: its special tokens are kept.

On the engine thread: a request's tokens (`request_tokens`), its generation settings with its
processors and grammar (`request_config`) and where its system part ends (`request_system_end`).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor

from jinja2 import TemplateError
from mlx_lm.utils import common_prefix_len

from ..core.processors import make_processors
from ..decode.prompts import chat_text, constraint_for, encode_prompt
from ..errors import SpecError
from .output import check_tool_choice, forced_prefix, tool_grammar
from .protocol import ApiError, GenRequest

MAX_CHARS_PER_TOKEN = 32  # no tokenizer averages more: a longer text cannot fit the context
_plain = weakref.WeakKeyDictionary()  # tokenizer wrapper -> its copy that reads specials as text


def template_kwargs(req: GenRequest) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.kind == "chat" and req.tools and req.tool_choice != "none":
        kwargs["tools"] = req.tools
    if req.continue_final:  # (no client sets it through chat_template_kwargs: TEMPLATE_ARGUMENTS)
        kwargs["continue_final_message"] = True
    return kwargs


def prompt_ids(pair, req: GenRequest, parse_special: bool = False) -> list[int]:
    """The request's tokens: the chat template with the tools (and a forced tool-call start
    for tool_choice required / named), raw text or token ids."""
    kwargs = template_kwargs(req)
    use_tools = "tools" in kwargs
    try:
        if req.kind == "chat" and not parse_special:
            tokens = chat_ids(pair.tokenizer, req.prompt, kwargs)
        else:
            tokens = encode_prompt(pair.tokenizer, req.prompt, template_kwargs=kwargs or None)
    except TemplateError as err:  # e.g. "roles must alternate": the messages, not a bug
        raise ApiError(400, f"the chat template rejected the messages: {err}", "messages") from None
    except SpecError:
        raise
    except (TypeError, ValueError, RecursionError) as err:  # the client's values broke it
        message = f"the chat template cannot render these messages: {type(err).__name__}: {err}"
        raise ApiError(400, message, "messages") from None
    if use_tools and req.tool_choice not in ("auto", "none"):
        check_tool_choice(pair.tokenizer, req)
        forced = forced_prefix(pair.tokenizer, req.tool_choice)
        tokens += pair.tokenizer.encode(forced, add_special_tokens=False)
    return tokens


def system_end(pair, req: GenRequest, tokens: list[int]) -> int | None:
    """Where a chat prompt's system messages and tools end in its `tokens`, as mlx-lm's
    server finds it: the first token where the system messages alone, then an empty user
    turn, rendered the same way, part from the prompt. None: no such part (no system message
    or tools, a plain-text prompt, a template that will not render an empty turn)."""
    if req.kind != "chat" or req.parse_special or not isinstance(req.prompt, list):
        return None
    kwargs = template_kwargs(req)
    kwargs.pop("continue_final_message", None)  # (the probe's last turn is an empty user's)
    head = 0
    while head < len(req.prompt) and req.prompt[head].get("role") in ("system", "developer"):
        head += 1
    if head == len(req.prompt) or not (head or "tools" in kwargs):
        return None
    try:
        ids = chat_ids(
            pair.tokenizer, req.prompt[:head] + [{"role": "user", "content": ""}], kwargs
        )
    except Exception:  # the template refuses the probe: no mark, nothing else lost
        return None
    end = common_prefix_len(ids, tokens)
    return end if 0 < end < len(tokens) else None


# ------------------------------------------------------------------ special tokens as text


def special_texts(tokenizer) -> list[str]:
    """The text of every special token (the ones the tokenizer matches before anything else:
    turn markers, end of text), longest first."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    found = {t.content for t in getattr(hf, "added_tokens_decoder", {}).values() if t.special}
    found |= set(getattr(hf, "all_special_tokens", []) or [])
    return sorted((t for t in found if t), key=len, reverse=True)


def client_strings(value, out: list[str]) -> list[str]:
    """Every string in the messages and tools: the texts a client chose (dict keys too)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            client_strings(k, out)
            client_strings(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            client_strings(v, out)
    return out


def plain_encode(tokenizer, text: str) -> list[int]:
    """`text`'s ids with special-token text read as plain text. A copy of the Rust tokenizer
    does it (setting the flag on the shared one would race with other threads)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_special_tokens"):
        copy = _plain.get(tokenizer)
        if copy is None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.encode_special_tokens = True
            _plain[tokenizer] = copy
        return list(copy.encode(text, add_special_tokens=False).ids)
    return list(hf.encode(text, add_special_tokens=False, split_special_tokens=True))


def swapped(value, holders: dict[str, str]):
    """`value` with every string that is a key of `holders` (dict keys too) replaced by its
    placeholder."""
    if isinstance(value, str):
        return holders.get(value, value)
    if isinstance(value, dict):
        return {swapped(k, holders): swapped(v, holders) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [swapped(v, holders) for v in value]
    return value


def refused(marked: list[str], specials: list[str]) -> ApiError:
    found = next((t for s in marked for t in specials if t in s), specials[0])
    return ApiError(
        400,
        f"a message holds the special token text {found!r} where the chat template changes it:"
        " it cannot be kept as plain text (--parse-special-in-content reads it as the token)",
        "messages",
    )


def chat_ids(tokenizer, messages: list, kwargs: dict) -> list[int]:
    """The chat template's tokens, the client's text in them plain (module docstring).

    Each client string that holds special-token text is replaced by a placeholder no client
    can guess (ASCII letters and digits, which templates pass through and `tojson` keeps), and
    the template is rendered with and without them. The placeholders cut the rendering into
    the template's own text, tokenised as usual, and the client's strings, tokenised plain,
    each found in the real rendering as it is or JSON-escaped (a template's `tojson`). A
    rendering that does not line up (a template that branches on the text, or changes it
    otherwise) is refused (400), never let through. Linear in the prompt: once the search for
    each string over the whole prompt was quadratic, and it also matched the template's own
    markup, turning real turn boundaries into text."""
    specials = special_texts(tokenizer)
    client = client_strings([messages, kwargs.get("tools")], [])
    marked = [s for s in dict.fromkeys(client) if any(t in s for t in specials)]
    if not marked:  # the common case: exactly the tokens of before
        return encode_prompt(tokenizer, messages, template_kwargs=kwargs or None)
    if not any(str(m.get("content", "")).strip() for m in messages):
        raise SpecError("the prompt is empty")
    if not tokenizer.has_chat_template:
        raise SpecError("this model's tokenizer has no chat template; pass raw text instead")
    nonce = secrets.token_hex(8)
    holders = {s: f"MLXSPEC{nonce}X{i}Y" for i, s in enumerate(marked)}
    real = chat_text(tokenizer, messages, kwargs)
    tools = {"tools": swapped(kwargs["tools"], holders)} if "tools" in kwargs else {}
    held = chat_text(tokenizer, swapped(messages, holders), {**kwargs, **tools})
    parts = re.split(f"MLXSPEC{nonce}X(\\d+)Y", held)
    texts, which = parts[0::2], [int(i) for i in parts[1::2]]
    ids: list[int] = []
    at = 0
    for j, text in enumerate(texts):
        if not real.startswith(text, at):
            raise refused(marked, specials)
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False)
        at += len(text)
        if j == len(which):
            break
        value, after = marked[which[j]], texts[j + 1]
        forms = (value, json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1])
        form = next(
            (f for f in forms if real.startswith(f, at) and real.startswith(after, at + len(f))),
            None,
        )
        if form is None:
            raise refused(marked, specials)
        ids += plain_encode(tokenizer, form)
        at += len(form)
    if at != len(real):
        raise refused(marked, specials)
    return ids


# ------------------------------------------------------------------ off the engine thread


def prompt_chars(req: GenRequest) -> int:
    """Characters in the prompt (and its tools), counted without building anything."""
    if isinstance(req.prompt, str):
        return len(req.prompt)
    if req.kind != "chat":
        return 0  # token ids: counted as ids
    total = sum(len(s) for s in client_strings(req.prompt, []))
    if req.tools:
        total += len(json.dumps(req.tools))
    return total


def too_long(tokens: int, context: int, param: str) -> ApiError:
    """The over-length 400 each client acts on: OpenAI's code context_length_exceeded, and
    `prompt_tokens` / `context` for Anthropic's `prompt is too long: N tokens > M maximum`
    (on which Claude Code compacts its conversation)."""
    err = ApiError(
        400,
        f"the prompt is {tokens} tokens, longer than the model's context of {context}",
        param,
        "context_length_exceeded",
    )
    err.prompt_tokens, err.context = tokens, context
    return err


def param_of(req: GenRequest) -> str:
    return "messages" if req.kind == "chat" else "prompt"


def check_length(pair, req: GenRequest, tokens: list[int]) -> None:
    context = getattr(pair, "context_length", None)
    if context and len(tokens) >= context:
        raise too_long(len(tokens), context, param_of(req))


def check_size(pair, req: GenRequest) -> None:
    """A 400 at once for a prompt the context cannot hold, before any tokenising: more ids
    than the context, or more characters than it could hold at MAX_CHARS_PER_TOKEN each."""
    context = getattr(pair, "context_length", None)
    if not context:
        return
    if req.kind != "chat" and isinstance(req.prompt, list) and len(req.prompt) >= context:
        raise too_long(len(req.prompt), context, "prompt")
    chars = prompt_chars(req)
    if chars > context * MAX_CHARS_PER_TOKEN:
        err = too_long(chars // MAX_CHARS_PER_TOKEN, context, param_of(req))
        err.message = (
            f"the prompt is {chars} characters: more than the model's context of {context}"
            f" tokens can hold (at most {MAX_CHARS_PER_TOKEN} characters a token)"
        )
        raise err


def make_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="mlx-spec-prompt")


async def prepare(engine, req: GenRequest, pool: ThreadPoolExecutor) -> None:
    """Render and tokenise the request's prompt in `pool`, not on the engine thread, and check
    its length: a 400 here for a prompt too long. The ids go to the engine with the pair they
    were made for (a request for another pair, which the engine must load first, is
    tokenised there after the swap)."""
    resident = engine.resident
    pair = resident.pair
    if pair is None or req.model != resident.name:
        return
    check_size(pair, req)
    loop = asyncio.get_running_loop()
    try:
        tokens = await loop.run_in_executor(pool, prompt_ids, pair, req, req.parse_special)
    except SpecError as err:  # an empty prompt, a model with no chat template, ...
        raise ApiError(400, str(err), code="invalid_value") from None
    except ApiError:
        raise
    except Exception as err:  # a bug: 500 for this request alone, as on the engine thread
        traceback.print_exception(err, file=sys.stderr)
        message = f"internal error: {type(err).__name__}: {err}"
        raise ApiError(500, message, code="internal_error") from None
    check_length(pair, req, tokens)
    if not resident.cache.freely:  # marks in the prompt only for caches that need them
        req.prompt_system_end = await loop.run_in_executor(pool, system_end, pair, req, tokens)
    req.prompt_ids, req.prompt_pair = tokens, pair


# ------------------------------------------------------------ on the engine thread


def request_tokens(pair, req: GenRequest) -> list[int]:
    """The request's tokens: made by the HTTP side for this pair (`prepare`), or
    rendered here (a request that swapped the pair in); for the engine thread."""
    if req.prompt_ids is not None and req.prompt_pair is pair:
        return list(req.prompt_ids)
    tokens = prompt_ids(pair, req, req.parse_special)
    check_length(pair, req, tokens)
    return tokens


def request_config(pair, req: GenRequest):
    """The request's generation settings with its processors (penalties, logit_bias) and
    grammar (response_format, or tool_choice required / named: the call follows the
    tools' schemas), alone or in a batch; a grammar that cannot compile is a 400."""
    if req.kind == "chat" and req.tools and req.tool_choice not in ("auto", "none"):
        check_tool_choice(pair.tokenizer, req)
    constraint = None
    if req.constraint is not None:
        try:
            constraint = constraint_for(pair, **req.constraint)
        except SpecError as err:
            raise ApiError(400, str(err), "response_format", "invalid_value") from None
    lark = tool_grammar(pair.tokenizer, pair.vocab_size, req)
    if lark is not None:
        try:
            constraint = constraint_for(pair, grammar=lark)
        except SpecError as err:
            message = f"the tools cannot constrain the call: {err}"
            raise ApiError(400, message, "tools", "invalid_value") from None
    processors = make_processors(**req.penalties)
    return req.generation.replace(processors=processors, grammar=constraint)


def request_system_end(pair, req: GenRequest, tokens: list[int]) -> int | None:
    """Where the system prompt and tools end in `tokens` (made with the ids when the
    HTTP side made them)."""
    if req.prompt_ids is not None and req.prompt_pair is pair:
        return req.prompt_system_end
    return system_end(pair, req, tokens)
