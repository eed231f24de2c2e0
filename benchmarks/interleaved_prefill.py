"""A cached turn that comes while another client's cold prompt prefills (issue 57, item 3).

Starts `mlx-spec serve --pair smollm2-demo --max-batch 8 --prefill-chunk N` for each N of
`--chunks` (a chunk longer than the cold prompt is the server before chunking: one prefill in
one go), and per repetition:

1. warms a conversation (a ~600-token system prompt and a question; a tag per run, so nothing
   is kept from the last one) and reads its reply;
2. cached alone: the next turn of that conversation (a short question after the reply: all but
   a few tokens cached), its time to first token (TTFT);
3. cold alone: a ~4,500-token prompt no cache holds (docs text, a tag first), its TTFT;
4. together: another cold prompt, and `--delay` seconds into its prefill another next turn of
   the warmed conversation: both TTFTs (the cached one's from when it was sent).

Prints each run, the medians and a markdown table (docs/performance.md).

    flock /tmp/bench.lock python benchmarks/interleaved_prefill.py [--reps 3]
        [--chunks 256 65536] [--delay 5]
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

DOCS = Path(__file__).parent.parent / "docs"


def docs_text(chars: int) -> str:
    """`chars` characters of the repository's docs: English prose and code, as agents send."""
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    return text[:chars]


def ask(url: str, model: str, messages: list[dict], max_tokens: int, out: dict) -> None:
    """A greedy streamed chat request: its TTFT, latency, text and prompt figures in `out`."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    begin, first, text, usage = time.perf_counter(), None, "", {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1200) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - begin
                    text += piece
    latency = time.perf_counter() - begin
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out.update(ttft=first if first is not None else latency, latency=latency, text=text,
               prompt=usage.get("prompt_tokens", 0), cached=cached)  # fmt: skip


def one_run(url: str, model: str, rep: int, args) -> dict:
    tag = f"(run {rep}, {time.time():.0f})"
    system = {"role": "system", "content": tag + " You answer questions about this text.\n\n"
              + docs_text(args.system_chars)}  # fmt: skip
    question = {"role": "user", "content": "What does the server do with long prompts?"}
    warm: dict = {}
    ask(url, model, [system, question], args.max_tokens, warm)
    history = [system, question, {"role": "assistant", "content": warm["text"]}]

    def turn(text: str) -> list[dict]:
        return history + [{"role": "user", "content": text}]

    def cold(kind: str) -> list[dict]:
        return [{"role": "user", "content": f"{tag} {kind}: summarize this.\n\n"
                 + docs_text(args.cold_chars)}]  # fmt: skip

    cached_alone, cold_alone, cached_with, cold_with = {}, {}, {}, {}
    ask(url, model, turn("Thanks. Name one flag."), args.max_tokens, cached_alone)
    ask(url, model, cold("alone"), args.max_tokens, cold_alone)
    a = threading.Thread(target=ask, args=(url, model, cold("together"), args.max_tokens,
                                           cold_with))  # fmt: skip
    a.start()
    time.sleep(args.delay)
    ask(url, model, turn("Thanks. Name another flag."), args.max_tokens, cached_with)
    a.join()
    return {"cached alone": cached_alone, "cached with cold": cached_with,
            "cold alone": cold_alone, "cold with cached": cold_with}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="smollm2-demo")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 65536])
    p.add_argument("--delay", type=float, default=5.0, help="seconds into the cold prefill")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-chars", type=int, default=2400)
    p.add_argument("--cold-chars", type=int, default=14500)
    p.add_argument("--port", type=int, default=18460)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="interleaved_prefill_"))
    rows = []
    for chunk in args.chunks:
        cmd = [sys.executable, "-m", "mlx_spec", "serve", "--pair", args.pair, "--max-batch",
               "8", "--prefill-chunk", str(chunk), "--log-level", "warning",
               "--port", str(args.port)]  # fmt: skip
        proc, url = start(cmd, args.port, root / f"serve-{chunk}.log")
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            runs = []
            for rep in range(args.reps):
                run = one_run(url, model, rep, args)
                runs.append(run)
                print(f"chunk {chunk} rep {rep}: " + "; ".join(
                    f"{k} ttft {r['ttft']:.2f} s ({r['prompt']} tokens, {r['cached']} cached)"
                    for k, r in run.items()), flush=True)  # fmt: skip
            med = {k: statistics.median(r[k]["ttft"] for r in runs) for k in runs[0]}
            prompts = {k: runs[0][k]["prompt"] for k in runs[0]}
            cached = {k: runs[0][k]["cached"] for k in runs[0]}
            rows.append((chunk, med, prompts, cached, runs))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(f"\n{args.pair}, --max-batch 8, medians of {args.reps} (TTFT, seconds; the cached"
          f" turn sent {args.delay:g} s into the cold prefill):\n")  # fmt: skip
    print("| --prefill-chunk | cached turn alone | cached turn during cold prefill | cold alone"
          " | cold with the cached turn | cold slowdown |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for chunk, med, _, _, runs in rows:
        each = {k: ", ".join(f"{r[k]['ttft']:.1f}" for r in runs) for k in med}
        print(f"| {chunk} | {med['cached alone']:.2f} ({each['cached alone']})"
              f" | {med['cached with cold']:.2f} ({each['cached with cold']})"
              f" | {med['cold alone']:.1f} ({each['cold alone']})"
              f" | {med['cold with cached']:.1f} ({each['cold with cached']})"
              f" | {med['cold with cached'] / med['cold alone']:.2f}x |")  # fmt: skip
    _, _, prompts, cached, _ = rows[0]
    print(
        f"\nprompts: cached turn {prompts['cached alone']} tokens ({cached['cached alone']}"
        f" cached), cold {prompts['cold alone']} tokens ({cached['cold alone']} cached)"
    )


if __name__ == "__main__":
    main()
