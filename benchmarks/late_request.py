"""A short request that comes while a long one decodes alone (issue 46): how long it waits.

Starts `mlx-spec serve --max-batch 8` on a pair whose lone request runs as a single stream (a
head's, a recurrent target's), sends a long greedy chat request, and `--delay` seconds later a
short one; prints each one's time to first token and latency, per repetition and as medians.
Before 2026-12-04 the short one waited for the whole long reply; now the long stream moves
into the batch between two rounds and the short one is served beside it.

    flock /tmp/bench.lock python benchmarks/late_request.py [--pair smollm2-demo] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_batch import start  # noqa: E402


def ask(url: str, model: str, prompt: str, max_tokens: int, out: dict) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    begin, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or []
                if any((c.get("delta") or {}).get("content") for c in choices):
                    first = time.perf_counter() - begin
    latency = time.perf_counter() - begin
    out.update(ttft=first if first is not None else latency, latency=latency)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="smollm2-demo")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--long-tokens", type=int, default=150)
    p.add_argument("--short-tokens", type=int, default=8)
    p.add_argument("--delay", type=float, default=1.0, help="seconds between the two requests")
    p.add_argument("--port", type=int, default=18450)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="late_request_"))
    cmd = [sys.executable, "-m", "mlx_spec", "serve", "--pair", args.pair, "--max-batch", "8",
           "--log-level", "warning", "--port", str(args.port)]  # fmt: skip
    proc, url = start(cmd, args.port, root / "serve.log")
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        runs = []
        for rep in range(args.reps):
            long, short = {}, {}
            tag = f"(run {rep}) "  # no kept caches from the last repetition
            a = threading.Thread(
                target=ask,
                args=(url, model, tag + "Tell me a long story about a dragon.",
                      args.long_tokens, long),
            )  # fmt: skip
            a.start()
            time.sleep(args.delay)
            ask(url, model, tag + "Say hi.", args.short_tokens, short)
            a.join()
            runs.append((long, short))
            times = [f"{n} ttft {r['ttft']:.2f} s, latency {r['latency']:.2f} s"
                     for n, r in (("long", long), ("short", short))]  # fmt: skip
            print(f"rep {rep}: " + "; ".join(times))
        med = {
            f"{name} {what}": statistics.median(r[i][what] for r in runs)
            for i, name in enumerate(("long", "short"))
            for what in ("ttft", "latency")
        }
        print(f"\n{args.pair}, medians of {args.reps}: " + ", ".join(
            f"{k} {v:.2f} s" for k, v in med.items()))  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
