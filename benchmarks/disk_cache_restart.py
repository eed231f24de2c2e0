"""The prompt cache's disk tier across a restart (issue 56): a long prompt's first request on a
cold server, then the same prompt after a clean stop and after `kill -9`, each on a fresh
server over the same --cache-dir. Prints per repetition and as medians: time to first token,
prefilled tokens (prompt - cached), and the load rate against the prefill rate (tokens per
second of the cold prefill vs tokens per second of the file load, from /metrics).

    flock /tmp/bench.lock python benchmarks/disk_cache_restart.py [--pair smollm2-demo]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from interleaved_prefill import ask  # noqa: E402
from serve_batch import start  # noqa: E402

WORDS = "the parser reads each file and reports the line where a rule fails".split()


def long_prompt(words: int) -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]}{i % 97}" for i in range(words))


def ask_system(url: str, model: str, system: str) -> dict:
    """The session's one request (4 tokens of reply): its TTFT and prompt figures."""
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Which rule fails first?"}]  # fmt: skip
    out: dict = {}
    ask(url, model, messages, 4, out)
    return out


def figures(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="smollm2-demo")
    p.add_argument("--words", type=int, default=1400, help="system prompt words (~4,000 tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=18470)
    args = p.parse_args()
    rows = []
    for rep in range(args.reps):
        root = Path(tempfile.mkdtemp(prefix="disk_cache_restart_"))
        cmd = [sys.executable, "-m", "mlx_spec", "serve", "--pair", args.pair, "--log-level",
               "warning", "--port", str(args.port), "--cache-dir", str(root / "cache")]  # fmt: skip
        system = long_prompt(args.words) + f" (run {rep})"
        row = {}
        for phase in ("cold", "after stop", "after kill -9"):
            proc, url = start(cmd, args.port, root / f"{phase}.log")
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            result = ask_system(url, model, system)
            m = figures(url)
            if phase == "cold":
                prefill = m["mlx_spec_prefill_seconds_total"]
                row["prefill_rate"] = (result["prompt"] - result["cached"]) / prefill
            else:
                load = m.get("mlx_spec_disk_cache_load_seconds_total", 0.0)
                row[f"load_rate {phase}"] = result["cached"] / load if load else 0.0
            row[phase] = result
            if phase == "after stop":
                proc.send_signal(signal.SIGKILL)  # (its entries were written as kept)
                proc.wait(30)
            else:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| run | prompt tokens | prefilled | time to first token (s) |")
    print("|---|---|---|---|")
    for phase in ("cold", "after stop", "after kill -9"):
        ttft = statistics.median(r[phase]["ttft"] for r in rows)
        pre = statistics.median(r[phase]["prompt"] - r[phase]["cached"] for r in rows)
        print(f"| {phase} | {rows[0][phase]['prompt']} | {pre:.0f} | {ttft:.2f} |")
    rate = statistics.median(r["prefill_rate"] for r in rows)
    loads = [v for r in rows for k, v in r.items() if k.startswith("load_rate") and v]
    load = statistics.median(loads) if loads else 0.0
    print(f"\nprefill {rate:.0f} tokens/s, load {load:.0f} tokens/s ({load / rate:.1f}x)")


if __name__ == "__main__":
    main()
