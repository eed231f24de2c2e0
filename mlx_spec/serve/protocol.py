"""The OpenAI wire format: request validation, response and chunk bodies, errors.

Every parameter is either honoured or refused with a 400 in OpenAI's error format; none is
silently ignored (except `user`, an end-user id that never affects generation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEED_LIMIT = 2**64
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # a stop string is held back while it may be starting: keep that short
# apply_chat_template's own parameters: a client must not pass them as template variables
TEMPLATE_ARGUMENTS = {
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
}
TEMPLATE_VALUE = str | int | float | bool | type(None)
MAX_TEMPLATE_STRING = 256
ROLES = {"system", "developer", "user", "assistant"}


@dataclass
class Limits:
    max_tokens: int = 8192  # the most a request may ask for
    default_max_tokens: int = 512  # when it asks for nothing


class ApiError(Exception):
    """An HTTP error with OpenAI's body: {"error": {message, type, param, code}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        429: "requests",
        503: "server_error",
        504: "timeout",
    }

    def __init__(self, status: int, message: str, param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


@dataclass
class GenRequest:
    kind: str  # "chat" or "completion"
    model: str
    prompt: object  # messages, text or token ids (engine.encode_prompt takes all three)
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
    constraint: dict | None = None  # response_format as engine keywords: {"schema": {...}}


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
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
NOT_IMPLEMENTED = {
    "n": "n > 1 is not supported: one completion per request",
    "logprobs": "logprobs are not implemented",
    "top_logprobs": "logprobs are not implemented",
    "tools": "tools (function calling) are not implemented",
    "functions": "function calling is not implemented",
    "tool_choice": "tools (function calling) are not implemented",
    "function_call": "function calling is not implemented",
    "parallel_tool_calls": "parallel_tool_calls must be a boolean",
    "logit_bias": "logit_bias is not implemented",
    "presence_penalty": "presence_penalty is not implemented",
    "frequency_penalty": "frequency_penalty is not implemented",
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


def check_keys(data: dict, allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown")
    for name, values in NO_OP.items():
        value = data.get(name)
        # types must match too: True == 1, but logprobs=True is not n=1
        if value is not None and not any(value == v and type(value) is type(v) for v in values):
            raise bad(NOT_IMPLEMENTED[name], name, "unsupported_parameter")


def stops(data: dict) -> list[str]:
    value = data.get("stop")
    if value is None:
        return []
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("stop must be a non-empty string or a list of them", "stop", "invalid_type")
    if len(value) > MAX_STOPS:
        raise bad(f"stop takes at most {MAX_STOPS} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    return value


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
    elif not 1 <= max_tokens <= limits.max_tokens:
        raise bad(
            f"max_tokens must be in [1, {limits.max_tokens}] on this server, got {max_tokens}",
            "max_tokens",
        )
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
        constraint=constraint,
    )


def message_text(content, i: int) -> str:
    """A message's content: a string or a list of text parts (images are not supported)."""
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


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad("each message must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role == "tool" or "tool_calls" in m or "function_call" in m:
            raise bad("tools (function calling) are not implemented", f"messages[{i}]")
        if role not in ROLES:
            raise bad(f"unsupported role {role!r}", f"messages[{i}].role")
        if set(m) - {"role", "content", "name"}:
            extra = sorted(set(m) - {"role", "content", "name"})[0]
            raise bad(f"unsupported message field {extra!r}", f"messages[{i}].{extra}")
        # developer is OpenAI's newer name for system; chat templates know only system
        role = "system" if role == "developer" else role
        out.append({"role": role, "content": message_text(m.get("content"), i)})
    return out


def parse_chat(data: dict, limits: Limits) -> GenRequest:
    check_keys(data, CHAT_KEYS)
    messages = parse_messages(data.get("messages"))
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
    return req


def parse_completion(data: dict, limits: Limits) -> GenRequest:
    check_keys(data, COMPLETION_KEYS)
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
    return common(data, "completion", prompt, limits, data.get("max_tokens"))


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
