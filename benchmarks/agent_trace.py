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
        [--shapes conversation,fresh,tools]
Greedy decoding: every configuration must produce the same text (checked).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

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


def configurations(ks: list[str]) -> dict[str, list[str]]:
    configs = {"drafting off": ["--no-draft"]}
    for k in ks:
        configs[f"lookup, no history, k={k}"] = ["--no-history", "--num-draft-tokens", k]
        configs[f"lookup + history, k={k}"] = ["--num-draft-tokens", k]
    return configs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2-lookup")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--k", default="auto,8", help="draft lengths to compare, comma-separated")
    parser.add_argument("--json", help="write every row to this file")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="conversation,fresh,tools")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if set(shapes) - set(SHAPES):
        parser.error(f"--shapes takes {', '.join(SHAPES)}")
    results = replay(args.pair, configurations(args.k.split(",")), args.max_tokens, shapes)
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
