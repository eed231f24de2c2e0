"""Replay an agent-like trace against `mlx-spec serve`: a code file shown, then edited over
several turns. The same trace runs against several servers, interleaved turn by turn: drafting
off, prompt lookup in the request's own context only (--no-history), and lookup that also
searches earlier requests and replies (history, the default for lookup pairs), each lookup
server with every k of --k (auto: the controller; a fixed k makes tokens/pass deterministic).

Three shapes of agent:
- conversation: every turn resends the whole conversation (the previous replies are in context);
- fresh: every turn is a new context holding the original file and the list of changes so far,
  as an agent that retries or re-plans from the file on disk; the previous edited versions are
  only in the server's history;
- tools: a tool-calling agent. Requests carry `tools` (read_file, run_tests); each turn the
  agent's recorded calls (an assistant message with `tool_calls`) and their results (`tool`
  messages: the file as the last reply left it, the test run's output) are fed back through the
  chat template before the model writes the file. Lookup drafts from the tool results.
  (SmolLM2 has no tool-call format, so the calls are the trace's, the replies the model's; the
  server's parsing of generated calls is tested with a tiny tool-calling model in
  tests/test_agents.py.)

Run (the machine is shared: one benchmark at a time):
    flock /tmp/bench.lock python benchmarks/agent_trace.py [--pair smollm2-lookup] [--k auto,8]
        [--shapes conversation,fresh,tools] [--drafters suffix]
Greedy decoding: every configuration must produce the same text (checked).

The session shape (`--shapes session`): a recorded coding-agent session, the shape Claude Code and
Codex produce, replayed in each agent protocol against `mlx-spec serve` and against
`mlx_lm.server` with the same target. The session (data in benchmarks/agent_session.py): a
system prompt of --system-tokens tokens (default 3000: instructions, and the ten tool definitions
as JSON when the chat template does not render `tools`, as SmolLM2's does not; `tools` is sent
too), then --turns requests of the parent agent (default 12): its recorded tool calls (glob,
read_file, bash, edit, task, ...) and their results quoting the project's files, each request
resending the whole conversation; two sub-tasks (the `task` tool: the same system prompt and
tools, a new conversation of 3 requests) interleaved with the parent's turns (parent, sub-task A,
parent, sub-task B, parent ...); one turn asking the model to rewrite a file it read, in full
(the reply is generated, up to --rewrite-tokens, and kept in the conversation), and a final
summary. Every other request generates up to --reply-tokens, which the recorded tool call then
replaces (SmolLM2 writes no tool calls). --dry-run prints the requests and their sizes. (The
tool definitions alone are 2,048 SmolLM2 tokens: a smaller --system-tokens gives just them.)

One server per protocol, all started at once and sent each request in turn (default
--protocols chat,messages,responses: /v1/chat/completions with tools / tool_calls / tool messages,
/v1/messages with tool_use / tool_result blocks, /v1/responses with function_call /
function_call_output items, the whole input each turn and store false; previous_response_id is
not used: the stored response would hold the model's reply where the session has the recorded
calls), with the pair's default drafter (--pair; --serve-flags adds flags), and `mlx_lm.server`
on the pair's target written as an MLX directory, in chat completions (mlx-lm 0.32's server
speaks /v1/chat/completions and /v1/completions only; --no-mlx-lm leaves it out). mlx_lm.server
runs on the same OpenBLAS as our servers (mlx_spec is imported first to load it, nothing more).
Every request is streamed, greedy. Reported per server:
- prefilled: prompt_tokens - cached_tokens of each response's usage (Messages:
  input_tokens, which exclude cache_read_input_tokens), against the minimum: the request's
  prompt tokens past the longest prefix it shares with any earlier request's prompt followed by
  its reply. The client renders the prompts with the target's own chat template and tokenizer
  (as both servers do; each request's prompt_tokens is checked against it) and takes a reply's
  tokens as its text tokenised again, plus the end-of-turn token when the reply ended on it;
- time to first token per request (the first text delta; the stream's own clock) and the median;
- decode tokens/s: (completion tokens - 1) / (last byte - first text), summed over requests;
- session wall: the sum of the requests' times (the servers take turns, so not the clock's);
- acceptance and tokens per target pass (ours: from each response's `speculation` object);
- whether every greedy reply equals the other servers': our three protocols must agree (exit 1
  otherwise); mlx_lm.server's replies are compared and differences reported, not asserted.
A markdown table goes to stdout, progress to stderr, every request to --out (JSON).

--peer NAME=DIR (repeatable) replays the session on vllm-mlx or rapid-mlx too, in chat
completions, installed with `pip install --no-deps --target DIR vllm-mlx==0.6.0` (or
rapid-mlx==0.16.10) and run by --peer-python, a Python holding what they import (fastapi,
uvicorn, transformers, mlx-lm <= 0.31.1 for vllm-mlx's prefix cache). --clear-after N: the user
types /clear after the parent's N-th turn (a new conversation on the same system prompt).
--peer-flags NAME=FLAGS adds flags to a peer's serve (rapid-mlx's suffix decoding:
`rapid-mlx=--speculative-config '{"method":"suffix","num_speculative_tokens":8}'`).
--variant NAME=FLAGS (repeatable) adds an mlx-spec server in chat completions with more flags
(e.g. `--variant "suffix=--drafter suffix"` against `--serve-flags "--drafter ngram"`): its
decode time (wall less time to first token) is compared with the first mlx-spec server's. A
VAR=VALUE among the flags goes into its environment (`--variant
"mlx-attention=MLX_SPEC_CPU_ATTENTION=0"`: MLX's own attention on the CPU).

    flock /tmp/bench.lock python benchmarks/agent_trace.py --shapes session --out session.json
        [--turns 12] [--system-tokens 3000] [--reply-tokens 32] [--rewrite-tokens 640]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # agent_session, serve_batch
import agent_session as S  # noqa: E402

FILE = '''"""A small inventory of items with prices and quantities."""


class Inventory:
    def __init__(self):
        self.items = {}

    def add_item(self, name, price, quantity=1):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"price": price, "quantity": quantity}

    def remove_item(self, name, quantity=1):
        item = self.items[name]
        item["quantity"] -= quantity
        if item["quantity"] <= 0:
            del self.items[name]

    def total(self):
        return sum(i["price"] * i["quantity"] for i in self.items.values())

    def report(self):
        lines = []
        for name, item in sorted(self.items.items()):
            lines.append(f"{name}: {item['quantity']} x {item['price']:.2f}")
        lines.append(f"total: {self.total():.2f}")
        return "\\n".join(lines)
'''
CHANGES = [
    "Rename the method `total` to `total_value` everywhere.",
    "Make `remove_item` raise a KeyError with a clear message when the item is missing.",
    "Add a method `most_expensive` that returns the name of the priciest item.",
]
SYSTEM = "You are a coding assistant. Reply with the complete updated file in one code block."


def shown(changes: list[str]) -> str:
    asks = "\n".join(f"{i + 1}. {c}" for i, c in enumerate(changes))
    return f"Here is `inventory.py`:\n```python\n{FILE}```\nApply these changes:\n{asks}"


def conversation_turns():
    """Each turn resends the conversation so far (the replies come from the server)."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, change in enumerate(CHANGES):
        ask = shown([change]) if i == 0 else f"Now also: {change}"
        messages.append({"role": "user", "content": ask})
        reply = yield list(messages)
        messages.append({"role": "assistant", "content": reply})


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and return its output",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
TOOL_SYSTEM = (
    "You are a coding agent. Read files with read_file, check your work with run_tests, and"
    " reply with the complete updated file in one code block."
)


def code_block(reply: str) -> str | None:
    match = re.search(r"```(?:python)?\n(.*?)```", reply, re.S)
    return match.group(1) if match else None


def call(i: int, name: str, arguments: dict) -> dict:
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{i}", "type": "function", "function": fn}


def tool_turns():
    """Each turn: the task, the agent's read_file and run_tests calls with their results (the
    file as the last reply wrote it, a test run naming its lines), the agent's instruction to
    apply the change, then the model's file."""
    messages = [{"role": "system", "content": TOOL_SYSTEM}]
    current = FILE
    for i, change in enumerate(CHANGES):
        messages.append({"role": "user", "content": "Look at inventory.py and run the tests."})
        calls = [
            call(2 * i, "read_file", {"path": "inventory.py"}),
            call(2 * i + 1, "run_tests", {}),
        ]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        shown_file = f"Here is `inventory.py`:\n```python\n{current}```"
        messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": shown_file})
        lines = [
            f"inventory.py:{n + 1}: {t}" for n, t in enumerate(current.splitlines()) if "def " in t
        ]
        report = "collected:\n" + "\n".join(lines) + "\n3 passed"
        messages.append({"role": "tool", "tool_call_id": calls[1]["id"], "content": report})
        messages.append({"role": "user", "content": f"Apply this change to inventory.py: {change}"})
        reply = yield list(messages)
        messages.append({"role": "assistant", "content": reply})
        current = code_block(reply) or current


def fresh_turns():
    """Each turn is a fresh context: the original file and every change asked so far."""
    for i in range(len(CHANGES)):
        yield [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": shown(CHANGES[: i + 1])},
        ]


def post(url: str, body: dict) -> dict:
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    r = conn.getresponse()
    data = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data}")
    return data


def start_server(pair: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "mlx_spec", "serve", "--pair", pair, "--port", "0"]
    proc = subprocess.Popen(
        cmd + flags + ["--log-level", "warning"], stdout=subprocess.PIPE, text=True
    )
    url = re.search(r"on (http://\S+)/v1", proc.stdout.readline()).group(1)
    host, port = url[7:].split(":")
    for _ in range(300):
        try:
            http.client.HTTPConnection(host, int(port), timeout=1).request("GET", "/health")
            break
        except OSError:
            time.sleep(0.1)
    return proc, url


def row(shape: str, data: dict, wall: float) -> dict:
    n = data["usage"]["completion_tokens"]
    return {
        "shape": shape,
        "tokens": n,
        "wall": wall,
        "tokens_per_second": n / wall,
        "decode_tokens_per_second": data["speculation"]["tokens_per_second"],
        "cached": data["usage"]["prompt_tokens_details"]["cached_tokens"],
        "prompt": data["usage"]["prompt_tokens"],
        "acceptance": data["speculation"]["acceptance_rate"],
        "tokens_per_pass": data["speculation"]["tokens_per_target_pass"],
        "text": data["choices"][0]["message"]["content"] or "",
    }


# ------------------------------------------------------------------ the recorded agent session


class Step:
    """One request of the parent conversation and what the agent did after it: `calls` (the
    recorded assistant turn: text and tool calls, then each call's result), a sub-task
    (`task`: a `task` call whose result is the sub-agent's report), the rewrite (a user message
    before the request; the model's own reply is kept, with a write_file call of the file it
    wrote, as an agent writes it), or the final request (a user message before it)."""

    def __init__(self, label, kind, text="", calls=(), results=(), task=None, user=None):
        self.label, self.kind, self.text = label, kind, text
        self.calls, self.results, self.task, self.user = list(calls), list(results), task, user


def read(path: str) -> tuple[str, dict]:
    return "read_file", {"file_path": f"{S.ROOT}/{path}"}


def pytest_call() -> tuple[str, dict]:
    return "bash", {"command": "python -m pytest -q", "description": "Run the test suite"}


WRITTEN = "File created successfully at: {}"


def grep_call(pattern: str) -> tuple[str, dict]:
    return "grep", {"pattern": pattern, "path": S.ROOT, "output_mode": "content", "n": True}


# The sub-tasks: their prompt, their steps (text, tool call, result: one request each) and the
# report that comes back to the parent (one more request, whose reply is not kept).
SUBTASKS = {
    "A": (
        S.SUBTASK_A,
        [
            ("I'll search for the list command.", grep_call(S.GREP_LIST_PATTERN), S.GREP_LIST),
            ("Reading the command line module.", read("tally/cli.py"), S.FILES["tally/cli.py"]),
        ],
        S.REPORT_A,
    ),
    "B": (
        S.SUBTASK_B,
        [
            ("Searching for date handling.", grep_call(S.GREP_DATES_PATTERN), S.GREP_DATES),
            (
                "Reading the formatting module.",
                read("tally/formatting.py"),
                S.FILES["tally/formatting.py"],
            ),
        ],
        S.REPORT_B,
    ),
}


def parent_steps() -> list[tuple[Step, bool]]:
    """The parent conversation in order, each step with whether it is required (the others go
    by `OPTIONAL` priority until --turns is reached)."""
    f = S.FILES
    todos = {"todos": [
        {"id": "1", "content": "Add an optional due date to Task", "status": "in_progress"},
        {"id": "2", "content": "Show due dates in tally list", "status": "pending"},
        {"id": "3", "content": "Add tally list --overdue", "status": "pending"},
        {"id": "4", "content": "Tests for due dates and --overdue", "status": "pending"},
    ]}  # fmt: skip
    edit_cli = {"file_path": f"{S.ROOT}/tally/cli.py", "old_string": S.CLI_OLD,
                "new_string": S.CLI_NEW}  # fmt: skip
    test_path = f"{S.ROOT}/tests/test_store.py"
    edit_tests = {"file_path": test_path, "old_string": f["tests/test_store.py"][-120:],
                  "new_string": f["tests/test_store.py"][-120:] + S.TESTS_ADDED}  # fmt: skip
    return [
        (Step("glob **/*.py", "calls", "I'll start by looking at the project layout.",
              [("glob", {"pattern": "**/*.py", "path": S.ROOT})], [S.GLOB_PY]), True),
        (Step("todo_write", "calls", "Let me plan this.", [("todo_write", todos)],
              ["Todos have been modified successfully. Ensure that you continue to use the todo "
               "list to track your progress."]), False),
        (Step("read models.py", "calls", "Let me read the task model.",
              [read("tally/models.py")], [f["tally/models.py"]]), True),
        (Step("read store.py", "calls", "Now the store.", [read("tally/store.py")],
              [f["tally/store.py"]]), False),
        (Step("task A (list command)", "task", "I'll have an agent map how `tally list` is wired.",
              task="A"), True),
        (Step("read tests", "calls", "Let me look at the existing tests.",
              [read("tests/test_store.py")], [f["tests/test_store.py"]]), False),
        (Step("pytest (baseline)", "calls", "Running the tests first for a baseline.",
              [pytest_call()], [S.PYTEST_BEFORE]), False),
        (Step("read README + pyproject", "calls", "Checking the docs and the project settings.",
              [read("README.md"), read("pyproject.toml")],
              [f["README.md"], f["pyproject.toml"]]), False),
        (Step("task B (dates)", "task", "I'll have an agent check how dates are handled.",
              task="B"), True),
        (Step("rewrite models.py", "rewrite", user=S.REWRITE), True),
        (Step("pytest (rewrite)", "calls", "Running the tests on the new model.",
              [pytest_call()], [S.PYTEST_BEFORE]), True),
        (Step("read cli.py", "calls", "Now the command line.", [read("tally/cli.py")],
              [f["tally/cli.py"]]), False),
        (Step("read formatting.py", "calls", "And the table formatting.",
              [read("tally/formatting.py")], [f["tally/formatting.py"]]), False),
        (Step("edit cli.py", "calls", "Adding the --overdue filter.", [("edit", edit_cli)],
              [S.EDIT_RESULT]), False),
        (Step("edit tests + pytest", "calls", "Adding tests and running them.",
              [("edit", edit_tests), pytest_call()],
              [f"The file {test_path} has been updated.", S.PYTEST_AFTER]), False),
        (Step("final summary", "final", user=S.FINAL), True),
    ]  # fmt: skip


# Optional steps by priority: the first --turns minus the required ones are kept.
OPTIONAL = ["read store.py", "read cli.py", "edit cli.py", "pytest (baseline)", "read tests",
            "edit tests + pytest", "todo_write", "read README + pyproject",
            "read formatting.py"]  # fmt: skip


def session_plan(turns: int) -> list[Step]:
    steps = parent_steps()
    required = sum(r for _, r in steps)
    if not required <= turns <= len(steps):
        raise SystemExit(f"--turns must be in [{required}, {len(steps)}] (parent requests)")
    keep = set(OPTIONAL[: turns - required])
    return [s for s, r in steps if r or s.label in keep]


def chat_tools() -> list[dict]:
    return [
        {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
        for n, d, p in S.TOOLS
    ]


def template_shows_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools` (SmolLM2's does not)."""
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return plain != tokenizer.apply_chat_template(
        messages, tools=chat_tools(), tokenize=False, add_generation_prompt=True
    )


def system_prompt(tokenizer, tokens: int, embed_tools: bool) -> str:
    """About `tokens` tokens of instructions (S.SYSTEM_SECTIONS in order, repeated past their
    end, the last one cut), and the tool definitions written into it as JSON (Hermes-style)
    when the template does not render `tools` itself."""
    tail = ""
    if embed_tools:
        schemas = "\n".join(json.dumps(t["function"]) for t in chat_tools())
        tail = (
            "\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
            " The function signatures are within <tools></tools> XML tags:\n<tools>\n"
            f"{schemas}\n</tools>\n\nFor each function call, return a json object with the"
            " function name and arguments within <tool_call></tool_call> XML tags."
        )

    def count(text):
        return len(tokenizer.encode(text, add_special_tokens=False))

    budget, used, parts = tokens - count(tail), 0, []
    while used < budget:
        section = S.SYSTEM_SECTIONS[len(parts) % len(S.SYSTEM_SECTIONS)]
        n = count(section) + 1
        if used + n > budget:
            ids = tokenizer.encode(section, add_special_tokens=False)[: budget - used]
            section = tokenizer.decode(ids)
        parts.append(section)
        used += n
    return "\n\n".join(parts) + tail


def session_turns(
    system: str, plan: list[Step], reply_tokens: int, rewrite_tokens: int, clear_after: int = 0
):
    """The session's requests in order, as OpenAI chat messages: yields (label, messages,
    max_tokens) and is sent each reply's text. Only the rewrite's reply (and the last one)
    stays in the conversation: every other reply is replaced by the recorded tool calls.
    `clear_after` n: after the parent's n-th turn the user types `/clear`, and the parent goes
    on in a new conversation (the system prompt, then S.CLEARED)."""
    ids = iter(range(1, 10**6))

    def assistant(text: str, calls) -> dict:
        out = {"role": "assistant", "content": text}
        out["tool_calls"] = [
            {"id": f"call_{next(ids)}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in calls
        ]  # fmt: skip
        return out

    def results(call: dict, texts: list[str]) -> list[dict]:
        return [
            {"role": "tool", "tool_call_id": c["id"], "content": t}
            for c, t in zip(call["tool_calls"], texts, strict=True)
        ]

    parent = [{"role": "system", "content": system}, {"role": "user", "content": S.TASK}]
    for n, step in enumerate(plan, 1):
        label = f"P{n} {step.label}"
        if clear_after and n == clear_after + 1:
            parent = [{"role": "system", "content": system}, {"role": "user", "content": S.CLEARED}]
            label = f"P{n} /clear, {step.label}"
        if step.kind == "rewrite":  # the model's reply, kept: the file it writes
            parent.append({"role": "user", "content": step.user})
            reply = yield label, list(parent), rewrite_tokens
            path = f"{S.ROOT}/tally/models.py"
            write = ("write_file", {"file_path": path, "content": code_block(reply) or reply})
            m = assistant(reply, [write])
            parent += [m, *results(m, [WRITTEN.format(path)])]
            continue
        if step.kind == "final":
            parent.append({"role": "user", "content": step.user})
            reply = yield label, list(parent), reply_tokens
            parent.append({"role": "assistant", "content": reply})
            continue
        yield label, list(parent), reply_tokens  # the model's reply: not kept
        if step.kind == "task":
            prompt, sub_steps, report = SUBTASKS[step.task]
            what = {"A": "Map the list command", "B": "Check date handling"}[step.task]
            call = assistant(step.text, [("task", {"description": what, "prompt": prompt})])
            parent.append(call)
            sub = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
            for i, (text, tool_call, result) in enumerate(sub_steps, 1):
                yield f"{step.task}{i} {tool_call[0]}", list(sub), reply_tokens
                m = assistant(text, [tool_call])
                sub += [m, *results(m, [result])]
            yield f"{step.task}{len(sub_steps) + 1} report", list(sub), reply_tokens
            parent += results(call, [report])  # the sub-agent's report, as recorded
            continue
        m = assistant(step.text, step.calls)
        parent += [m, *results(m, step.results)]


# ------------------------------------------------------------------ the three protocols


def as_chat(messages: list[dict], tools: list[dict]) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": messages, "tools": tools}


def as_messages(messages: list[dict], tools: list[dict]) -> tuple[str, dict]:
    """Anthropic Messages: the system prompt apart, tool_use blocks in the assistant turn, the
    tool results (then any text) as blocks of one user turn."""
    out: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m["content"] else []
            blocks += [
                {"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])}
                for c in m.get("tool_calls", [])
            ]  # fmt: skip
            out.append({"role": "assistant", "content": blocks if m.get("tool_calls") else
                        m["content"]})  # fmt: skip
            continue
        if m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": "toolu_" + m["tool_call_id"][5:],
                     "content": m["content"]}  # fmt: skip
        else:
            block = {"type": "text", "text": m["content"]}
        if out and out[-1]["role"] == "user":
            out[-1]["content"].append(block)
        else:
            out.append({"role": "user", "content": [block]})
    anthropic_tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"],
         "input_schema": t["function"]["parameters"]}
        for t in tools
    ]  # fmt: skip
    return "/v1/messages", {
        "system": messages[0]["content"], "messages": out, "tools": anthropic_tools,
    }  # fmt: skip


def as_responses(messages: list[dict], tools: list[dict]) -> tuple[str, dict]:
    """OpenAI Responses: the whole input each turn (store false, as Codex sends it), the system
    prompt as instructions, function_call / function_call_output items."""
    items: list[dict] = []
    for m in messages[1:]:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})  # fmt: skip
            continue
        kind = "output_text" if m["role"] == "assistant" else "input_text"
        if m["content"]:
            items.append({"type": "message", "role": m["role"],
                          "content": [{"type": kind, "text": m["content"]}]})  # fmt: skip
        for c in m.get("tool_calls", []):
            items.append({"type": "function_call", "call_id": c["id"],
                          "name": c["function"]["name"],
                          "arguments": c["function"]["arguments"]})  # fmt: skip
    flat = [{"type": "function", **t["function"]} for t in tools]
    return "/v1/responses", {
        "instructions": messages[0]["content"], "input": items, "tools": flat, "store": False,
    }  # fmt: skip


PROTOCOLS = {"chat": as_chat, "messages": as_messages, "responses": as_responses}


def sse_events(response):
    """(event name or None, parsed data) for each `data:` line of a server-sent stream."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield name, json.loads(data)
            name = None


def request_body(protocol: str, model: str, messages: list[dict], max_tokens: int):
    """The path and body of one streamed, greedy request in `protocol`."""
    path, body = PROTOCOLS[protocol](messages, chat_tools())
    body.update(model=model, temperature=0, stream=True)
    if protocol == "responses":
        body["max_output_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
    if protocol == "chat":
        body["stream_options"] = {"include_usage": True}
    return path, body


def stream_request(url: str, protocol: str, path: str, body: dict) -> dict:
    """Send one streamed request; what its events said and when."""
    import httpx

    out = {"text": "", "ttft": None, "speculation": None, "finish": None}
    start = time.perf_counter()
    with httpx.stream("POST", url + path, json=body, timeout=1800) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}{path}: HTTP {r.status_code}: {r.text[:2000]}")
        for name, data in sse_events(r):
            piece = ""
            kind = data.get("type") or name
            if protocol == "chat":
                for c in data.get("choices") or []:
                    piece += (c.get("delta") or {}).get("content") or ""
                    out["finish"] = c.get("finish_reason") or out["finish"]
                if data.get("usage"):
                    u = data["usage"]
                    out["prompt"], out["completion"] = u["prompt_tokens"], u["completion_tokens"]
                    out["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                out["speculation"] = data.get("speculation") or out["speculation"]
            elif protocol == "messages":
                if kind == "content_block_delta":
                    piece = data["delta"].get("text") or ""
                elif kind == "message_delta":
                    u = data["usage"]
                    out["cached"] = u["cache_read_input_tokens"]
                    out["prompt"] = u["input_tokens"] + out["cached"]
                    out["completion"] = u["output_tokens"]
                    stop = data["delta"]["stop_reason"]
                    out["finish"] = {"end_turn": "stop", "max_tokens": "length"}.get(stop, stop)
                    out["speculation"] = data.get("speculation")
                elif kind == "error":
                    raise RuntimeError(f"{url}{path}: error event: {data}")
            else:
                if kind == "response.output_text.delta":
                    piece = data["delta"]
                elif kind in ("response.completed", "response.incomplete", "response.failed"):
                    resp = data["response"]
                    if kind == "response.failed":
                        raise RuntimeError(f"{url}{path}: response.failed: {resp.get('error')}")
                    u = resp["usage"]
                    out["prompt"], out["completion"] = u["input_tokens"], u["output_tokens"]
                    out["cached"] = u["input_tokens_details"]["cached_tokens"]
                    out["finish"] = "stop" if kind == "response.completed" else "length"
                    out["speculation"] = resp.get("speculation")
            if piece:
                if out["ttft"] is None:
                    out["ttft"] = time.perf_counter() - start
                out["text"] += piece
    out["latency"] = time.perf_counter() - start
    out["ttft"] = out["ttft"] if out["ttft"] is not None else out["latency"]
    return out


# ------------------------------------------------------------------ servers and the replay


OPENBLAS_MLX_LM = (
    "import runpy, mlx_spec.runtime.blas as b; assert b.loaded, 'no OpenBLAS'; "
    "runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)"
)


# The peers (`--peer NAME=DIR`), installed as their READMEs say but with `--no-deps --target
# DIR` and run by --peer-python (a Python with what they import: vllm-mlx 0.6.0 saves its prefix
# cache only on mlx-lm <= 0.31.1, whose BatchGenerator has the `_process_prompts` hook it
# patches; on 0.31.2+ it logs "Prompt cache save disabled"). Both on the OpenBLAS our servers
# use, their disk caches under the run's folder (HOME).
PEERS = {
    "vllm-mlx": ("from vllm_mlx.cli import main", ["--continuous-batching"]),
    "rapid-mlx": ("from rapid_mlx.dependency_repair import cli_entrypoint as main", []),
}
PEER_LAUNCH = (
    "import ctypes, sys; ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL); "
    "sys.argv = sys.argv[2:]; {}; sys.exit(main())"
)


def peer_command(args, name: str, where: str, root, target) -> list[str]:
    from mlx_spec.runtime.blas import installed

    entry, flags = PEERS[name]
    more = [shlex.split(f.partition("=")[2]) for f in args.peer_flags if f.startswith(name + "=")]
    env = [f"HOME={root / ('home-' + name)}", f"PYTHONPATH={os.path.abspath(where)}"]
    return ["env", *env, args.peer_python, "-c", PEER_LAUNCH.format(entry), installed(), name,
            "serve", str(target), *flags, *(f for m in more for f in m)]  # fmt: skip


def logged_prefill(log) -> int:
    """The tokens a peer's scheduler says it prefilled for its latest request (vllm-mlx's
    usage has no cached_tokens; its log line `[schedule] ... tokens_to_prefill=N`)."""
    found = re.findall(r"tokens_to_prefill=(\d+)", open(log).read())
    if not found:
        raise RuntimeError(f"{log}: no tokens_to_prefill line to read the prefill from")
    return int(found[-1])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def replay_session(args) -> int:
    import tempfile
    from pathlib import Path

    from serve_batch import start, write_mlx_dirs

    from mlx_spec import load_pair
    from mlx_spec.decode.prompts import encode_prompt

    pair = load_pair(args.pair)
    tokenizer, context = pair.tokenizer, pair.context_length or 10**9
    embed = not template_shows_tools(tokenizer)
    system = system_prompt(tokenizer, args.system_tokens, embed)
    plan = session_plan(args.turns)
    tools = chat_tools()

    def ids(messages):
        return encode_prompt(tokenizer, messages, template_kwargs={"tools": tools})

    # The session's size, with a rewrite as long as it may be: it must fit the context.
    filler = tokenizer.decode(
        tokenizer.encode(S.FILES["tally/models.py"] * 4)[: args.rewrite_tokens]
    )
    dry = session_turns(system, plan, args.reply_tokens, args.rewrite_tokens, args.clear_after)
    labels, longest, reply = [], 0, None
    while True:
        try:
            label, messages, max_tokens = dry.send(reply) if labels else next(dry)
        except StopIteration:
            break
        labels.append(label)
        size = len(ids(messages))
        longest = max(longest, size + max_tokens)
        if args.dry_run:
            print(f"{label:32} prompt {size:5} tokens, max_tokens {max_tokens}")
        reply = "```python\n" + filler + "```" if "rewrite" in label else "ok"
    system_len = len(tokenizer.apply_chat_template([{"role": "system", "content": system}]))
    print(f"session: {len(labels)} requests ({len(plan)} parent turns, 2 sub-tasks), system "
          f"prompt {system_len} tokens (tools {'in it as JSON' if embed else 'by the template'}),"
          f" longest request {longest} tokens with its max_tokens, context {context}",
          file=sys.stderr, flush=True)  # fmt: skip
    if args.dry_run:
        return 0
    if longest > context:
        raise SystemExit(f"the session needs {longest} tokens, more than the context ({context})"
                         ": lower --turns, --system-tokens or --rewrite-tokens")  # fmt: skip

    root = Path(tempfile.mkdtemp(prefix="agent_session_"))
    servers = {}  # name -> (command, protocol, model)
    spec = [sys.executable, "-m", "mlx_spec", "serve", "--pair", args.pair,
            "--log-level", "warning", *shlex.split(args.serve_flags)]  # fmt: skip
    if "--cache-dir" not in args.serve_flags:  # a disk tier of the run's own (restarts find it)
        spec += ["--cache-dir", str(root / "prompt-cache")]
    for protocol in args.protocols.split(","):
        if protocol not in PROTOCOLS:
            raise SystemExit(f"--protocols takes {', '.join(PROTOCOLS)}")
        servers[f"mlx-spec {protocol}"] = (spec, protocol, args.pair)
    for variant in args.variant:  # more flags (the last of a flag wins), a disk tier of its own
        name, _, flags = variant.partition("=")
        if not name or not flags:
            raise SystemExit("--variant takes NAME=FLAGS")
        folder = ["--cache-dir", str(root / f"prompt-cache-{len(servers)}")]
        flags = shlex.split(flags)
        env = [f for f in flags if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", f)]  # VAR=VALUE: its env
        flags = [f for f in flags if f not in env]
        cmd = [*spec, *flags, *([] if "--cache-dir" in flags else folder)]
        servers[f"mlx-spec {name}"] = (["env", *env, *cmd] if env else cmd, "chat", args.pair)
    if not args.no_mlx_lm:
        target, _ = write_mlx_dirs(args.pair, root, pair)
        # mlx_lm.server unchanged, but on the OpenBLAS mlx-spec loads (importing mlx_spec first
        # does only that here): plain `python -m mlx_lm.server` would compute on MLX's slow
        # reference BLAS on Linux, several times slower at prefill than our servers.
        lm = [sys.executable, "-c", OPENBLAS_MLX_LM, "--model", str(target),
              "--log-level", "WARNING"]  # fmt: skip
        servers["mlx_lm.server chat"] = (lm, "chat", str(target))
    for peer in args.peer:
        name, _, where = peer.partition("=")
        if name not in PEERS or not where:
            raise SystemExit(f"--peer takes NAME=DIR, NAME one of {', '.join(PEERS)}")
        if not (target := root / "target").is_dir():
            target, _ = write_mlx_dirs(args.pair, root, pair)
        servers[f"{name} chat"] = (peer_command(args, name, where, root, target), "chat",
                                   str(target))  # fmt: skip
    del pair
    procs, urls, logs = {}, {}, {}
    rows = {name: [] for name in servers}
    try:
        for i, (name, (cmd, _, model)) in enumerate(servers.items()):
            port = free_port()
            print(f"starting {name}", file=sys.stderr, flush=True)
            logs[name] = root / f"{i}.log"
            procs[name], urls[name] = start(cmd + ["--port", str(port)], port, logs[name])
            import httpx  # warm-up: a raw prompt sharing no prefix with the session

            httpx.post(urls[name] + "/v1/completions", timeout=600,
                       json={"model": model, "prompt": "Warm up.", "max_tokens": 4,
                             "temperature": 0}).raise_for_status()  # fmt: skip
        gens = {n: session_turns(system, plan, args.reply_tokens, args.rewrite_tokens,
                                 args.clear_after) for n in servers}  # fmt: skip
        seen = {n: [] for n in servers}  # the tokens of each earlier request and its reply
        began = time.perf_counter()
        for turn in range(len(labels)):
            if args.restart_after and turn == args.restart_after:
                restart(servers, procs, urls, logs, root, args.restart_signal)
            for name, (_, protocol, model) in servers.items():
                last = rows[name][-1]["text"] if rows[name] else None
                label, messages, max_tokens = gens[name].send(last) if turn else next(gens[name])
                path, body = request_body(protocol, model, messages, max_tokens)
                try:
                    r = stream_request(urls[name], protocol, path, body)
                except Exception as err:  # the request is kept, to reproduce it
                    failed = root / f"failed-{turn + 1}-{name.replace(' ', '-')}.json"
                    failed.write_text(json.dumps({"url": urls[name] + path, "body": body}))
                    log = root / f"{list(servers).index(name)}.log"
                    raise RuntimeError(f"{name}, {label}: {err} (request: {failed}; server "
                                       f"log: {log})") from err  # fmt: skip
                prompt = ids(messages)
                if "prompt" not in r and name.split()[0] in PEERS:  # (rapid-mlx's, once)
                    r["prompt"] = len(prompt)
                    r["completion"] = len(tokenizer.encode(r["text"], add_special_tokens=False))
                if r.get("cached") is None:  # vllm-mlx: its log says what it prefilled
                    r["cached"] = r["prompt"] - logged_prefill(logs[name])
                shared = max((common_prefix(prompt, s) for s in seen[name]), default=0)
                reply = tokenizer.encode(r["text"], add_special_tokens=False)
                if r["finish"] == "stop":
                    reply.append(tokenizer.eos_token_id)
                seen[name].append(prompt + reply)
                r.update(label=label, client_prompt=len(prompt), minimum=len(prompt) - shared,
                         prefilled=r["prompt"] - r["cached"], max_tokens=max_tokens)  # fmt: skip
                rows[name].append(r)
                print(f"[{time.perf_counter() - began:6.0f}s] {name:20} {label:28} prompt "
                      f"{r['prompt']:5} prefilled {r['prefilled']:5} (min {r['minimum']:5}) "
                      f"ttft {r['ttft']:5.2f}s  {r['completion']:4} tokens in "
                      f"{r['latency']:6.2f}s", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    # a finished run leaves nothing (its disk tier held 3 GB); a failed one keeps its folder,
    # with the failed request and the servers' logs
    shutil.rmtree(root, ignore_errors=True)
    return report_session(args, labels, system_len, rows)


def restart(servers: dict, procs: dict, urls: dict, logs: dict, root, how: str) -> None:
    """Every server stopped (SIGTERM, or SIGKILL: `--restart-signal kill`) and started again
    on a fresh port; mlx-spec's find their disk tier again, the others start empty."""
    from serve_batch import start

    for name, proc in procs.items():
        proc.send_signal(signal.SIGKILL if how == "kill" else signal.SIGTERM)
        proc.wait(120)
        print(f"restarted {name} ({how})", file=sys.stderr, flush=True)
    for i, (name, (cmd, _, _)) in enumerate(servers.items()):
        port = free_port()
        logs[name] = root / f"{i}-restarted.log"
        procs[name], urls[name] = start(cmd + ["--port", str(port)], port, logs[name])


def session_summary(rows: list[dict]) -> dict:
    decoded = [r for r in rows if r["completion"] > 1 and r["latency"] > r["ttft"]]
    spec = [r["speculation"] for r in rows if r.get("speculation")]
    drafted = sum(s["drafted"] for s in spec)
    passes = sum(s["target_passes"] for s in spec)
    return {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt"] for r in rows),
        "prefilled": sum(r["prefilled"] for r in rows),
        "minimum": sum(r["minimum"] for r in rows),
        "ttft_median": statistics.median(r["ttft"] for r in rows),
        "ttft_total": sum(r["ttft"] for r in rows),
        "decode_tokens_per_second": sum(r["completion"] - 1 for r in decoded)
        / max(1e-9, sum(r["latency"] - r["ttft"] for r in decoded)),
        "completion_tokens": sum(r["completion"] for r in rows),
        "wall": sum(r["latency"] for r in rows),
        "acceptance": sum(s["accepted"] for s in spec) / drafted if drafted else None,
        "tokens_per_pass": sum(s["tokens_per_target_pass"] * s["target_passes"] for s in spec)
        / passes
        if passes
        else None,
        "prompt_count_mismatches": sum(r["prompt"] != r["client_prompt"] for r in rows),
    }


def report_session(args, labels: list[str], system_len: int, rows: dict[str, list]) -> int:
    import datetime

    names = list(rows)
    ours = [n for n in names if n.startswith("mlx-spec")]
    peer = "mlx_lm.server chat" if "mlx_lm.server chat" in names else None
    reference = ours[0] if ours else names[0]
    texts = {n: [r["text"] for r in rows[n]] for n in names}
    ours_differ = [(i, n) for n in ours for i, t in enumerate(texts[n]) if t != texts[reference][i]]
    summaries = {n: session_summary(rows[n]) for n in names}
    date = datetime.date.today().isoformat()
    print(f"\n{args.pair}, agent session: {len(labels)} requests, system prompt {system_len} "
          f"tokens, replies {args.reply_tokens} tokens at most (the rewrite "
          f"{args.rewrite_tokens}), greedy; {date}\n")  # fmt: skip
    print("| server | prefilled | minimum | × minimum | TTFT median / total (s) | decode tok/s |"
          " session wall (s) | speed-up vs mlx_lm.server | acceptance | tokens/pass |"
          f" same replies as {peer or reference} |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in names:
        s = summaries[n]
        speed = f"{summaries[peer]['wall'] / s['wall']:.2f}" if peer else "–"
        acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "–"
        tpp = f"{s['tokens_per_pass']:.2f}" if s["tokens_per_pass"] is not None else "–"
        other = texts[peer or reference]
        same = sum(a == b for a, b in zip(texts[n], other, strict=True))
        same = "–" if n == (peer or reference) else f"{same}/{len(labels)}"
        print(f"| {n} | {s['prefilled']} | {s['minimum']} | {s['prefilled'] / s['minimum']:.2f} |"
              f" {s['ttft_median']:.2f} / {s['ttft_total']:.1f} |"
              f" {s['decode_tokens_per_second']:.1f} | {s['wall']:.1f} | {speed} | {acc} |"
              f" {tpp} | {same} |")  # fmt: skip
    if len(ours) > 1:
        base = summaries[reference]["wall"] - summaries[reference]["ttft_total"]
        for n in ours[1:]:
            decode = summaries[n]["wall"] - summaries[n]["ttft_total"]
            print(f"\ndecode time (wall less TTFT): {n} {decode:.1f} s, {reference} {base:.1f} s:"
                  f" {base / max(decode, 1e-9):.2f}x")  # fmt: skip
    print(
        "\nPer request: prompt tokens, the minimum to prefill, then each server's prefilled"
        " tokens / time to first token (s)\n"
    )
    print("| request | prompt | minimum | " + " | ".join(names) + " |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for i, label in enumerate(labels):
        first = rows[reference][i]
        cells = " | ".join(f"{rows[n][i]['prefilled']} / {rows[n][i]['ttft']:.2f}" for n in names)
        print(f"| {label} | {first['prompt']} | {first['minimum']} | {cells} |")
    for n in names:
        if summaries[n]["prompt_count_mismatches"]:
            print(f"warning: {n} reported another prompt length than the client's rendering on "
                  f"{summaries[n]['prompt_count_mismatches']} requests (the minimum is computed "
                  "on the client's tokens)", file=sys.stderr)  # fmt: skip
    if peer:
        for i, label in enumerate(labels):
            for n in ours:
                a, b = texts[n][i], texts[peer][i]
                if a != b:
                    at = common_prefix(list(a), list(b))
                    print(
                        f"note: {n} and {peer} differ on {label} from character {at}: "
                        f"{a[at : at + 40]!r} vs {b[at : at + 40]!r}",
                        file=sys.stderr,
                    )
                    break
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": date, "pair": args.pair, "labels": labels,
                       "system_tokens": system_len, "args": vars(args),
                       "summary": summaries, "rows": rows}, f, indent=1)  # fmt: skip
    if ours_differ:
        for i, n in ours_differ:
            print(
                f"ERROR: {n} replied otherwise than {reference} on {labels[i]} (greedy: the "
                "protocols must give the same tokens)",
                file=sys.stderr,
            )
        return 1
    return 0


SHAPES = {"conversation": conversation_turns, "fresh": fresh_turns, "tools": tool_turns}


def replay(
    pair: str, configs: dict[str, list[str]], max_tokens: int, shapes=tuple(SHAPES)
) -> dict[str, list[dict]]:
    """Every configuration's server runs at once (idle but for its own requests); turn by turn
    each gets the same request in turn, so a noisy neighbour slows them all alike."""
    servers = {}
    try:
        for name, flags in configs.items():
            print(f"starting: {name}", file=sys.stderr, flush=True)
            servers[name] = start_server(pair, flags)
        results = {name: [] for name in configs}
        for shape in shapes:
            make = SHAPES[shape]
            turns = {name: make() for name in configs}
            replies = dict.fromkeys(configs)
            for _ in CHANGES:
                for name, (_, url) in servers.items():
                    gen, reply = turns[name], replies[name]
                    messages = gen.send(reply) if reply is not None else next(gen)
                    body = {"model": pair, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0}  # fmt: skip
                    if shape == "tools":
                        body["tools"] = TOOLS
                    start = time.perf_counter()
                    data = post(url, body)
                    results[name].append(row(shape, data, time.perf_counter() - start))
                    replies[name] = results[name][-1]["text"]
        return results
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def configurations(ks: list[str], drafters: list[str] = ()) -> dict[str, list[str]]:
    configs = {"drafting off": ["--no-draft"]}
    for k in ks:
        configs[f"lookup, no history, k={k}"] = ["--no-history", "--num-draft-tokens", k]
        configs[f"lookup + history, k={k}"] = ["--num-draft-tokens", k]
    for drafter in drafters:  # another kind (--drafters suffix): its default k, history on
        configs[f"{drafter} + history"] = ["--drafter", drafter]
    return configs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-lookup")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", default="auto,8", help="draft lengths to compare, comma-separated")
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument(
        "--drafters", default="", help="more drafter kinds to compare (suffix,suffix+eagle3)"
    )
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="conversation,fresh,tools and/or session"
    )
    session = parser.add_argument_group("the session shape")
    session.add_argument("--turns", type=int, default=12, help="requests of the parent agent")
    session.add_argument("--system-tokens", type=int, default=3000)
    session.add_argument("--reply-tokens", type=int, default=32, help="max_tokens of a turn")
    session.add_argument("--rewrite-tokens", type=int, default=640, help="max_tokens, rewrite")
    session.add_argument("--protocols", default="chat,messages,responses")
    session.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    session.add_argument("--serve-flags", default="", help="more flags for mlx-spec serve")
    session.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more mlx-spec server (chat), with these flags after --serve-flags",
    )
    session.add_argument("--out", help="write the session's requests and summary (JSON)")
    session.add_argument("--dry-run", action="store_true", help="print the requests' sizes only")
    session.add_argument(
        "--restart-after", type=int, default=0, help="restart every server after this request"
    )
    session.add_argument(
        "--clear-after", type=int, default=0, help="a /clear after this parent turn"
    )
    session.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help=f"also replay on a peer ({', '.join(PEERS)}) installed in DIR",
    )
    session.add_argument("--peer-python", default=sys.executable, help="the peers' Python")
    session.add_argument(
        "--peer-flags",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="more flags for a peer's serve (rapid-mlx's suffix decoding: "
        """'rapid-mlx=--speculative-config {"method":"suffix","num_speculative_tokens":8}')""",
    )
    session.add_argument("--restart-signal", choices=["term", "kill"], default="term")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if set(shapes) - set(SHAPES) - {"session"}:
        parser.error(f"--shapes takes {', '.join(SHAPES)}, session")
    status = 0
    if set(shapes) - {"session"}:
        status = trace_shapes(args, [s for s in shapes if s != "session"])
    if "session" in shapes:
        status = replay_session(args) or status
    return status


def trace_shapes(args, shapes: list[str]) -> int:
    drafters = [d for d in args.drafters.split(",") if d]
    results = replay(
        args.pair, configurations(args.k.split(","), drafters), args.max_tokens, shapes
    )
    texts = {name: [r["text"] for r in rows] for name, rows in results.items()}
    same = len({json.dumps(t) for t in texts.values()}) == 1
    print(f"pair {args.pair}, {len(CHANGES)} turns per shape, max_tokens {args.max_tokens}, "
          f"greedy; identical text across configurations: {same}")  # fmt: skip
    base = {}
    print("| shape | configuration | median tok/s (end to end) | median decode tok/s | "
          "acceptance | tokens/pass | ratio vs drafting off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        for name, rows in results.items():
            mine = [r for r in rows if r["shape"] == shape]
            e2e = statistics.median(r["tokens_per_second"] for r in mine)
            dec = statistics.median(r["decode_tokens_per_second"] for r in mine)
            acc = statistics.median(r["acceptance"] for r in mine)
            tpp = statistics.median(r["tokens_per_pass"] for r in mine)
            base.setdefault(shape, e2e)
            print(f"| {shape} | {name} | {e2e:.1f} | {dec:.1f} | {acc:.0%} | {tpp:.2f} | "
                  f"{e2e / base[shape]:.2f}x |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if not same:
        print("error: the configurations' texts differ (greedy must be lossless)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
