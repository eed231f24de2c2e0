"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): a thin
translation onto the one internal request, and its wire format.

A Messages body is rewritten as a chat completions body (system and messages, tools,
tool_choice, stop_sequences, sampling, the thinking switch) and validated by protocol.py's
`parse_chat`, so the same template rendering, speculation, grammar, tool parser (output.py)
and stop strings serve it; `MessagesEncoder` writes the job's items as a Message or as the
event stream the `anthropic` SDK reads. Errors have Anthropic's shape.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse, Response

from .output import Delta
from .protocol import ApiError, GenRequest, Limits, bad, parse_chat
from .streaming import KEEPALIVE, Encoder, sse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# what the body may hold besides the conversation (metadata and the rest: accepted, unused)
KNOWN = {
    "model",
    "max_tokens",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "stream",
    "thinking",
    "metadata",
    "service_tier",
    "cache_control",
    "output_config",
}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def error_body(err: ApiError) -> dict:
    kind = ERROR_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    message = err.message
    counts = getattr(err, "prompt_tokens", None), getattr(err, "context", None)
    if err.code == "context_length_exceeded" and None not in counts:
        message = "prompt is too long: {} tokens > {} maximum".format(*counts)  # (the words
        # Claude Code compacts its conversation on)
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(err: ApiError) -> Response:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def text_of(blocks, where: str) -> str:
    """A string, or text blocks joined (cache_control and citations ignored)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad("must be a string or a list of text blocks", where, "invalid_type")
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad("only text blocks are supported here", f"{where}[{j}]")
        out.append(b["text"])
    return "".join(out)


ATTRIBUTION = "x-anthropic-billing-header:"  # Claude Code's first system block; its hex
# suffix changes with every prompt, so kept it would end the prompt cache's match 25 tokens in


def system_text(system, keep_attribution: bool) -> str:
    """The system prompt, less Claude Code's per-request attribution block (a text block, or
    a string's first line, that starts with x-anthropic-billing-header:) unless kept."""
    if keep_attribution:
        return text_of(system, "system")
    if isinstance(system, str):
        first, _, rest = system.partition("\n")
        return rest if first.startswith(ATTRIBUTION) else system
    if isinstance(system, list):
        system = [
            b
            for b in system
            if not (isinstance(b, dict) and str(b.get("text", "")).startswith(ATTRIBUTION))
        ]
    return text_of(system, "system")


def refuse_block(kind, where: str) -> ApiError:
    if kind in ("image", "document"):
        return bad(f"{kind} blocks are not supported: this server serves text models", where)
    return bad(f"content blocks of type {kind!r} are not supported", where)


def user_turn(content, i: int) -> list[dict]:
    """A user message: its tool_result blocks become tool messages (first, as the API
    orders them), its text one user message."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad("content must be a string or a list of blocks", where, "invalid_type")
    tools, texts = [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            call_id = b.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad("a tool_result needs tool_use_id: a string", f"{where}[{j}]")
            result = b.get("content", "")
            text = text_of(result, f"{where}[{j}].content") if result is not None else ""
            if b.get("is_error") is True:
                text = f"Error: {text}" if text else "Error"
            tools.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise refuse_block(kind, f"{where}[{j}]")
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def assistant_turn(content, i: int) -> dict:
    """An assistant message: text, tool_use blocks as tool_calls, thinking as the reasoning
    the template may show (redacted thinking dropped)."""
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad("content must be a string or a list of blocks", where, "invalid_type")
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad("a tool_use needs name and input: an object", f"{where}[{j}]")
            call = {"type": "function", "function": {"name": b["name"]}}
            call["function"]["arguments"] = json.dumps(b.get("input", {}), ensure_ascii=False)
            if isinstance(b.get("id"), str):
                call["id"] = b["id"]
            calls.append(call)
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thoughts.append(b["thinking"])
        elif kind != "redacted_thinking":
            raise refuse_block(kind, f"{where}[{j}]")
    out: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thoughts:
        out["reasoning_content"] = "".join(thoughts)
    return out


def tools_of(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools", "invalid_type")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"only client tools are supported, not {kind!r}", f"tools[{j}]")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad("each tool needs a name", f"tools[{j}].name")
        schema = t.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad("input_schema must be a JSON schema object", f"tools[{j}].input_schema")
        if schema.get("type", "object") != "object":  # (Anthropic's rule: a tool's input is
            # an object; a null, list or number had no tool_use input the stream could say)
            raise bad("input_schema must have type object", f"tools[{j}].input_schema.type")
        fn = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(choice):
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad("tool_choice must be {type: auto | any | none} or {type: tool, name}", "tool_choice")


def thinking_switch(thinking) -> dict | None:
    """`thinking` -> the chat template's enable_thinking (templates without it ignore it)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise bad("thinking must be {type: enabled | adaptive | disabled}", "thinking")
    return {"enable_thinking": kind != "disabled"}


def output_format(config) -> dict | None:
    """`output_config.format` (a JSON schema the reply follows) as chat's response_format;
    its effort is not used."""
    if config is None:
        return None
    fmt = config.get("format") if isinstance(config, dict) else "?"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad("output_config.format must be {type: json_schema, schema}", "output_config")
    return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}


def parse_messages(data: dict, limits: Limits, counting: bool = False) -> GenRequest:
    """A Messages body -> the internal request (`counting`: count_tokens, no max_tokens)."""
    if not counting and data.get("max_tokens") is None:
        raise bad("max_tokens is required", "max_tokens")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    chat: list[dict] = []
    system = data.get("system")
    if system is not None:
        text = system_text(system, limits.keep_attribution)
        if text:
            chat.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            chat += user_turn(m.get("content"), i)
        elif role == "assistant":
            chat.append(assistant_turn(m.get("content"), i))
        elif role == "system":  # Claude Code sends system turns mid-conversation
            text = text_of(m.get("content"), f"messages[{i}].content")
            chat.append({"role": "system", "content": text})
        else:
            raise bad("each message needs role: user, assistant or system", f"messages[{i}].role")
    body = {
        "model": data.get("model"),
        "messages": chat,
        "max_tokens": 1 if counting else data.get("max_tokens"),
        "stream": False if counting else data.get("stream"),
        "tools": tools_of(data.get("tools")),
        "tool_choice": tool_choice_of(data.get("tool_choice")),
        "chat_template_kwargs": thinking_switch(data.get("thinking")),
        "response_format": output_format(data.get("output_config")),
    }
    for name in ("temperature", "top_p", "top_k"):
        body[name] = data.get(name)
    stops = data.get("stop_sequences")
    if stops is not None and not isinstance(stops, list):
        raise bad("stop_sequences must be a list of strings", "stop_sequences", "invalid_type")
    body["stop"] = stops or None
    req = parse_chat({k: v for k, v in body.items() if v is not None}, limits)
    req.ignored = sorted(k for k in set(data) - KNOWN if isinstance(k, str))
    req.continue_final = prefilled(chat, len(messages) - 1)
    if req.continue_final and (req.constraint or req.tool_choice not in ("auto", "none")):
        # (the grammar would start again after the prefill, a forced call's start after it)
        raise bad(
            "a final assistant turn cannot be continued under a forced tool_choice or "
            "output_config.format", "messages",
        )  # fmt: skip
    return req


def prefilled(chat: list[dict], last: int) -> bool:
    """Whether the conversation ends with an assistant's text, which the reply continues
    (Anthropic's prefill: the response holds only what follows it); as Anthropic, refused
    when that text ends in whitespace (a model continues a word, not a space)."""
    final = chat[-1]
    if final["role"] != "assistant" or final.get("tool_calls") or not final["content"]:
        return False
    if final["content"] != final["content"].rstrip():
        raise bad(
            "final assistant content cannot end with trailing whitespace",
            f"messages[{last}].content",
        )
    return True


def stop_reason(outcome) -> str:
    if outcome.finish_reason == "stop" and outcome.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(outcome.finish_reason, "end_turn")


def stop_fields(outcome) -> dict:
    """stop_reason, and stop_sequence only when it is what stopped the reply (a stop string
    that ends a tool call stops it with reason tool_use: stop_sequence is null then)."""
    reason = stop_reason(outcome)
    return {
        "stop_reason": reason,
        "stop_sequence": outcome.stop_sequence if reason == "stop_sequence" else None,
    }


def usage(u: dict) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the prompt cache."""
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": u["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_block(call: dict) -> dict:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except ValueError:
        args = {}
    if not isinstance(args, dict):
        args = {"value": args}
    return {"type": "tool_use", "id": tool_id(call["id"]), "name": fn["name"], "input": args}


class MessagesEncoder(Encoder):
    """Anthropic's Message body, or its stream: message_start, a content block per run of
    thinking, text or a tool call (start, deltas, stop), message_delta, message_stop; pings
    while the job waits."""

    def __init__(self, req: GenRequest, job_id: str):
        super().__init__(req, job_id)
        self.rid = "msg_" + job_id
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.opened = False  # message_start went out

    def error_response(self, err: ApiError) -> Response:
        return error_response(err)

    # message_start goes out with the first text, when the prefill has said how much of the
    # prompt came from the cache (it said 0 before, and message_delta disagreed); until then
    # a waiting stream gets SSE comments, which every client skips
    opens_late = True

    def keepalive(self) -> dict:
        return sse({"type": "ping"}, "ping") if self.opened else KEEPALIVE

    def event(self, data: dict) -> dict:
        return sse(data, data["type"])

    def opening(self, prompt: tuple[int, int] | None = None) -> list[dict]:
        self.opened = True
        n, cached = prompt or (len(self.req.prompt_ids or ()), 0)
        message = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": n - cached,
                "output_tokens": 0,
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
            },
        }
        return [self.event({"type": "message_start", "message": message})]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [self.event({"type": "content_block_stop", "index": self.index})]

    def block(self, kind: str, start: dict) -> list[dict]:
        out = self.close()
        self.index += 1
        self.open = kind
        data = {"type": "content_block_start", "index": self.index, "content_block": start}
        return [*out, self.event(data)]

    def block_delta(self, delta: dict) -> dict:
        return self.event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, d: Delta) -> list[dict]:
        out = []
        if d.reasoning:
            if self.open != "thinking":
                out += self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.block_delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.open != "text":
                out += self.block("text", {"type": "text", "text": ""})
            out.append(self.block_delta({"type": "text_delta", "text": d.content}))
        for call in d.tool_calls:
            block = tool_block(call)  # its input as the whole body says it: an object
            out += self.block("tool_use", {**block, "input": {}})
            args = json.dumps(block["input"], ensure_ascii=False)
            out.append(self.block_delta({"type": "input_json_delta", "partial_json": args}))
            out += self.close()
        return out

    def done(self, outcome) -> list[dict]:
        delta = stop_fields(outcome)
        tail = {"type": "message_delta", "delta": delta, "usage": usage(outcome.usage)}
        tail["speculation"] = outcome.speculation
        return [*self.close(), self.event(tail), self.event({"type": "message_stop"})]

    def failed(self, err: ApiError) -> list[dict]:
        return [sse(error_body(err), "error")]

    def body(self, d: Delta, outcome) -> dict:
        content = []
        if d.reasoning:
            content.append({"type": "thinking", "thinking": d.reasoning, "signature": ""})
        if d.content:
            content.append({"type": "text", "text": d.content})
        content += [tool_block(c) for c in d.tool_calls]
        return {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": content,
            **stop_fields(outcome),
            "usage": usage(outcome.usage),
            "speculation": outcome.speculation,
        }
