"""Suffix decoding (issue 60) on the demo target: a file rewritten with a few edits, and chat,
against plain decoding, today's prompt lookup (`ngram`) and the EAGLE-3 head alone.

Workloads (greedy unless --temps says otherwise):
- rewrite: the session trace's rewrite turn (benchmarks/agent_session.py): tally/models.py in
  the prompt, "rewrite it in full with a due date"; the reply copies most of the file.
- rewrite-fresh: the same request again in a new context (an agent that retries): the
  earlier prompt and its reply are in the key's history (as `mlx-spec serve` keeps it per
  API key; here an index handed to the drafter: HistoryIndex for ngram, SuffixHistory for
  suffix).
- chat: benchmarks/chat_prompts.txt.
Configurations: plain; ngram (auto k); the head at the pair's k (1) and at auto; suffix (auto);
suffix+eagle3 at the pair's k and at auto. Runs rotate their order, medians of tokens/s (first
token to last), ratios of medians within this run; every greedy output checked against plain.

    flock /tmp/bench.lock python benchmarks/suffix_decoding.py [--runs 3] [--only ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from mlx_spec import stream
from mlx_spec.core.stats import Stats
from mlx_spec.decode.generate import make_decoder
from mlx_spec.decode.history import HistoryIndex
from mlx_spec.decode.prompts import encode_prompt
from mlx_spec.drafters.suffix import SuffixHistory
from mlx_spec.pairs.loading import load_pair, pair_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_session as S  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEMO = "smollm2-demo"

CONFIGS = {
    "plain": {"skip_draft": True},
    "ngram (auto)": {"drafter": "ngram", "num_draft_tokens": "auto"},
    "head k=1": {},
    "head auto": {"num_draft_tokens": "auto"},
    "suffix (auto)": {"drafter": "suffix", "num_draft_tokens": "auto"},
    "suffix+eagle3 k=1": {"drafter": "suffix+eagle3", "num_draft_tokens": 1},
    "suffix+eagle3 auto": {"drafter": "suffix+eagle3", "num_draft_tokens": "auto"},
}


def rewrite_messages() -> list[dict]:
    file = S.FILES["tally/models.py"]
    return [
        {
            "role": "user",
            "content": f"Here is tally/models.py:\n```python\n{file}```\n\n{S.REWRITE}",
        }
    ]


def run(pair, ids, max_tokens, temperature, seed, history=None):
    stats = Stats()
    decoder = make_decoder(pair, seed)
    if history is not None and decoder.drafter is not None:
        decoder.drafter.use_history(history)
    use_draft = pair.config.drafter is not None
    tokens, first, last = [], None, None
    for e in stream(pair, ids, max_tokens=max_tokens, temperature=temperature, seed=seed,
                    decoder=decoder, stats=stats, use_draft=use_draft):  # fmt: skip
        now = time.perf_counter()
        first = first or now
        last = now
        tokens.append(e.token)
    tps = (len(tokens) - 1) / (last - first) if len(tokens) > 1 and last > first else 0.0
    lookup = (stats.controller or {}).get("lookup", {})
    return {"tokens": tokens, "tps": tps, "passes": stats.target_passes,
            "drafted": stats.drafted, "accepted": stats.accepted,
            "lengths": list(stats.draft_lengths), "lookup": lookup}  # fmt: skip


def histories(pair, ids, reply):
    """The key's history after one earlier rewrite: (ngram's, suffix's)."""
    h, s = HistoryIndex(), SuffixHistory()
    h.add(ids + reply)
    s.add(ids + reply)
    return h, s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    # the session trace's own default (agent_trace.py --rewrite-tokens)
    p.add_argument("--rewrite-tokens", type=int, default=640)
    p.add_argument("--chat-tokens", type=int, default=128)
    p.add_argument("--temps", default="0")
    p.add_argument("--only", help="configurations, comma-separated")
    p.add_argument("--workloads", default="rewrite,rewrite-fresh,chat")
    args = p.parse_args(argv)
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    if "plain" not in names:
        names.insert(0, "plain")
    pairs = {}
    for n in names:
        print(f"loading {n}…", file=sys.stderr)
        pairs[n] = load_pair(pair_config(DEMO, **CONFIGS[n]))
    tok = pairs["plain"].tokenizer
    rewrite_ids = encode_prompt(tok, rewrite_messages())
    text = (ROOT / "benchmarks/chat_prompts.txt").read_text()
    chats = [line.strip() for line in text.splitlines() if line.strip()]
    jobs = []  # (workload, prompt index, ids, max_tokens)
    workloads = args.workloads.split(",")
    if "rewrite" in workloads:
        jobs.append(("rewrite", 0, rewrite_ids, args.rewrite_tokens))
    if "chat" in workloads:
        for i, c in enumerate(chats):
            ids = encode_prompt(tok, [{"role": "user", "content": c}])
            jobs.append(("chat", i, ids, args.chat_tokens))
    fresh = "rewrite-fresh" in workloads
    temps = [float(t) for t in args.temps.split(",")]
    results = []  # (workload, name, T, prompt, run, result)
    earlier = None  # the plain rewrite's reply: the history of rewrite-fresh
    for r in range(args.runs):
        if r:  # the table so far (a long run may be cut short)
            print(f"after {r} run(s):\n{table(results, names, temps)}\n", flush=True)
        for t in temps:
            todo = list(jobs)
            if fresh:
                todo.append(("rewrite-fresh", 0, rewrite_ids, args.rewrite_tokens))
            for w, i, ids, max_tokens in todo:
                shift = (r + i) % len(names)
                for n in names[shift:] + names[:shift]:
                    history = None
                    if w == "rewrite-fresh":
                        if earlier is None:
                            earlier = run(pairs["plain"], rewrite_ids, max_tokens, 0.0, 0)["tokens"]
                        h, s = histories(pairs[n], rewrite_ids, earlier)
                        kind = pairs[n].config.drafter or ""
                        history = s if kind.startswith("suffix") else h
                    res = run(pairs[n], ids, max_tokens, t, r, history)
                    results.append((w, n, t, i, r, res))
                    print(f"run {r + 1} {w} {i} T={t} {n}: {res['tps']:.1f} tok/s "
                          f"{len(res['tokens'])} tokens {res['passes']} passes",
                          file=sys.stderr)  # fmt: skip
    print(table(results, names, temps))
    return 0


def table(results, names, temps) -> str:
    lines = [
        "| workload | configuration | T | median tok/s | × plain | × ngram | × head k=1 "
        "| tokens / pass | draft lengths used (rounds) | greedy = plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in dict.fromkeys(x[0] for x in results):
        for t in temps:
            med = {}
            for n in names:
                xs = [res["tps"] for ww, nn, tt, _, _, res in results if (ww, nn, tt) == (w, n, t)]
                if xs:
                    med[n] = statistics.median(xs)
            plain = {(i, r): res["tokens"] for ww, nn, tt, i, r, res in results
                     if (ww, nn, tt) == (w, "plain", t)}  # fmt: skip
            for n in names:
                mine = [
                    (i, r, res) for ww, nn, tt, i, r, res in results if (ww, nn, tt) == (w, n, t)
                ]
                if not mine:
                    continue
                tokens = sum(len(res["tokens"]) for *_, res in mine)
                passes = sum(res["passes"] for *_, res in mine)
                lengths = {}
                for *_, res in mine:
                    for k, c in enumerate(res["lengths"]):
                        if k and c:
                            lengths[k] = lengths.get(k, 0) + c
                used = ", ".join(f"{k}:{c}" for k, c in sorted(lengths.items())) or "–"
                same = all(res["tokens"] == plain[i, r] for i, r, res in mine) if t == 0 else None

                def ratio(other, med=med, n=n):
                    return f"{med[n] / med[other]:.2f}x" if other in med else "–"

                lines.append(
                    f"| {w} | {n} | {t:g} | {med[n]:.1f} | {ratio('plain')} | "
                    f"{ratio('ngram (auto)')} | {ratio('head k=1')} | {tokens / passes:.2f} | "
                    f"{used} | {'–' if same is None else ('yes' if same else 'NO')} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
