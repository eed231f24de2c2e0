"""Concurrent streaming clients against four servers, interleaved (issue 25, item 6).

Servers, all on the same pair (default smollm2-self: SmolLM2 135M drafted by itself at 4 bits;
docs/serve.md's first figures were measured on it, as smollm2-demo before the demo pair shipped a
head; `--pair smollm2-demo --num-draft-tokens 1` measures the head pair, whose head drafts in
the batch):
- mlx-spec serial: `mlx-spec serve --max-batch 1` (one stream at a time, drafting: today's);
- mlx-spec batched: `mlx-spec serve --max-batch 8` (a batch that still drafts);
- mlx-lm batched: `python -m mlx_lm.server` on the target alone (its BatchGenerator);
- mlx-lm draft: `python -m mlx_lm.server --draft-model` (mlx-lm turns batching off with a draft).
- with `--plain-batch`, plain mlx-spec batched: `mlx-spec serve --max-batch 8 --no-draft` (the
  same batch without drafts: what drafting inside the batch adds).
mlx-lm's server reads MLX directories, so the pair's target and draft are written as such
first (same weights: the target as loaded, the draft as quantized).

For each repetition, each concurrency (1, 2, 4, 8) and each server in turn: that many
streaming chat requests start at once (greedy, --max-tokens each, different prompts); we
record the wall time, every request's time to first token and latency, and its text.
Reported: medians over repetitions of aggregate tokens/s, p50/p95 TTFT and latency, and
whether every reply equals the serial mlx-spec server's for the same prompt; then what the
mlx-spec servers' /metrics counted during those cells (drafted, accepted, tokens per target pass,
batched passes, prefill seconds). `--json` keeps every row, each repetition's tokens/s, the
counters, the date and the command line. `--fresh`: every cell sends new prompts (a tag before the
user's text), so no server reuses a prompt cache kept in an earlier cell (without it the serial
server may reuse kept recurrent checkpoints that batch rows do not keep).

Any pair by its paths: `--target PATH --draft PATH` (the servers are given the same paths; mlx-lm
reads them as they are), e.g. the random pairs of `benchmarks/make_batch_models.py` (issue 46: a
Qwen3.5-shaped hybrid, a Gemma-3-shaped sliding-window pair). `--workload agent` sends agent-style
requests instead of chat: each client forces a function call (`tools` + a named `tool_choice`)
or a `response_format` json_schema, alternately (the pair's chat template must have a JSON
tool-call format, as make_batch_models.py's has); a call's text is compared as the JSON of its
name and arguments. `--workload subtasks`: an agent's parallel sub-tasks, every client the same
long system prompt (`agent_session.py`'s first sections, ~1,000 tokens; with `--fresh` a new one
per cell, the tag at its start) and a chat prompt of its own.

Run (the machine is shared: one benchmark at a time):
    flock /tmp/bench.lock python benchmarks/serve_batch.py [--reps 3] [--max-tokens 128]
        [--skip "mlx-lm draft"]   (servers left out by the start of their names)
        [--target PATH --draft PATH] [--workload chat|agent|subtasks] [--label NAME] [--fresh]
        [--plain-batch]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works, step by step, for a curious child.",
    "Describe a walk through a busy market in a coastal town at dawn.",
    "Write a letter from a retired astronaut to their younger self.",
    "Explain the rules of chess to someone who has never played a board game.",
    "Describe the life cycle of a star, from its birth to its death.",
    "Write a recipe for a vegetable soup and explain why each step matters.",
    "Tell the history of the bicycle as if you were a tour guide in a museum.",
]


def write_mlx_dirs(pair_name: str, root: Path, pair=None) -> tuple[Path, Path]:
    """The pair's target and draft as MLX model directories (config, weights, tokenizer);
    `pair`: the pair already loaded."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_spec import load_pair

    pair = pair or load_pair(pair_name)
    out = [None, None]  # a pair that drafts with a head has no draft model to write
    for i, (role, model) in enumerate((("target", pair.target), ("draft", pair.draft))):
        if model is None:
            continue
        path = root / role
        path.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in asdict(model.args).items() if v is not None}
        config["eos_token_id"] = list(pair.tokenizer.eos_token_ids)
        weights = dict(tree_flatten(model.parameters()))
        if any(k.endswith(".scales") for k in weights):  # the quantized draft
            q = next(m for _, m in model.named_modules() if hasattr(m, "bits"))
            config["quantization"] = {"group_size": q.group_size, "bits": q.bits}
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        (path / "config.json").write_text(json.dumps(config, indent=2))
        pair.tokenizer._tokenizer.save_pretrained(str(path))
        out[i] = path
    return out[0], out[1]


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server {proc.args} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server {proc.args} never answered")


def start(cmd: list[str], port: int, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_SPEC_API_KEY": ""}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "unit", "days", "alerts"],
    "additionalProperties": False,
}
ALARM = {
    "type": "object",
    "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "label": {"type": "string", "maxLength": 32},
        "repeat": {"enum": ["never", "daily", "weekdays"]},
    },
    "required": ["hour", "label", "repeat"],
    "additionalProperties": False,
}
TOOLS = [_tool("forecast", FORECAST), _tool("alarm", ALARM)]


def agent_body(i: int) -> dict:
    """Client i's agent-style request: a forced function call (even i) or a JSON schema (odd)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from schemas import PROMPTS as SCHEMA_PROMPTS
    from schemas import SCHEMAS

    if i % 2 == 0:
        name = TOOLS[(i // 2) % len(TOOLS)]["function"]["name"]
        return {
            "messages": [{"role": "user", "content": PROMPTS[i]}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": name}},
        }
    kind = list(SCHEMAS)[(i // 2) % len(SCHEMAS)]
    schema = {"name": kind, "schema": SCHEMAS[kind], "strict": True}
    return {
        "messages": [{"role": "user", "content": SCHEMA_PROMPTS[kind]}],
        "response_format": {"type": "json_schema", "json_schema": schema},
    }


def subtask_system() -> str:
    """The sub-tasks' shared system prompt: a coding agent's first sections (agent_session)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from agent_session import SYSTEM_SECTIONS

    return "\n\n".join(SYSTEM_SECTIONS[:4])


def one_request(
    url: str,
    model: str,
    i: int,
    max_tokens: int,
    go: threading.Event,
    workload: str = "chat",
    tag: str = "",
) -> dict:
    if workload == "agent":
        body = agent_body(i)
    else:
        body = {"messages": [{"role": "user", "content": PROMPTS[i]}]}
    if workload == "subtasks":  # one system prompt for all; --fresh: a new one per cell
        system = (f"(session {tag}) " if tag else "") + subtask_system()
        body["messages"].insert(0, {"role": "system", "content": system})
    elif tag:  # a prompt no server has seen (--fresh): no prompt cache reused across cells
        last = body["messages"][-1]
        last["content"] = f"(request {tag}) {last['content']}"
    body.update(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    go.wait()
    start = time.perf_counter()
    first, text, tokens, pieces = None, [], None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                content = delta.get("content")
                for call in delta.get("tool_calls") or []:  # whole calls, one chunk each
                    f = call.get("function") or {}
                    content = (content or "") + json.dumps([f.get("name"), f.get("arguments")])
                if content:
                    if first is None:
                        first = time.perf_counter() - start
                    text.append(content)
                    pieces += 1
    latency = time.perf_counter() - start
    return {"ttft": first or latency, "latency": latency, "text": "".join(text),
            "tokens": tokens if tokens is not None else pieces}  # fmt: skip


def run_cell(
    url: str, model: str, clients: int, max_tokens: int, workload: str = "chat", tag: str = ""
) -> dict:
    go = threading.Event()
    results: list = [None] * clients

    def work(i):
        results[i] = one_request(url, model, i, max_tokens, go, workload, tag)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    begin = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - begin
    return {"wall": wall, "results": results}


def counters(url: str) -> dict[str, float]:
    """The server's unlabelled counters from /metrics (mlx-spec only)."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.endswith("_total") and "{" not in name and not line.startswith("#"):
            out[name.split("mlx_spec_")[-1]] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def report(args, servers: dict, clients: list[int], cells: dict, done: int) -> None:
    """The table so far (after every repetition: a cut-short run still leaves one)."""
    reference = {}  # (clients, rep, prompt index) -> the serial mlx-spec server's text
    for c in clients:  # (the same prompts in every cell unless --fresh: then per cell)
        for rep, cell in enumerate(cells[("mlx-spec serial", c if args.fresh else max(clients))]):
            for i, r in enumerate(cell["results"]):
                reference[(c, rep, i)] = r["text"]
    print(f"\n{args.label}, {args.workload}, greedy, {args.max_tokens} max tokens a request,"
          f" {done} reps (medians)\n")  # fmt: skip
    print("| clients | server | aggregate tok/s | × serial | TTFT p50 / p95 (s) |"
          " latency p50 / p95 (s) | tokens / request | identical |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for c in clients:
        serial = None
        for name in servers:
            reps = cells[(name, c)]
            rate = statistics.median(
                sum(r["tokens"] for r in x["results"]) / x["wall"] for x in reps
            )
            ttft = [
                percentile([r["ttft"] for r in x["results"]], q) for x in reps for q in (0.5, 0.95)
            ]
            lat = [
                percentile([r["latency"] for r in x["results"]], q)
                for x in reps
                for q in (0.5, 0.95)
            ]
            t50, t95 = statistics.median(ttft[0::2]), statistics.median(ttft[1::2])
            l50, l95 = statistics.median(lat[0::2]), statistics.median(lat[1::2])
            same = sum(
                r["text"] == reference[(c, rep if args.fresh else 0, i)]
                for rep, x in enumerate(reps)
                for i, r in enumerate(x["results"])
            )
            total = sum(len(x["results"]) for x in reps)
            mean_tokens = statistics.mean(r["tokens"] for x in reps for r in x["results"])
            serial = serial or rate
            print(f"| {c} | {name} | {rate:.1f} | {rate / serial:.2f} | {t50:.2f} / {t95:.2f} |"
                  f" {l50:.2f} / {l95:.2f} | {mean_tokens:.0f} | {same}/{total} |")  # fmt: skip
            rows.append({"clients": c, "server": name, "tokens_per_second": rate,
                         "tokens_per_second_reps": [sum(r["tokens"] for r in x["results"])
                                                    / x["wall"] for x in reps],
                         "ttft_p50": t50, "ttft_p95": t95, "latency_p50": l50,
                         "latency_p95": l95, "identical": same, "requests": total})  # fmt: skip
    spec = [(c, n) for c in clients for n in servers if all("metrics" in x for x in cells[(n, c)])]
    if spec:  # what the mlx-spec servers counted during the cells (/metrics), summed over reps
        print("\n| clients | server | drafted / accepted | acceptance | tokens / target pass |"
              " batched passes | prefill s | generation s (summed over requests) |")  # fmt: skip
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for c, name in spec:
        m = {}
        for x in cells[(name, c)]:
            for k, v in x["metrics"].items():
                m[k] = m.get(k, 0) + v
        drafted, accepted = m.get("drafted_tokens_total", 0), m.get("accepted_tokens_total", 0)
        passes = m.get("target_passes_total", 0)
        per_pass = m.get("generated_tokens_total", 0) / passes if passes else 0.0
        rate = accepted / drafted if drafted else 0.0
        print(f"| {c} | {name} | {drafted:.0f} / {accepted:.0f} | {rate:.2f} | {per_pass:.2f} |"
              f" {m.get('batch_passes_total', 0):.0f} | {m.get('prefill_seconds_total', 0):.1f} |"
              f" {m.get('generation_seconds_total', 0):.1f} |")  # fmt: skip
        for row in rows:
            if row["clients"] == c and row["server"] == name:
                row["counters"] = m
    if args.json:
        meta = {"pair": args.label, "workload": args.workload, "max_tokens": args.max_tokens,
                "reps": done, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "command": shlex.join(["python", *sys.argv])}  # fmt: skip
        args.json.write_text(json.dumps(rows if args.plain_json else {**meta, "rows": rows},
                                        indent=2))  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", default="smollm2-self")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--num-draft-tokens", default="auto", help="mlx-spec's k (mlx-lm: 3 if auto)")
    p.add_argument("--port", type=int, default=18300)
    p.add_argument("--target", help="the target's path (with --draft: instead of --pair)")
    p.add_argument("--draft", help="the draft's path")
    p.add_argument("--label", help="the pair's name in the table (default: --pair or the path)")
    p.add_argument("--workload", choices=["chat", "agent", "subtasks"], default="chat")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="a new prompt in every cell ('(request REP.CLIENTS) ' before the user's text):"
        " no server reuses a kept prompt cache from an earlier cell",
    )
    p.add_argument(
        "--plain-batch",
        action="store_true",
        help="also `mlx-spec serve --max-batch 8 --no-draft`: the same batch without drafts",
    )
    p.add_argument("--json", type=Path, help="write every measurement here")
    p.add_argument("--plain-json", action="store_true", help="the rows alone, as before")
    p.add_argument(
        "--skip", default="", help="servers to leave out, comma-separated (e.g. 'mlx-lm draft')"
    )
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    root = Path(tempfile.mkdtemp(prefix="serve_batch_"))
    k = args.num_draft_tokens
    mlx_lm_k = "3" if k == "auto" else k
    if args.target:  # paths: every server reads them as they are
        target, draft = Path(args.target), Path(args.draft) if args.draft else None
        which = ["--target", str(target)] + (["--draft", str(draft)] if draft else [])
        args.label = args.label or str(target)
    else:
        target, draft = write_mlx_dirs(args.pair, root)
        which = ["--pair", args.pair]
        args.label = args.label or args.pair
    spec = [sys.executable, "-m", "mlx_spec", "serve", *which,
            "--num-draft-tokens", k, "--log-level", "warning"]  # fmt: skip
    lm = [sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--log-level", "WARNING"]
    servers = {
        "mlx-spec serial": (spec + ["--max-batch", "1"], None),
        "mlx-spec batched": (spec + ["--max-batch", "8"], None),
        "mlx-lm batched (no draft)": (lm, str(target)),
    }
    if args.plain_batch:  # (after mlx-lm's: a name that --skip "mlx-spec batched" leaves)
        servers["plain mlx-spec batched (no draft)"] = (
            spec + ["--max-batch", "8", "--no-draft"],
            None,
        )
    if draft is not None:  # (a head pair: mlx-lm's server has no heads)
        servers["mlx-lm draft (serial)"] = (
            lm + ["--draft-model", str(draft), "--num-draft-tokens", mlx_lm_k],
            str(target),
        )
    skip = [name.strip() for name in args.skip.split(",") if name.strip()]
    servers = {n: v for n, v in servers.items() if not any(n.startswith(x) for x in skip)}
    procs, urls = {}, {}
    try:
        for i, (name, (cmd, model)) in enumerate(list(servers.items())):
            port = args.port + i
            procs[name], urls[name] = start(cmd + ["--port", str(port)], port, root / f"{i}.log")
            if model is None:  # the name mlx-spec serves the pair under
                model = httpx.get(urls[name] + "/v1/models").json()["data"][0]["id"]
                servers[name] = (cmd, model)
            print(f"started {name} on {urls[name]} ({model})", file=sys.stderr)
        for name, (_, model) in servers.items():  # warm-up: first passes compile and page in
            run_cell(urls[name], model, 2, 16, args.workload)
        cells: dict = {}
        for rep in range(args.reps):
            for c in clients:
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for name in order:
                    ours = "mlx-spec" in name
                    before = counters(urls[name]) if ours else None
                    tag = f"{rep}.{c}" if args.fresh else ""
                    cell = run_cell(
                        urls[name], servers[name][1], c, args.max_tokens, args.workload, tag
                    )
                    if ours:
                        after = counters(urls[name])
                        cell["metrics"] = {k: v - before.get(k, 0) for k, v in after.items()}
                    cells.setdefault((name, c), []).append(cell)
                    tokens = sum(r["tokens"] for r in cell["results"])
                    print(f"rep {rep} c={c} {name}: {tokens / cell['wall']:.1f} tok/s",
                          file=sys.stderr)  # fmt: skip
            report(args, servers, clients, cells, rep + 1)
            sys.stdout.flush()
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
