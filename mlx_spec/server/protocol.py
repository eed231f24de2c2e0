"""The OpenAI wire format: request validation, response and chunk bodies, errors.

Every known parameter is honoured or refused with one 400 in OpenAI's error format. Fields this
server does not know (clients such as Open WebUI and LiteLLM add their own) are ignored and
named in the response's `X-Ignored-Fields` header; `user` never affects generation.

Over 600 lines: every field of chat completions and completions is validated here, in one
place; the agent protocols (issue 44) bring one internal request with a module per protocol.
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field

from ..core.sampling import SEED_LIMIT
from ..decode.config import GenerationConfig

MAX_STOP_CHARS = 1024  # a stop string is held back while it may be starting: keep that short
MAX_STOPS_TOTAL = 16384  # characters over all stop strings (any number of them within this)
MAX_TOP_LOGPROBS = 20  # as OpenAI
MAX_LOGIT_BIAS = 1024  # entries
PENALTY_CONTEXT_MAX = 1 << 16


# apply_chat_template's own parameters: a client must not pass them as template variables
def template_parameters() -> set[str]:
    """The named parameters of the installed transformers' apply_chat_template and of the
    function that renders it (`sanitize_control_tokens`, `conversations`, ...): a template
    variable of one of these names would collide with the call ("multiple values")."""
    names = {"self"}
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.utils import chat_template_utils

        functions = [PreTrainedTokenizerBase.apply_chat_template]
        functions += [getattr(chat_template_utils, "render_jinja_template", None)]
        for f in functions:
            if f is not None:
                names |= set(inspect.signature(f).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    return {n for n in names if not n.startswith("*")}


TEMPLATE_ARGUMENTS = {
    "messages",  # the name the template itself renders the conversation under
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    # the template's functions (jinja's and transformers' globals): a string in their place
    # makes the template fail with a TypeError
    "range",
    "dict",
    "lipsum",
    "cycler",
    "joiner",
    "namespace",
    "raise_exception",
    "strftime_now",
}
TEMPLATE_ARGUMENTS |= template_parameters()  # whatever else this transformers names
TEMPLATE_VALUE = str | int | float | bool | type(None)
MAX_TEMPLATE_STRING = 256
ROLES = {"system", "developer", "user", "assistant", "tool"}
MESSAGE_FIELDS = {
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
    "refusal",
}


@dataclass
class Limits:
    max_tokens: int | None = None  # a cap on what a request gets (None: the context bounds it)
    default_max_tokens: int = 512  # when it asks for nothing
    keep_attribution: bool = False  # keep Claude Code's per-request billing block in prompts


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        403: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        408: "timeout",
        413: "invalid_request_error",
        415: "invalid_request_error",
        429: "requests",
        503: "server_error",
        504: "timeout",
    }

    def __init__(self, status: int, message: str, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        if status in (401, 403):  # a wrong key stays wrong: Claude Code retried a 401 8 times
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class GenRequest:
    kind: str  # "chat" or "completion"
    model: str
    prompt: object  # messages, text or token ids (prompts.encode_prompt takes all three)
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict | None = None
    # penalties and bias, for processors.make_processors (applied to target and draft alike)
    penalties: dict = field(default_factory=dict)
    logprobs: int | None = None  # None: off; N: each token's log-probability and the top N
    tools: list | None = None  # chat: function tools, for the chat template and the parser
    tool_choice: object = "auto"  # "none", "auto", "required" or {"type", "function": {name}}
    ignored: list[str] = field(default_factory=list)  # unknown fields, named in a header
    partition: str = ""  # whose history and prompt cache (set from the API key by the app)
    constraint: dict | None = None  # response_format as engine keywords: {"schema": {...}}
    parse_special: bool = False  # chat text may hold special tokens (--parse-special-in-content)
    continue_final: bool = False  # the final assistant turn goes on (Messages: a prefill)
    prompt_ids: list[int] | None = field(default=None, repr=False)  # tokenised off the engine
    prompt_pair: object = field(default=None, repr=False, compare=False)  # ... for this pair
    prompt_system_end: int | None = field(default=None, repr=False)  # prompts.system_end

    @property
    def generation(self) -> GenerationConfig:
        """What the engine is asked (the prompt's template arguments are applied before)."""
        return GenerationConfig(
            self.max_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            seed=self.seed,
            logprobs=self.logprobs,
        )


COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "user",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "presence_context_size",
    "frequency_context_size",
    "repetition_context_size",
    "logit_bias",
    "logprobs",
    "response_format",
}
CHAT_KEYS = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "chat_template_kwargs",
}
COMPLETION_KEYS = COMMON | {"prompt", "echo", "best_of", "suffix"}

# parameters accepted only at the value that changes nothing: anything else is not implemented
NO_OP = {
    "n": (1,),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
NOT_IMPLEMENTED = {
    "n": "n > 1 is not supported: one completion per request",
    "functions": "the legacy functions parameter is not supported: send tools",
    "function_call": "the legacy function_call parameter is not supported: send tool_choice",
    "parallel_tool_calls": "parallel_tool_calls must be a boolean",
    "echo": "echo is not implemented",
    "best_of": "best_of > 1 is not supported",
    "suffix": "suffix is not implemented",
}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code or "invalid_value")


def number(data: dict, name: str, default: float, lo: float, hi: float, open_lo=False) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"{name} must be a number, got {value!r}", name, "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every bound below
        raise bad(f"{name} must be finite, got {value}", name)
    if value < lo or value > hi or (open_lo and value == lo):
        left = "(" if open_lo else "["
        raise bad(f"{name} must be in {left}{lo}, {hi}], got {value}", name)
    return float(value)


def integer(data: dict, name: str, default, lo: int, hi: int):
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {value!r}", name, "invalid_type")
    if not lo <= value <= hi:
        raise bad(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def check_keys(data: dict, allowed: set[str]) -> list[str]:
    """The unknown fields (ignored); a 400 for a known one at a value not implemented."""
    for name, values in NO_OP.items():
        value = data.get(name)
        # types must match too: True == 1, but logprobs=True is not n=1
        if value is not None and not any(value == v and type(value) is type(v) for v in values):
            raise bad(NOT_IMPLEMENTED[name], name, "unsupported_parameter")
    return sorted(k for k in set(data) - allowed if isinstance(k, str))


def stops(data: dict) -> list[str]:
    value = data.get("stop")
    if value is None:
        return []
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("stop must be a non-empty string or a list of them", "stop", "invalid_type")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    if sum(map(len, value)) > MAX_STOPS_TOTAL:
        raise bad(f"the stop strings may have at most {MAX_STOPS_TOTAL} characters in all", "stop")
    return list(dict.fromkeys(value))


def penalties(data: dict) -> dict:
    """Penalties and logit_bias as processors.make_processors' keyword arguments."""
    out: dict = {}
    for name, lo in (("presence_penalty", -2.0), ("frequency_penalty", -2.0)):
        value = number(data, name, 0.0, lo, 2.0)
        if value:
            out[name] = value
    value = number(data, "repetition_penalty", 0.0, 0.0, 10.0)
    if value and value != 1.0:
        out["repetition_penalty"] = value
    for name in ("presence", "frequency", "repetition"):
        size = integer(data, f"{name}_context_size", None, 0, PENALTY_CONTEXT_MAX)
        if size is not None:
            out[f"{name}_context"] = size
    bias = data.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad("logit_bias must map token ids to numbers", "logit_bias", "invalid_type")
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", "logit_bias")
        parsed = {}
        for k, v in bias.items():
            try:
                token = int(k)
            except (TypeError, ValueError):
                token = -1
            # (below 2**31: MLX's int32 ids; the vocabulary bound is checked with the pair)
            if token < 0 or token >= 2**31 or str(token) != str(k).strip():
                raise bad(f"logit_bias keys must be token ids, got {k!r}", "logit_bias")
            if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
                # (NaN fails the range test too: every comparison with it is false)
                raise bad(
                    f"logit_bias values must be numbers in [-100, 100], got {v!r}", "logit_bias"
                )
            parsed[token] = float(v)
        if parsed:
            out["logit_bias"] = parsed
    return out


JSON_OBJECT_SCHEMA = {"type": "object"}  # json_object: any JSON object


def response_format(data: dict) -> dict | None:
    """OpenAI's response_format -> {"schema": ...} for the engine (None: plain text).
    json_object: any JSON object; json_schema: {"name", "schema", "strict", "description"},
    the schema enforced exactly whether strict is true or not."""
    value = data.get("response_format")
    if value is None:
        return None
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("response_format must be an object with a type", param, "invalid_type")
    kind = value["type"]
    if kind == "text":
        extra = sorted(set(value) - {"type"})
    elif kind == "json_object":
        extra = sorted(set(value) - {"type"})
    elif kind == "json_schema":
        extra = sorted(set(value) - {"type", "json_schema"})
    else:
        raise bad(
            f"response_format type must be text, json_object or json_schema, got {kind!r}",
            f"{param}.type",
        )
    if extra:
        raise bad(f"unsupported response_format field {extra[0]!r}", f"{param}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"schema": JSON_OBJECT_SCHEMA}
    spec = value.get("json_schema")
    param = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise bad("json_schema must be an object with a schema", param, "invalid_type")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad(f"unsupported json_schema field {extra[0]!r}", f"{param}.{extra[0]}")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise bad("json_schema.name must be a string", f"{param}.name", "invalid_type")
    if spec.get("strict") not in (None, True, False):
        raise bad("json_schema.strict must be a boolean", f"{param}.strict", "invalid_type")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad("json_schema.schema must be a JSON Schema object", f"{param}.schema")
    return {"schema": schema}


def common(data: dict, kind: str, prompt, limits: Limits, max_tokens) -> GenRequest:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must be a pair name (see /v1/models)", "model", "invalid_type")
    stream = data.get("stream")
    if stream not in (None, True, False):
        raise bad("stream must be a boolean", "stream", "invalid_type")
    options = data.get("stream_options")
    if options is not None and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or options.get("include_usage") not in (None, True, False)
    ):
        raise bad("stream_options takes include_usage: a boolean", "stream_options")
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise bad(f"max_tokens must be an integer, got {max_tokens!r}", "max_tokens")
    elif max_tokens < 1:
        raise bad(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    elif limits.max_tokens is not None and max_tokens > limits.max_tokens:
        # Clamped, not refused: Claude Code always asks 32000, and a 400 here leaves it unable
        # to work at all; the reply ends with finish_reason "length" if it reaches the cap.
        max_tokens = limits.max_tokens
    constraint = response_format(data)
    if constraint is not None and data.get("stop"):
        raise bad(
            "stop cannot be combined with a JSON response_format: a stop string could cut the "
            "JSON short",
            "stop",
        )
    return GenRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=number(data, "temperature", 1.0, 0.0, 2.0),
        top_p=number(data, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        top_k=integer(data, "top_k", 0, 0, 2**31 - 1),
        min_p=number(data, "min_p", 0.0, 0.0, 1.0),
        seed=integer(data, "seed", None, 0, SEED_LIMIT - 1),
        stop=stops(data),
        stream=bool(stream),
        include_usage=bool(options and options.get("include_usage")),
        penalties=penalties(data),
        constraint=constraint,
    )


def message_text(content, i: int, optional: bool = False) -> str:
    """A message's content: a string or a list of text parts (images are not supported).
    `optional`: null is allowed (an assistant message that only calls tools)."""
    if content is None and optional:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad("only text content parts are supported", f"messages[{i}].content")
            if not isinstance(part.get("text"), str):
                raise bad("a text part needs text: a string", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad("content must be a string or a list of text parts", f"messages[{i}].content")


def tool_calls_of(calls, i: int) -> list[dict]:
    """An assistant message's tool_calls, with `arguments` decoded from their JSON string as
    chat templates expect (mlx-lm's server does the same)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad("tool_calls must be a list", where, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("each tool call needs function: {name, arguments}", f"{where}[{j}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad("function.arguments must be a JSON string", f"{where}[{j}]") from None
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def parse_messages(messages, ignored: set | None = None) -> list[dict]:
    """The messages for the chat template. Fields of a message this server does not know (an
    SDK's message object sent back carries `audio`, `annotations`, ...) are left out and
    named in `ignored`."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad("each message must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if m.get("function_call") is not None:
            raise bad("function_call messages are not supported: send tool_calls", f"messages[{i}]")
        if role not in ROLES:
            raise bad(f"unsupported role {role!r}", f"messages[{i}].role")
        if ignored is not None:
            ignored.update(f"messages.{k}" for k in set(m) - MESSAGE_FIELDS - {"function_call"})
        if m.get("tool_calls") and role != "assistant":
            raise bad("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        # developer is OpenAI's newer name for system; chat templates know only system
        role = "system" if role == "developer" else role
        calls = m.get("tool_calls")
        entry = {"role": role, "content": message_text(m.get("content"), i, role == "assistant")}
        if calls:
            entry["tool_calls"] = tool_calls_of(calls, i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise bad("tool_call_id must be a string", f"messages[{i}].tool_call_id")
            if call_id is not None:
                entry["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            entry["name"] = m["name"]
        thought = m.get("reasoning_content", m.get("reasoning"))
        if role == "assistant" and isinstance(thought, str) and thought:
            entry["reasoning_content"] = thought  # the name Qwen3's and DeepSeek's templates read
        out.append(entry)
    return out


def parse_tools(data: dict) -> tuple[list | None, object]:
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list of function tools", "tools", "invalid_type")
        for j, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if (
                not isinstance(tool, dict)
                or tool.get("type", "function") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not fn["name"]
            ):
                raise bad(
                    "each tool must be {type: function, function: {name, parameters}}",
                    f"tools[{j}]",
                )
            if "parameters" in fn and not isinstance(fn["parameters"], dict):
                raise bad("function.parameters must be a JSON schema object", f"tools[{j}]")
        tools = tools or None
    choice = data.get("tool_choice")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise bad("tool_choice must be none, auto, required or a named function", "tool_choice")
        names = [t["function"]["name"] for t in tools or []]
        if fn["name"] not in names:
            raise bad(f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
        choice = {"type": "function", "function": {"name": fn["name"]}}
    elif choice not in ("none", "auto", "required"):
        raise bad("tool_choice must be none, auto, required or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise bad("tool_choice required needs tools", "tool_choice")
    return tools, choice


def chat_logprobs(data: dict) -> int | None:
    want = data.get("logprobs")
    if want not in (None, True, False):
        raise bad("logprobs must be a boolean", "logprobs", "invalid_type")
    top = integer(data, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if want else None


def parse_chat(data: dict, limits: Limits) -> GenRequest:
    ignored = check_keys(data, CHAT_KEYS)
    in_messages: set[str] = set()
    messages = parse_messages(data.get("messages"), in_messages)
    max_tokens = data.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    req = common(data, "chat", messages, limits, max_tokens)
    kwargs = data.get("chat_template_kwargs")
    if kwargs is not None and not (
        isinstance(kwargs, dict)
        and all(k.isidentifier() and k not in TEMPLATE_ARGUMENTS for k in kwargs)
        and all(isinstance(v, TEMPLATE_VALUE) for v in kwargs.values())
        and all(len(v) <= MAX_TEMPLATE_STRING for v in kwargs.values() if isinstance(v, str))
    ):
        # variables for the model's own template (e.g. enable_thinking), never a template of
        # the client's or an argument of apply_chat_template itself
        raise bad(
            "chat_template_kwargs must map variable names to short strings, numbers or booleans",
            "chat_template_kwargs",
        )
    req.chat_template_kwargs = kwargs
    req.tools, req.tool_choice = parse_tools(data)
    if req.constraint is not None and req.tools and req.tool_choice not in ("none", "auto"):
        # the call follows the tools' own schemas (server/output.py tool_grammar)
        which = "tool_choice required" if req.tool_choice == "required" else "a named tool_choice"
        raise bad(f"response_format cannot be combined with {which}", "response_format")
    req.logprobs = chat_logprobs(data)
    req.ignored = ignored + sorted(n for n in in_messages if isinstance(n, str))
    return req


def parse_completion(data: dict, limits: Limits) -> GenRequest:
    ignored = check_keys(data, COMPLETION_KEYS)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad(
                "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
            )
    elif not isinstance(prompt, str) or not prompt:
        raise bad("prompt must be a non-empty string or a list of token ids", "prompt")
    req = common(data, "completion", prompt, limits, data.get("max_tokens"))
    want = data.get("logprobs")
    if want is not None and (isinstance(want, bool) or not isinstance(want, int)):
        raise bad("logprobs must be an integer (how many top tokens) or null", "logprobs")
    if want is not None and not 0 <= want <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {want}", "logprobs")
    req.logprobs = want
    req.ignored = ignored
    return req


# ----------------------------------------------------------------------------- responses


def usage(stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_tokens_reused},
    }


def speculation(stats, drafter: str, history: bool) -> dict:
    """The extension object: what speculation did for this response."""
    return {
        "drafter": drafter,
        "history_lookup": history,
        "num_draft_tokens": stats.num_draft_tokens,  # k (the largest k when adaptive)
        "adaptive": stats.adaptive,
        "mean_draft_length": round(stats.mean_draft_length, 3),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "tokens_per_target_pass": round(stats.tokens_per_target_pass, 4),
        "target_passes": stats.target_passes,
        "prompt_tokens_reused": stats.prompt_tokens_reused,
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "forced_tokens": stats.forced_tokens,  # drafted by the response_format's grammar
    }


def choice(req: GenRequest, text: str | None, finish: str | None, first=False, full=False):
    """One choice of a response (full) or of a streamed chunk."""
    out: dict = {"index": 0}
    if req.kind == "chat":
        if full:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["delta"] = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                out["delta"]["content"] = text
    else:
        out["text"] = text or ""
    out["logprobs"] = None
    out["finish_reason"] = finish
    return out


def envelope(req: GenRequest, rid: str, created: int, chunk: bool) -> dict:
    kind = {
        ("chat", False): "chat.completion",
        ("chat", True): "chat.completion.chunk",
        ("completion", False): "text_completion",
        ("completion", True): "text_completion",
    }[req.kind, chunk]
    return {"id": rid, "object": kind, "created": created, "model": req.model}
