"""What a reply's text becomes on the wire: content, reasoning apart, tool calls, logprobs.

The generated text (after stop strings) goes through mlx-lm's own `TextStateMachine`, built by
`make_text_state_machine` from what `TokenizerWrapper` inferred for the model (think markers,
tool-call markers), and tool-call text through the model's mlx-lm tool parser
(`TokenizerWrapper.tool_parser`). Nothing here changes which tokens are generated: the text
parsed is the text the target produced, speculation or not.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from ..core.grammar import JSON_OPTIONS, ll_tokenizer, one_line
from .protocol import ApiError

log = logging.getLogger("mlx_spec.server")


LOGPROB_FLOOR = -9999.0  # what a masked (-inf) log-probability is sent as


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)  # OpenAI's chat entries

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.logprobs)


def tool_format(tokenizer) -> str | None:
    """The mlx-lm tool parser module's short name (e.g. json_tools), or None."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


def forced_prefix(tokenizer, choice) -> str:
    """Text appended to the prompt for tool_choice required / a named function: the start of
    a tool call (and, for the JSON format, its name), so the target writes the rest."""
    if choice == "required":
        return tokenizer.tool_call_start
    name = choice["function"]["name"]
    return tokenizer.tool_call_start + call_head(name)


def call_head(name: str) -> str:
    return "\n" + json.dumps({"name": name})[:-1] + ', "arguments": '


def check_tool_choice(tokenizer, req) -> None:
    """A 400 for a tool_choice this model's tool-call format cannot honour."""
    if req.kind != "chat" or not req.tools or req.tool_choice in ("none", "auto"):
        return
    fmt = tool_format(tokenizer)
    if fmt is None:
        raise ApiError(
            400,
            "this model has no tool-call format mlx-lm can parse: tool_choice must be auto or none",
            "tool_choice",
            "unsupported_parameter",
        )
    if isinstance(req.tool_choice, dict) and fmt != "json_tools":
        raise ApiError(
            400,
            f"tool_choice naming a function needs the JSON tool-call format; this model's is"
            f" {fmt}: use required or auto",
            "tool_choice",
            "unsupported_parameter",
        )


# ------------------------------------------------------------------ constrained tool calls
# tool_choice required / a named function with the JSON format: the rest of the reply after
# forced_prefix follows a Lark grammar for llguidance (grammar.py), so the arguments are valid
# against the function's `parameters` and the call is closed. The grammar masks the target and
# the draft alike (speculation stays lossless) and its forced bytes are drafted for free.

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_grammar(tokenizer, vocab: int | None, req) -> str | None:
    """The Lark grammar for a constrained tool_choice (None when there is nothing to constrain):
    named: the arguments object, then `}`, a newline, the end marker and end of turn;
    required: one or more whole calls, each to one of the tools (the start marker is in the
    prompt for the first). A parameters schema llguidance cannot compile is a 400 (tools)."""
    if req.kind != "chat" or not req.tools or req.tool_choice in ("none", "auto"):
        return None
    if tool_format(tokenizer) != "json_tools":
        return None  # other formats: the forced start only (check_tool_choice refuses a name)
    ll = ll_tokenizer(tokenizer, vocab)

    def marker(text: str) -> str:  # a special token is named by id: no text can spell it
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ll.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return literal(text)

    end = literal("}\n") + " " + marker(tokenizer.tool_call_end)
    functions = [t["function"] for t in req.tools]
    if isinstance(req.tool_choice, dict):
        name = req.tool_choice["function"]["name"]
        j = next(i for i, f in enumerate(functions) if f["name"] == name)
        args = json_rule(ll, functions[j], j)
        return f"start: args {end}\nargs: {args}\n"
    rules = [f"args{j}: {json_rule(ll, f, j)}" for j, f in enumerate(functions)]
    heads = " | ".join(f"{literal(call_head(f['name']))} args{j}" for j, f in enumerate(functions))
    again = literal("\n") + " " + marker(tokenizer.tool_call_start)  # a call after a call
    lines = [f"start: call ({again} call)*", f"call: ({heads}) {end}", *rules]
    return "\n".join(lines) + "\n"


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def json_rule(ll, function: dict, j: int) -> str:
    """`%json {...}` for a function's parameters (none: no arguments; no type: an object),
    generated compact as the JSON replies are (grammar.JSON_OPTIONS; the schema's own
    "x-guidance" wins); checked alone first, so an error names the tool."""
    import llguidance

    schema = function.get("parameters")
    schema = NO_PARAMETERS if schema is None else schema
    if "type" not in schema:  # {} and the like: arguments are an object all the same
        schema = {"type": "object", **schema}
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    problem = None
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)
        if failed:
            problem = one_line(messages[0])
    except (ValueError, TypeError) as err:
        problem = one_line(str(err))
    if problem is not None:
        raise ApiError(
            400,
            f"the parameters of tools[{j}] ({function['name']!r}) cannot be compiled to"
            f" constrain the call: {problem}",
            "tools",
            "invalid_value",
        )
    return "%json " + json.dumps(schema, ensure_ascii=False)


class Output:
    """Turns text pieces (and their tokens' log-probabilities) into `Delta`s."""

    def __init__(self, tokenizer, req, prompt: list[int], raw_reasoning: bool = False):
        chat = req.kind == "chat"
        self.tokenizer, self.tools = tokenizer, req.tools
        self.parse_tools = bool(
            chat and req.tools and req.tool_choice != "none" and tool_format(tokenizer)
        )
        self.split_reasoning = (
            chat and not raw_reasoning and getattr(tokenizer, "has_thinking", False)
        )
        self.calls: list[dict] = []
        self.tool_text = ""
        self.chat = chat
        self.sm = None
        initial = "normal"
        if self.parse_tools or self.split_reasoning:
            shim = SimpleNamespace(
                has_thinking=self.split_reasoning,
                think_start=getattr(tokenizer, "think_start", None),
                think_end=getattr(tokenizer, "think_end", None),
                has_tool_calling=self.parse_tools,
                tool_call_start=getattr(tokenizer, "tool_call_start", None),
                tool_call_end=getattr(tokenizer, "tool_call_end", None),
                response_transitions=getattr(tokenizer, "response_transitions", None) or {},
                structural_markers=getattr(tokenizer, "structural_markers", None) or (),
            )
            self.sm = make_text_state_machine(shim)
            if self.split_reasoning:
                start = tokenizer.rfind_think_start(prompt)
                if start >= 0 and start > tokenizer.rfind_think_end(prompt):
                    initial = "reasoning"  # the template opened the thinking block
            if self.parse_tools and req.tool_choice not in ("auto", "none"):
                initial = "tool"  # the prompt ends with a forced tool-call start
                if isinstance(req.tool_choice, dict):
                    self.tool_text = call_head(req.tool_choice["function"]["name"])
            self.state = self.sm.make_state(initial)
        self.current = initial

    # ------------------------------------------------------------------ text

    def feed(self, text: str, logprobs: list[dict] | None = None) -> Delta:
        delta = Delta(logprobs=logprobs or [])
        if self.sm is None:
            delta.content = text
            return delta
        self.state, segments = TextStateMachine.split(self.state, text)
        self._take(segments, delta)
        return delta

    def finish(self) -> Delta:
        """Generation ended: text held back as a possible marker is text after all; an open
        tool call is parsed as it stands."""
        delta = Delta()
        if self.sm is None:
            return delta
        self.state, rest, current = TextStateMachine.flush(self.state)
        self._take([(current, rest)], delta)
        if self.current == "tool" and self.tool_text:
            self._close_call(delta, ended=False)  # cut by max_tokens, or no end marker
        return delta

    def _take(self, segments, delta: Delta) -> None:
        for state, text in segments:
            if state == "reasoning":
                delta.reasoning += text
            elif state == "tool":
                self.tool_text += text
            elif state is not None:
                if self.current == "tool":
                    self._close_call(delta)
                delta.content += text
            self.current = state

    def _close_call(self, delta: Delta, ended: bool = True) -> None:
        text, self.tool_text = self.tool_text, ""
        try:
            parsed = self.tokenizer.tool_parser(text, self.tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = [self._format(c) for c in parsed]
        except Exception as err:  # noqa: BLE001  a parser's error: keep the text as text
            log.warning(
                "a tool call did not parse (%s: %s); returned as content", type(err).__name__, err
            )
            end = (self.tokenizer.tool_call_end or "") if ended else ""
            delta.content += self.tokenizer.tool_call_start + text + end
            return
        for c in calls:
            c["index"] = len(self.calls)
            self.calls.append(c)
            delta.tool_calls.append(c)

    @staticmethod
    def _format(call: dict) -> dict:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError("the parser returned no function name")
        args = call.get("arguments", {})
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        cid = call.get("id") or "call_" + uuid.uuid4().hex[:24]
        return {
            "id": cid,
            "type": "function",
            "function": {"name": call["name"], "arguments": args},
        }

    # ------------------------------------------------------------------ logprobs

    def entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        def one(t: int, lp: float) -> dict:
            text = self.tokenizer.decode([t])
            # a token a grammar masks has -inf, which JSON cannot carry (a non-streamed reply
            # failed to encode): OpenAI's floor, -9999.0, stands in
            lp = max(lp, LOGPROB_FLOOR) if lp == lp else LOGPROB_FLOOR
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        out = one(token, logprob)
        out["top_logprobs"] = [one(t, lp) for t, lp in top]
        return out


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """Chat-style entries in the legacy completions shape, text offsets from `offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
