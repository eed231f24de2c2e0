"""Interleaved benchmark: mlx-lm plain, mlx-lm speculative, mlx-spec plain and speculative.

All configurations run in one process over the same prompts, interleaved run by run, so a
noisy machine slows them alike; compare ratios inside one run, never single timings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.generate import generation_stream, stream_generate
from mlx_lm.sample_utils import make_sampler

from ..core.stats import Stats
from ..decode.generate import stream
from ..decode.prompts import encode_prompt

SUMMARY_SOURCE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
    "individual reefs and 900 islands stretching for over 2,300 kilometres. It is located in the "
    "Coral Sea, off the coast of Queensland, Australia. The reef can be seen from outer space and "
    "is the world's biggest single structure made by living organisms. It supports a wide "
    "diversity of life and was selected as a World Heritage Site in 1981. Climate change, "
    "pollution and crown-of-thorns starfish outbreaks threaten it, and mass coral bleaching "
    "events in 2016, 2017 and 2020 damaged large parts of the reef."
)
# An edit the 135M demo model really performs (it rewrote a shorter function from scratch
# instead of renaming a variable in it, so that prompt measured paraphrase, not editing).
CODE_TO_EDIT = """def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    data.setdefault("port", 8080)
    data.setdefault("debug", False)
    return data
"""
PROMPTS = {
    "chat": "What are three tips for staying focused while working from home?",
    "code": "Write a Python function that checks whether a string is a palindrome.",
    "summarisation": f"Summarise this text in two sentences:\n\n{SUMMARY_SOURCE}",
    "long answer": "Explain in detail how a refrigerator keeps food cold.",
    "code edit": "Change the default port from 8080 to 9000 in this function and show the whole "
    f"function:\n\n```python\n{CODE_TO_EDIT}```",
}
MLX_LM, MLX_LM_SPEC, MLX_SPEC = "mlx-lm", "mlx-lm speculative", "mlx-spec"


@dataclass
class Run:
    config: str
    k: int | str  # 0: no draft; "auto": adaptive
    temperature: float
    prompt: str
    tokens: list[int]
    tokens_per_second: float  # (tokens - 1) / (last token time - first token time)
    drafted: int
    accepted: int
    target_passes: int
    peak_memory_gb: float
    draft_steps: int = 0  # draft-model forward passes
    plain_tokens: int = 0  # `auto`: tokens it decoded plainly (k = 0)
    controller: str = ""  # `auto`: the controller's state at the end of the run
    collectives: int = 0  # a sharded target (mlx-spec runs): collectives while generating
    collective_seconds: float = 0.0  # estimated time in them
    generation_seconds: float = 0.0


def _timed(events):
    """Consume (token, from_draft) pairs; tokens/s between the first and the last token."""
    tokens, flags, first, last = [], [], None, None
    for token, from_draft in events:
        now = time.perf_counter()
        first = first or now
        last = now
        tokens.append(token)
        flags.append(from_draft)
    tps = (len(tokens) - 1) / (last - first) if len(tokens) > 1 and last > first else 0.0
    return tokens, flags, tps


def run_mlx_lm(pair, prompt_ids, max_tokens, temperature, k, seed) -> Run:
    mx.random.seed(seed)
    mx.reset_peak_memory()
    draft = {"draft_model": pair.draft, "num_draft_tokens": k} if k else {}
    responses = stream_generate(
        pair.target,
        pair.tokenizer,
        prompt_ids,
        max_tokens=max_tokens,
        sampler=make_sampler(temperature),
        **draft,
    )
    eos = pair.tokenizer.eos_token_ids
    tokens, flags, tps = _timed(
        (r.token, r.from_draft) for r in responses if r.token not in eos or r.finish_reason is None
    )
    # mlx-lm leaves a look-ahead step running on its own stream (it waits for it only on
    # Metal): it would steal time from the next run, and on a sharded target its all-reduces
    # would interleave with the next run's and corrupt them
    mx.synchronize(generation_stream)
    accepted = sum(flags)
    passes = len(flags) - accepted  # every mlx-lm round ends in one target token
    return Run(
        MLX_LM_SPEC if k else MLX_LM,
        k,
        temperature,
        "",
        tokens,
        tps,
        passes * k,
        accepted,
        passes,
        mx.get_peak_memory() / 1e9,
        passes * k,  # mlx-lm drafts k tokens a round, one pass each
    )


def run_mlx_spec(pair, prompt_ids, max_tokens, temperature, k, seed) -> Run:
    stats = Stats()
    events = stream(
        pair,
        prompt_ids,
        max_tokens=max_tokens,
        temperature=temperature,
        num_draft_tokens=k or None,  # k = 0: plain decoding (None: the pair's k, unused)
        use_draft=bool(k),
        seed=seed,
        stats=stats,
    )
    tokens, _, tps = _timed((e.token, e.accepted) for e in events)
    return Run(
        MLX_SPEC,
        k,
        temperature,
        "",
        tokens,
        tps,
        stats.drafted,
        stats.accepted,
        stats.target_passes,
        stats.peak_memory_gb,
        stats.draft_steps,
        stats.plain_tokens,
        (stats.controller or {}).get("state", ""),
        stats.collectives,
        stats.collective_seconds,
        stats.generation_seconds,
    )


def mlx_lm_speculates(pair) -> bool:
    """Whether mlx-lm's speculative path takes this pair: a draft model, and caches it can
    trim (it raises for a recurrent state: Qwen3.5, Mamba)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    if pair.draft is None:
        return False
    return all(can_trim_prompt_cache(make_prompt_cache(m)) for m in (pair.target, pair.draft))


def bench_configs(pair, ks) -> list:
    """(runner, k) of every configuration a run of the prompts goes through."""
    configs = [(run_mlx_lm, 0), (run_mlx_spec, 0)]
    peer = pair.speculative and mlx_lm_speculates(pair)
    if pair.speculative:
        for k in ks:
            if peer and k != "auto":  # mlx-lm: a model and a fixed k only
                configs.append((run_mlx_lm, k))
            configs.append((run_mlx_spec, k))
    return configs


def run_bench(
    pair, prompts: dict[str, str], temps, ks, runs: int, max_tokens: int, progress=None, step=None
):
    """Every configuration on every prompt and temperature, `runs` times. `progress(line)`:
    notes; `step(line)` (else `progress`): a configuration's run done, with its line."""
    configs = bench_configs(pair, ks)
    peer = pair.speculative and mlx_lm_speculates(pair)
    if pair.speculative and pair.draft is not None and not peer and progress:
        progress("mlx-lm's speculative path refuses this pair (a cache it cannot trim): no rows")
    step = step or progress
    results: list[Run] = []
    for run_index in range(runs):
        for name, text in prompts.items():
            ids = encode_prompt(pair.tokenizer, [{"role": "user", "content": text}])
            for temperature in temps:
                # each run starts from another configuration: whatever the one before leaves
                # behind (caches, memory, a busy neighbour) does not always favour the same one
                shift = run_index % len(configs)
                for fn, k in configs[shift:] + configs[:shift]:
                    r = fn(pair, ids, max_tokens, temperature, k, seed=run_index)
                    r.prompt = name
                    results.append(r)
                    if step:
                        step(
                            f"run {run_index + 1}/{runs} {name} temp={temperature} "
                            f"{r.config} k={k}: {r.tokens_per_second:.1f} tok/s"
                        )
    return results


@dataclass
class Row:
    config: str
    k: int | str
    temperature: float
    median_tokens_per_second: float
    speedup: float  # over mlx-lm plain at the same temperature (and prompt), ratio of medians
    acceptance_rate: float | None
    tokens_per_target_pass: float
    peak_memory_gb: float
    same_output: bool | None  # temperature 0: token-identical to mlx-lm plain on every prompt
    draft_steps_per_token: float = 0.0  # draft-model passes per emitted token
    prompt: str | None = None  # None: every prompt together
    plain_share: float = 0.0  # `auto`: share of tokens decoded plainly
    states: dict | None = None  # `auto`: the controller's final state -> runs that ended in it
    collectives_per_token: float = 0.0  # a sharded target (mlx-spec rows)
    collective_share: float = 0.0  # of the generation time, estimated


def _k_order(k) -> int:
    return 99 if k == "auto" else k


def summarise(results: list[Run], by_prompt: bool = False) -> list[Row]:
    """One row per configuration (per prompt too with `by_prompt`); speedups are ratios of
    medians to mlx-lm plain over the same runs."""

    def group(r: Run):
        return (r.prompt if by_prompt else None, r.temperature, r.config, r.k)

    groups: dict[tuple, list[Run]] = {}
    for r in results:
        groups.setdefault(group(r), []).append(r)
    reference = {r.prompt: r.tokens for r in results if r.config == MLX_LM and r.temperature == 0}
    rows = []
    for key in sorted(groups, key=lambda g: (g[1], _k_order(g[3]), g[2])):
        prompt, temperature, config, k = key
        runs = groups[key]
        base_runs = groups.get((prompt, temperature, MLX_LM, 0))
        base = statistics.median(r.tokens_per_second for r in base_runs) if base_runs else 0.0
        median = statistics.median(r.tokens_per_second for r in runs)
        drafted = sum(r.drafted for r in runs)
        generation = sum(r.generation_seconds for r in runs)
        same = None
        if temperature == 0 and config != MLX_LM:
            same = all(r.tokens == reference.get(r.prompt) for r in runs)
        rows.append(
            Row(
                config,
                k,
                temperature,
                median,
                median / base if base else 0.0,
                sum(r.accepted for r in runs) / drafted if drafted else None,
                sum(len(r.tokens) for r in runs) / max(1, sum(r.target_passes for r in runs)),
                max(r.peak_memory_gb for r in runs),
                same,
                sum(r.draft_steps for r in runs) / max(1, sum(len(r.tokens) for r in runs)),
                prompt,
                sum(r.plain_tokens for r in runs) / max(1, sum(len(r.tokens) for r in runs)),
                _count(r.controller.split(":")[0] for r in runs if r.controller) or None,
                sum(r.collectives for r in runs) / max(1, sum(len(r.tokens) for r in runs)),
                min(1.0, sum(r.collective_seconds for r in runs) / max(1e-9, generation)),
            )
        )
    if by_prompt:  # prompt by prompt, in the order they ran
        order = {r.prompt: i for i, r in reversed(list(enumerate(results)))}
        rows.sort(key=lambda r: order[r.prompt])  # stable: keeps the order within a prompt
    return rows


def _count(items) -> dict:
    out: dict = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def auto_lines(rows: list[Row]) -> list[str]:
    """`auto` against plain decoding and the best fixed k of the same run, per temperature
    (and prompt): the controller's promise is to be near the better of the two."""
    lines = []
    for auto in (r for r in rows if r.config == MLX_SPEC and r.k == "auto"):
        same = [
            r
            for r in rows
            if r.config == MLX_SPEC
            and r.temperature == auto.temperature
            and r.prompt == auto.prompt
        ]
        plain = next((r for r in same if not r.k), None)
        fixed = [r for r in same if isinstance(r.k, int) and r.k > 0]
        where = f"{auto.prompt}, " if auto.prompt else ""
        line = f"auto ({where}temp {auto.temperature:g}):"
        if plain and plain.median_tokens_per_second:
            line += f" {auto.median_tokens_per_second / plain.median_tokens_per_second:.2f}x plain"
        if fixed:
            best = max(fixed, key=lambda r: r.median_tokens_per_second)
            ratio = auto.median_tokens_per_second / best.median_tokens_per_second
            line += f", {ratio:.2f}x the best fixed k (k={best.k})"
        line += f"; {auto.plain_share:.0%} of tokens plain"
        if auto.states:
            line += "; ended " + ", ".join(f"{s} ({n})" for s, n in auto.states.items())
        lines.append(line)
    return lines


def format_rows(rows: list[Row]) -> str:
    by_prompt = any(r.prompt is not None for r in rows)
    width = max((len(r.prompt) for r in rows if r.prompt), default=0)
    head = f"{'prompt':<{width}}  " if by_prompt else ""
    sharded = any(r.collectives_per_token for r in rows)  # columns only on a group
    lines = [
        f"{head}{'temp':>4}  {'configuration':<20} {'k':>4}  {'tok/s':>7}  {'speedup':>7}  "
        f"{'accept':>6}  {'tok/pass':>8}  {'drafts/tok':>10}  {'peak GB':>7}  same output"
        + ("  coll/tok  in coll" if sharded else "")
    ]
    for r in rows:
        accept = "" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        same = "" if r.same_output is None else ("yes" if r.same_output else "NO")
        prompt = f"{r.prompt:<{width}}  " if by_prompt else ""
        lines.append(
            f"{prompt}{r.temperature:>4.1f}  {r.config:<20} {r.k or '-':>4}  "
            f"{r.median_tokens_per_second:>7.1f}  {r.speedup:>6.2f}x  {accept:>6}  "
            f"{r.tokens_per_target_pass:>8.2f}  {r.draft_steps_per_token:>10.2f}  "
            f"{r.peak_memory_gb:>7.2f}  {same}"
            + (_collective_columns(r, len(same)) if sharded else "")
        )
    return "\n".join(lines + auto_lines(rows))


def _collective_columns(r: Row, same_width: int) -> str:
    if not r.collectives_per_token:  # mlx-lm's rows: not counted
        return ""
    pad = " " * (11 - same_width)
    return f"{pad}  {r.collectives_per_token:>8.1f}  {r.collective_share:>7.0%}"


def to_json(results: list[Run]) -> dict:
    return {
        "rows": [asdict(r) for r in summarise(results)],
        "rows_by_prompt": [asdict(r) for r in summarise(results, by_prompt=True)],
        "runs": [{**asdict(r), "tokens": len(r.tokens)} for r in results],
    }
