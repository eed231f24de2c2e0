"""Claude Code, Codex CLI and OpenCode, installed from npm, end to end on `mlx-spec serve`, with
their own file-read tools (issue 57, item 6). Opt-in: it needs npm and takes minutes.

For each client a scripted model (tests/tiny.py `write_scripted_tool_model`) is written whose
tool call is the client's own read tool on a file this script writes (`Read` with `file_path`,
Codex's `exec_command` with `cat`, OpenCode's `read` with `filePath`) and whose answer, once the
tool's result is back in the prompt, quotes the file's marker. `mlx-spec serve` runs it with an
API key behind a logging proxy (this script) that keeps every request body and reply, and the
client is run headless on three tasks:

  plain   a question that needs no tool: the scripted plain reply, no tool call
  read    "read the file": the model calls the client's tool, the client runs it and sends the
          result back, the model's answer quotes the file's marker
  resume  the same session continued (`claude -p --continue`, `codex exec resume --last`,
          `opencode run --continue`): the history, tool result included, is resent and the
          answer quotes the marker again

Printed: client, version, task, exit code, whether the server wrote a call to the client's tool,
whether a request carried that tool's result (with the marker), whether the answer has the
marker, and every HTTP status >= 400. `--discover` instead prints the tools each client sends
(names and argument schemas) after a plain question.

    PYTHONPATH=. python benchmarks/real_agents.py [--npm-prefix DIR] [--clients claude,codex]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MARKER = "MARKER-7f3a"
FILE = "notes-7f3a.txt"
CONTENT = f"These notes are for the mlx-spec agent test.\nThe marker is {MARKER}.\n"
ANSWER = f"The file says: the marker is {MARKER}."
PREAMBLE = "Let me read the file."
PLAIN = "Hello from the scripted model."
KEY = "sk-real-agents"
MODEL = "scripted"
CONTEXT = 131072  # Claude Code's prompt alone is tens of thousands of tokens
OUTPUT = 1024
PROMPTS = {
    "plain": "Say hello.",
    "read": f"Read the file {FILE} and quote its marker.",
    "resume": "Say the marker again.",
}
PACKAGES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "opencode": "opencode-ai",
}


def tool_call(client: str, path: Path) -> dict:
    """The call each client's own read tool takes (names and schemas from `--discover`)."""
    if client == "claude":
        return {"name": "Read", "arguments": {"file_path": str(path)}}
    if client == "codex":
        return {"name": "exec_command", "arguments": {"cmd": f"cat {path.name}"}}
    return {"name": "read", "arguments": {"filePath": str(path)}}


# ------------------------------------------------------------------ the logging proxy


class Log:
    def __init__(self):
        self.entries: list[dict] = []
        self.lock = threading.Lock()

    def add(self, entry: dict) -> None:
        with self.lock:
            self.entries.append(entry)

    def since(self, n: int) -> list[dict]:
        with self.lock:
            return list(self.entries[n:])


def make_proxy(upstream: str, log: Log) -> ThreadingHTTPServer:
    host, port = upstream.split(":")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def relay(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
            }
            entry = {"method": self.command, "path": self.path, "request": body, "t": time.time()}
            conn = http.client.HTTPConnection(host, int(port), timeout=900)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                entry["status"] = resp.status
                entry["ignored"] = resp.getheader("X-Ignored-Fields")
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                out = []
                while self.command != "HEAD":
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    out.append(chunk)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                if self.command != "HEAD":
                    self.wfile.write(b"0\r\n\r\n")
                entry["response"] = b"".join(out)
            except OSError as err:
                entry.setdefault("status", 599)
                entry["error"] = repr(err)
            finally:
                conn.close()
                log.add(entry)

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = relay

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def body_json(entry: dict):
    try:
        return json.loads(entry["request"])
    except (ValueError, UnicodeDecodeError):
        return None


def carries_result(body, marker: str) -> bool:
    """A request that sends a tool's result holding `marker` (Messages tool_result blocks,
    Responses function_call_output items, chat completions tool messages)."""
    if not isinstance(body, dict):
        return False
    found = []
    for m in body.get("messages") or []:
        if m.get("role") == "tool":
            found.append(m)
        if isinstance(m.get("content"), list):
            found += [
                b for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"
            ]
    items = body.get("input") if isinstance(body.get("input"), list) else []
    found += [i for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
    return any(marker in json.dumps(f) for f in found)


def wrote_call(entry: dict, name: str) -> bool:
    """The server's reply holds a call to `name` (any of the three protocols, streamed or not)."""
    text = entry.get("response", b"").decode("utf-8", "replace")
    kinds = ('"tool_use"', '"function_call"', '"tool_calls"')
    return any(k in text for k in kinds) and f'"name":"{name}"' in text.replace(": ", ":")


# ------------------------------------------------------------------ the server


def start_server(model: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [
        sys.executable, "-m", "mlx_spec", "serve", "--target", str(model), "--drafter", "ngram",
        "--port", "0", "--api-key", KEY, "--max-tokens-limit", str(OUTPUT),
        "--no-disk-cache", "--log-level", "info",
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=120):
        proc.kill()
        raise RuntimeError(f"the server printed nothing in 120 s (see {log_path})")
    match = re.search(r"on http://(\S+)/v1", proc.stdout.readline())
    if not match:
        proc.kill()
        raise RuntimeError(f"the server did not start (see {log_path})")
    hostport = match.group(1)
    for _ in range(200):
        try:
            c = http.client.HTTPConnection(*hostport.split(":"), timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, hostport
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server never answered /health")


# ------------------------------------------------------------------ the clients


def client_env(home: Path, npm_bin: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env.update(HOME=str(home), PATH=f"{npm_bin}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1")
    env["XDG_CONFIG_HOME"] = str(home / ".config")
    env["XDG_DATA_HOME"] = str(home / ".local/share")
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    env["XDG_STATE_HOME"] = str(home / ".local/state")
    return env


def setup_claude(base: str, home: Path, work: Path, env: dict) -> None:
    env.update(
        ANTHROPIC_BASE_URL=base,
        ANTHROPIC_API_KEY=KEY,
        ANTHROPIC_MODEL=MODEL,
        ANTHROPIC_SMALL_FAST_MODEL=MODEL,
        CLAUDE_CODE_AUTO_COMPACT_WINDOW=str(CONTEXT),
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(OUTPUT),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )


def setup_codex(base: str, home: Path, work: Path, env: dict) -> None:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f"""model = "{MODEL}"
model_provider = "mlx-spec"
model_context_window = {CONTEXT}
model_auto_compact_token_limit = {CONTEXT - 8192}
model_max_output_tokens = {OUTPUT}

[model_providers.mlx-spec]
name = "mlx-spec"
base_url = "{base}/v1"
wire_api = "responses"
env_key = "MLX_SPEC_API_KEY"
"""
    )
    env.update(CODEX_HOME=str(codex_home), MLX_SPEC_API_KEY=KEY)


def setup_opencode(base: str, home: Path, work: Path, env: dict) -> None:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlx-spec": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx-spec",
                "options": {"baseURL": f"{base}/v1", "apiKey": "{env:MLX_SPEC_API_KEY}"},
                "models": {MODEL: {"limit": {"context": CONTEXT, "output": OUTPUT}}},
            }
        },
        "model": f"mlx-spec/{MODEL}",
        "small_model": f"mlx-spec/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
    }
    (work / "opencode.json").write_text(json.dumps(config, indent=2))
    env.update(
        MLX_SPEC_API_KEY=KEY,
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_SHARE="1",
    )


def command(client: str, task: str) -> list[str]:
    prompt = PROMPTS[task]
    if client == "claude":
        cmd = ["claude", "-p", prompt, "--output-format", "json", "--allowedTools", "Read"]
        return cmd + (["--continue"] if task == "resume" else [])
    if client == "codex":
        # (`exec resume` takes no --sandbox: the config key does for both)
        flags = ["--skip-git-repo-check", "-c", 'sandbox_mode="read-only"']
        flags += ["-o", "last_message.txt"]
        if task == "resume":
            return ["codex", "exec", "resume", "--last", *flags, prompt]
        return ["codex", "exec", *flags, prompt]
    cmd = ["opencode", "run", "--format", "json", "--auto", "--print-logs"]
    return cmd + (["--continue"] if task == "resume" else []) + [prompt]


def answer_of(client: str, stdout: str, work: Path) -> str:
    if client == "claude":
        try:
            return str(json.loads(stdout).get("result", ""))
        except ValueError:
            return stdout
    if client == "codex":
        last = work / "last_message.txt"
        return last.read_text() if last.exists() else stdout
    texts = []
    for line in stdout.splitlines():  # opencode --format json: one event a line
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        part = ev.get("part") if isinstance(ev, dict) else None
        if isinstance(part, dict) and part.get("type") == "text":
            texts.append(part.get("text", ""))
    return "\n".join(texts) or stdout


SETUP = {"claude": setup_claude, "codex": setup_codex, "opencode": setup_opencode}


def version_of(npm_prefix: Path, client: str) -> str:
    pkg = npm_prefix / "node_modules" / PACKAGES[client] / "package.json"
    return json.loads(pkg.read_text())["version"]


def install(prefix: Path, clients: list[str]) -> None:
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(prefix)]
        + [PACKAGES[c] for c in clients],
        check=True,
    )


def run_client(client, npm_prefix, scratch, timeout, discover=False) -> list[dict]:
    from tiny import write_scripted_tool_model

    root = scratch / client
    work, home = root / "work", root / "home"
    work.mkdir(parents=True)
    home.mkdir()
    target = work / FILE
    target.write_text(CONTENT)
    call = tool_call(client, target)
    corpus = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    corpus.append((ROOT / "benchmarks" / "agent_session.py").read_text())
    model = write_scripted_tool_model(
        root, call, ANSWER, trigger=FILE, plain=PLAIN, recall="again", preamble=PREAMBLE,
        corpus=corpus, vocab_size=4000, context=CONTEXT,
    )  # fmt: skip
    proc, hostport = start_server(model, root / "server.log")
    log = Log()
    proxy = make_proxy(hostport, log)
    base = f"http://127.0.0.1:{proxy.server_address[1]}"
    env = client_env(home, npm_prefix / "node_modules" / ".bin")
    env["PWD"] = str(work)  # (OpenCode takes its directory from PWD, not the process's cwd)
    SETUP[client](base, home, work, env)
    version = version_of(npm_prefix, client)
    rows = []
    try:
        for task in ["plain"] if discover else ["plain", "read", "resume"]:
            start = len(log.entries)
            (work / "last_message.txt").unlink(missing_ok=True)
            t0 = time.time()
            try:
                done = subprocess.run(
                    command(client, task), cwd=work, env=env, capture_output=True, text=True,
                    timeout=timeout, stdin=subprocess.DEVNULL,
                )  # fmt: skip
                rc, out, err = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired as e:
                rc = "timeout"
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            (root / f"{task}.stdout").write_text(out)
            (root / f"{task}.stderr").write_text(err)
            entries = log.since(start)
            dump = [
                {
                    "method": e["method"], "path": e["path"], "status": e.get("status"),
                    "ignored": e.get("ignored"),
                    "request": body_json(e) or e["request"].decode("utf-8", "replace"),
                    "response": e.get("response", b"").decode("utf-8", "replace"),
                }
                for e in entries
            ]  # fmt: skip
            (root / f"{task}.requests.json").write_text(json.dumps(dump, indent=1))
            answer = answer_of(client, out, work)
            rows.append(
                {
                    "client": client,
                    "version": version,
                    "task": task,
                    "exit": rc,
                    "seconds": round(time.time() - t0, 1),
                    "requests": len(entries),
                    "tool_call": any(wrote_call(e, call["name"]) for e in entries),
                    "tool_result": any(carries_result(body_json(e), MARKER) for e in entries),
                    "marker": MARKER in answer,
                    "plain": PLAIN in answer,
                    "errors": [
                        f"{e['method']} {e['path']} {e.get('status')}"
                        for e in entries
                        if (e.get("status") or 0) >= 400
                    ],
                    "answer": answer.strip()[:200],
                    "stderr": err.strip()[-400:],
                }
            )
            if discover:
                for e in entries:
                    body = body_json(e)
                    if isinstance(body, dict) and body.get("tools"):
                        print(f"== {client} {e['path']}")
                        for t in body["tools"]:
                            print(" ", json.dumps(t)[:600])
                        break
    finally:
        proxy.shutdown()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


def ok(row: dict) -> bool:
    if row["exit"] != 0 or row["errors"]:
        return False
    if row["task"] == "plain":
        return row["plain"] and not row["tool_call"]
    if row["task"] == "read":
        return row["tool_call"] and row["tool_result"] and row["marker"]
    return row["tool_result"] and row["marker"]  # the resent history, and the answer


def table(rows: list[dict]) -> str:
    head = ["client", "version", "task", "exit", "s", "reqs", "tool call", "tool result",
            "marker", "HTTP errors", "ok"]  # fmt: skip
    lines = [head]
    for r in rows:
        yes = {True: "yes", False: "no"}
        lines.append(
            [
                r["client"], r["version"], r["task"], str(r["exit"]), str(r["seconds"]),
                str(r["requests"]), yes[r["tool_call"]], yes[r["tool_result"]], yes[r["marker"]],
                ", ".join(r["errors"]) or "none", yes[ok(r)],
            ]
        )  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]

    def fmt(line: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(lines[0]), sep, *map(fmt, lines[1:])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--npm-prefix", type=Path, help="clients already installed here (else a temp dir)"
    )
    ap.add_argument("--clients", default="claude,codex,opencode")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per client run")
    ap.add_argument("--keep", type=Path, help="keep logs, request bodies and models here")
    ap.add_argument("--discover", action="store_true", help="print the tools each client sends")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    clients = args.clients.split(",")
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="real-agents-"))
    scratch.mkdir(parents=True, exist_ok=True)
    prefix = args.npm_prefix
    if prefix is None:
        prefix = scratch / "npm"
        install(prefix, clients)
    rows = []
    for client in clients:
        try:
            rows += run_client(client, prefix, scratch, args.timeout, args.discover)
        except Exception as err:  # noqa: BLE001  one client's failure is a row, not the end
            print(f"{client}: {type(err).__name__}: {err}", file=sys.stderr)
        if rows:
            print(table([r for r in rows if r["client"] == client]), flush=True)
    print()
    print(table(rows))
    for r in rows:
        if not ok(r):
            print(f"\n{r['client']} {r['task']}: answer {r['answer']!r}\n  stderr: {r['stderr']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\nlogs, request bodies and models: {scratch}")
    if args.keep is None and all(ok(r) for r in rows):
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if rows and all(ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
