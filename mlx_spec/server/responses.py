"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`): a thin translation
onto the one internal request, its wire format, and the stored responses.

The input items (messages, function calls and their outputs, reasoning) become chat messages,
`instructions` a system message, function tools chat tools, `text.format` a response_format,
`reasoning.effort` the template's enable_thinking; protocol.py's `parse_chat` validates the
result, so the same rendering, speculation, grammar, tool parser (output.py) and stop strings
serve it. `ResponsesEncoder` writes the job's items as a Response object or as the event
stream the `openai` SDK reads. A stored response (store: true, the default) keeps its whole
conversation, its input and its output, for a later `previous_response_id`: per partition
(API key), never visible to another, least recently used dropped first past a count and a
size in bytes (all keys together; one key holds at most a quarter, its own oldest going first).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict

from .output import Delta
from .protocol import ApiError, GenRequest, Limits, bad, parse_chat
from .streaming import Encoder, sse

MAX_STORED = 256
PER_KEY_SHARE = 4  # one key holds at most a quarter of the store
MAX_STORED_BYTES = 64 << 20
# accepted; those not listed here are named in X-Ignored-Fields
KNOWN = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "reasoning",
    "stream",
    "previous_response_id",
    "store",
    "prompt_cache_key",
    "parallel_tool_calls",
    "include",
    "user",
    "metadata",
    "truncation",
    "service_tier",
    "safety_identifier",
    "stream_options",
}
UNSUPPORTED = {  # accepted only when absent (or at the value that changes nothing)
    "background": "background responses are not supported",
    "conversation": "conversations are not supported: send previous_response_id",
    "prompt": "prompt templates are not supported",
}
TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponseStore:
    """Stored responses by (partition, id): their conversation and the Response object."""

    def __init__(self, max_items: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.entries: OrderedDict = OrderedDict()  # (partition, id) -> (entry, bytes)
        self.bytes = 0

    def get(self, partition: str, rid) -> dict | None:
        key = (partition, rid)
        if not isinstance(rid, str) or key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key][0]

    def put(self, partition: str, rid: str, entry: dict) -> None:
        # parsed JSON takes a few times its text in memory: count it at 3x
        size = 3 * len(json.dumps(entry, ensure_ascii=False).encode())
        if size > self.max_bytes // PER_KEY_SHARE:
            return
        self.entries[(partition, rid)] = (entry, size)
        self.bytes += size
        # one key's own oldest first once it holds its share, so that a key storing many
        # responses cannot push every other key's conversations out
        mine = [k for k in self.entries if k[0] == partition]
        while len(mine) > self.max_items // PER_KEY_SHARE or self.mine_bytes(mine) > (
            self.max_bytes // PER_KEY_SHARE
        ):
            self.bytes -= self.entries.pop(mine.pop(0))[1]
        while len(self.entries) > self.max_items or self.bytes > self.max_bytes:
            _, (_, dropped) = self.entries.popitem(last=False)
            self.bytes -= dropped

    def mine_bytes(self, keys: list) -> int:
        return sum(self.entries[k][1] for k in keys)


def not_found(rid, param: str = "previous_response_id") -> ApiError:
    """The 404 of an unknown response id: named by the field that carried it (the path's
    response_id for GET /v1/responses/{id})."""
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    message = f"No response with id {str(rid)[:64]!r} is stored for this API key"
    return ApiError(404, message, param, code)


def parts_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("content must be a string or a list of text parts", where, "invalid_type")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in TEXT_PARTS and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif kind != "refusal":
            message = f"content parts of type {kind!r} are not supported (text only)"
            raise bad(message, f"{where}[{j}]")
    return "".join(out)


def reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    for name, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name)
        if isinstance(parts, list):
            text = "".join(
                p["text"]
                for p in parts
                if isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
            )
            if text:
                return text
    return ""


def input_messages(items) -> list[dict]:
    """`input` as chat messages: a function call joins the assistant turn before it, its
    output is a tool message, a reasoning item is the next assistant turn's reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad("input must be a string or a list of items", "input", "invalid_type")
    out: list[dict] = []
    thought: list[str] = []

    def assistant(entry: dict) -> dict:
        if thought:
            entry["reasoning_content"] = "".join(thought)
            thought.clear()
        return entry

    for j, item in enumerate(items):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise bad("each input item must be an object", where, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"unsupported role {role!r}", f"{where}.role")
            entry = {"role": role, "content": parts_text(item.get("content"), f"{where}.content")}
            out.append(assistant(entry) if role == "assistant" else entry)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            call_id = item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad("a function_call needs name and arguments: strings", where)
            call = {"type": "function", "function": {"name": name, "arguments": args}}
            if isinstance(call_id, str):
                call["id"] = call_id
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not thought:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad("a function_call_output needs call_id: a string", where)
            text = parts_text(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            thought.append(reasoning_text(item))
        else:
            raise bad(f"input items of type {kind!r} are not supported", f"{where}.type")
    return out


def tools_of(tools, skipped: list[str]) -> list | None:
    """Function tools as chat tools. Tools of other types (hosted ones such as web_search,
    Codex's namespaces) are left out of the prompt and named in `skipped`: the model cannot
    call them here, and an agent that sends them would otherwise get nothing but a 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools", "invalid_type")
    out = []
    for j, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise bad("each tool needs a type", f"tools[{j}].type")
        if kind != "function":
            skipped.append(f"tools[{j}]:{kind[:32]}")
            continue
        fn = {"name": t.get("name"), "parameters": t.get("parameters") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice_of(choice):
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")


def format_of(text) -> dict | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if not isinstance(text, dict):
            raise bad("text must be an object", "text", "invalid_type")
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format must be an object with a type", "text.format", "invalid_type")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def thinking_switch(reasoning) -> dict | None:
    if reasoning is None:
        return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad("reasoning.effort must be none, minimal, low, medium or high", "reasoning")
    return {"enable_thinking": effort not in ("none", "minimal")}


def parse_responses(
    data: dict, limits: Limits, store: ResponseStore, partition: str
) -> tuple[GenRequest, list[dict]]:
    """A Responses body -> the internal request, and the conversation a stored response keeps
    (the previous response's, then this input; instructions are not carried over)."""
    for name, message in UNSUPPORTED.items():
        if data.get(name) not in (None, False):
            raise bad(message, name, "unsupported_parameter")
    if data.get("store") not in (None, True, False):
        raise bad("store must be a boolean", "store", "invalid_type")
    for name in ("user", "prompt_cache_key", "safety_identifier"):  # (echoed or ignored)
        if data.get(name) is not None and not isinstance(data[name], str):
            raise bad(f"{name} must be a string", name, "invalid_type")
    if not metadata_ok(data.get("metadata")):  # echoed in the response: OpenAI's limits
        raise bad(
            "metadata must be an object of at most 16 string values (keys up to 64 "
            "characters, values up to 512)", "metadata", "invalid_type",
        )  # fmt: skip
    conversation: list[dict] = []
    skipped: list[str] = []
    previous = data.get("previous_response_id")
    if previous is not None:
        entry = store.get(partition, previous)
        if entry is None:
            raise not_found(previous)
        conversation = list(entry["messages"])
    conversation += input_messages(data.get("input"))
    messages = list(conversation)
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions", "invalid_type")
        messages.insert(0, {"role": "system", "content": instructions})
    body = {
        "model": data.get("model"),
        "messages": messages,
        "max_tokens": data.get("max_output_tokens"),
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "stream": data.get("stream"),
        "tools": tools_of(data.get("tools"), skipped),
        "tool_choice": tool_choice_of(data.get("tool_choice")),
        "response_format": format_of(data.get("text")),
        "chat_template_kwargs": thinking_switch(data.get("reasoning")),
        "parallel_tool_calls": data.get("parallel_tool_calls"),
    }
    req = parse_chat({k: v for k, v in body.items() if v is not None}, limits)
    unknown = sorted(k for k in set(data) - KNOWN - set(UNSUPPORTED) if isinstance(k, str))
    req.ignored = unknown + skipped
    return req, conversation


def metadata_ok(metadata) -> bool:
    if metadata is None:
        return True
    return (
        isinstance(metadata, dict)
        and len(metadata) <= 16
        and all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    )


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesEncoder(Encoder):
    """A Response object, or its stream: response.created and .in_progress, each output item
    added, its content streamed and done, then response.completed (.incomplete, .failed);
    every event numbered. The finished response is stored (`store`)."""

    def __init__(
        self,
        req: GenRequest,
        job_id: str,
        data: dict,
        conversation: list[dict],
        store: ResponseStore | None,
        partition: str,
    ):
        super().__init__(req, job_id)
        self.rid = "resp_" + job_id
        self.data, self.conversation = data, conversation
        self.store, self.partition = store, partition
        self.seq = 0
        self.items: list[dict] = []  # the output so far
        self.open: str | None = None  # the last item's type while it is open

    # ------------------------------------------------------------------ the Response object

    def response(self, status: str, usage: dict | None = None, **extra) -> dict:
        d = self.data
        fmt = d.get("text", {}).get("format") if isinstance(d.get("text"), dict) else None
        reasoning = d.get("reasoning") if isinstance(d.get("reasoning"), dict) else {}
        out = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": d.get("instructions"),
            "max_output_tokens": self.req.max_tokens,
            "model": self.req.model,
            "output": [dict(i) for i in self.items],
            "parallel_tool_calls": d.get("parallel_tool_calls", True),
            "previous_response_id": d.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "store": d.get("store", True),
            "temperature": self.req.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": d.get("tool_choice") or "auto",
            "tools": d.get("tools") or [],
            "top_p": self.req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": d.get("user"),
            "metadata": d.get("metadata") or {},
            **extra,
        }
        return out

    def finished(self, outcome) -> dict:
        """The final Response (stored when asked)."""
        u = outcome.usage
        usage = {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }
        extra = {"speculation": outcome.speculation}
        if outcome.finish_reason == "length":
            extra["incomplete_details"] = {"reason": "max_output_tokens"}
            if self.items and self.items[-1]["type"] == "message":
                self.items[-1]["status"] = "incomplete"  # cut short
            body = self.response("incomplete", usage, **extra)
        else:
            body = self.response("completed", usage, **extra)
        if self.store is not None and self.data.get("store", True) is not False:
            messages = self.conversation + self.as_messages()
            self.store.put(self.partition, self.rid, {"messages": messages, "response": body})
        return body

    def as_messages(self) -> list[dict]:
        """This response's output as chat messages (for a later previous_response_id)."""
        entry: dict = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                entry["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                entry["content"] += item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                call = {"id": item["call_id"], "type": "function", "function": call}
                entry.setdefault("tool_calls", []).append(call)
        return [entry]

    # ------------------------------------------------------------------ events

    def event(self, data: dict) -> dict:
        data["sequence_number"] = self.seq
        self.seq += 1
        return sse(data, data["type"])

    def opening(self) -> list[dict]:
        return [
            self.event({"type": "response.created", "response": self.response("in_progress")}),
            self.event({"type": "response.in_progress", "response": self.response("in_progress")}),
        ]

    def where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def add(self, item: dict, part: dict | None) -> list[dict]:
        out = self.close()
        self.items.append(item)
        self.open = item["type"]
        index = len(self.items) - 1
        added = {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
        out.append(self.event(added))
        if part is not None:
            item["content"] = [dict(part)]
            data = {"type": "response.content_part.added", **self.where(), "content_index": 0}
            out.append(self.event({**data, "part": dict(part)}))
        return out

    def close(self) -> list[dict]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        item, at = self.items[-1], self.where()
        out = []
        if kind in ("message", "reasoning"):
            part = item["content"][0]
            name = "output_text" if kind == "message" else "reasoning_text"
            done = {"type": f"response.{name}.done", **at, "content_index": 0, "text": part["text"]}
            if kind == "message":
                done["logprobs"] = []
            out.append(self.event(done))
            data = {"type": "response.content_part.done", **at, "content_index": 0}
            out.append(self.event({**data, "part": dict(part)}))
        if item.get("status", "in_progress") == "in_progress":
            item["status"] = "completed"
        done = {"type": "response.output_item.done", "output_index": at["output_index"]}
        out.append(self.event({**done, "item": dict(item)}))
        return out

    def delta(self, d: Delta) -> list[dict]:
        out = []
        if d.reasoning:
            if self.open != "reasoning":
                item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": []}
                out += self.add(item, {"type": "reasoning_text", "text": ""})
            self.items[-1]["content"][0]["text"] += d.reasoning
            data = {"type": "response.reasoning_text.delta", **self.where(), "content_index": 0}
            out.append(self.event({**data, "delta": d.reasoning}))
        if d.content:
            if self.open != "message":
                item = {
                    "type": "message",
                    "id": new_id("msg_"),
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                }
                out += self.add(item, {"type": "output_text", "text": "", "annotations": []})
            self.items[-1]["content"][0]["text"] += d.content
            data = {"type": "response.output_text.delta", **self.where(), "content_index": 0}
            out.append(self.event({**data, "delta": d.content, "logprobs": []}))
        for call in d.tool_calls:
            fn = call["function"]
            item = {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": "",
                "status": "in_progress",
            }
            out += self.add(item, None)
            item["arguments"] = fn["arguments"]
            data = {"type": "response.function_call_arguments.delta", **self.where()}
            out.append(self.event({**data, "delta": fn["arguments"]}))
            data = {"type": "response.function_call_arguments.done", **self.where()}
            out.append(self.event({**data, "name": fn["name"], "arguments": fn["arguments"]}))
            out += self.close()
        return out

    def done(self, outcome) -> list[dict]:
        cut = outcome.finish_reason == "length" and self.open == "message"
        if cut:  # the item's own done event must say what the final response says
            self.items[-1]["status"] = "incomplete"
        out = self.close()
        body = self.finished(outcome)
        name = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*out, self.event({"type": name, "response": body})]

    def failed(self, err: ApiError) -> list[dict]:
        code = "rate_limit_exceeded" if err.status == 429 else "server_error"
        if self.open is not None:  # an item the failure cut: not completed
            self.items[-1]["status"] = "incomplete"
        out = self.close()
        body = self.response("failed", error={"code": code, "message": err.message})
        return [*out, self.event({"type": "response.failed", "response": body})]

    def body(self, d: Delta, outcome) -> dict:
        self.delta(d)  # the items, as a stream would build them
        self.close()
        return self.finished(outcome)
