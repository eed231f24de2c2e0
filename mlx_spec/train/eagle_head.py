"""Train an EAGLE-3 head for a target on its own replies (`mlx-spec distill --drafter eagle3`).

The recipe is EAGLE-3's (SafeAILab/EAGLE `cnets.py`, SpecForge `core/eagle3.py`): the target
answers the user's prompts; its features at three layers (drafters/eagle.py's convention), its
logits and the tokens are kept; the head is trained by *test-time training* over `ttt_steps`
draft steps. Step 0 reads the target's fused features; step i > 0 reads the head's own output of
step i-1 for the same position (as drafting chains), with the next ground-truth token, and its
attention sees the real entries up to its position plus the chained entries of the steps
before it (the "diagonal"), at the positions drafting gives them (entry j of step i sits at
j + i). The loss of step i is weighted 0.8^i: a soft cross-entropy against the target's
distribution restricted to the draft vocabulary (renormalised), at positions whose target
argmax the draft vocabulary holds (EAGLE's position mask). The draft vocabulary is the most
frequent tokens of the training replies (`d2t` / `t2d`). What training reads per position
comes from the passes that sample the replies (replies_with_features), kept as the target's
TOP_K largest logits, so the vocabulary can be chosen after the replies are made.

The output is a head directory in the EAGLE / SpecForge layout (`config.json` of a
`LlamaForCausalLMEagle3`, `model.safetensors` with `fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`; the target's embedding), which `--drafter eagle3 --head DIR` loads, as it loads a
published head; a published head is fine-tuned by starting from it (`--head DIR`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.batch_caches import check_batchable
from ..core.caches import make_cache
from ..core.hidden import capturing, decoder_stack
from ..drafters.eagle import Eagle3Head, capture_layers, load_head
from ..errors import SpecError
from ..measure.plots import pyplot
from ..models.model_dir import text_config
from .common import (
    CHECKPOINT,
    FRACTION,
    REPORT_FILE,
    SEQUENCES_FILE,
    TOKENS,
    Sequence,
    State,
    batch_indices,
    before_after,
    checkpoint_dir,
    parse_json,
    prompt_ids,
    read_sequences,
    read_text,
    split,
    tokens_per_pass,
    write_json,
    write_sequences,
)
from .eagle_build import (
    choose_vocab,
    default_layers,
    head_config,
    init_config,
    json_config,
    new_head,
    write_head,
)
from .eagle_ttt import (
    evaluate,
    item,
    make_batch,
    position_records,
    target_features,
    ttt_loss,
    window_item,
)

OPTIMIZER = "optimizer/moments.safetensors"  # not in the head's folder: it loads *.safetensors
PREFILL_FLOATS = 2**27  # logits one prefill chunk of a reply batch holds (512 MB in float32)


# ----------------------------------------------------------------------------- the run


REPLY_BATCH = 64  # the demo target, 80 tokens at T 0.7: 38 tok/s at 32 a batch, 53 at 64, 45 at 128


def batch_replies(pair, prompts: list[list[int]], settings, seed: int, progress, what: str):
    """The target's replies, several prompts at once (mlx-lm's batched generation): a batch
    of rows costs little more than one. Sampled at settings.temperature."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    seqs = []
    for i in range(0, len(prompts), REPLY_BATCH):
        part = prompts[i : i + REPLY_BATCH]
        progress(f"the target's replies: {i + len(part)}/{len(prompts)} {what} prompts")
        mx.random.seed(seed + i)
        res = batch_generate(
            pair.target,
            pair.tokenizer,
            part,
            max_tokens=settings.reply_tokens,
            return_token_ids=True,
            sampler=make_sampler(settings.temperature),
        )
        seqs += [
            Sequence(ids + list(out), len(ids))
            for ids, out in zip(part, res.token_ids, strict=True)
        ]
    return seqs


def replies_with_features(pair, prompts: list[list[int]], layers: tuple, settings, seed: int,
                          progress, what: str) -> tuple[list[Sequence], list[dict]]:  # fmt: skip
    """The target's replies and, from the same passes, every position's training item: the
    passes that sample a reply compute its features, so none is run again (demo target: the
    separate pass took 21 of a run's 43 minutes). Rows are left-padded into one batched KV
    cache (check_batchable's targets); a row stops at its end token (kept) or reply_tokens."""
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.sample_utils import make_sampler

    sample = make_sampler(settings.temperature)
    ends = set(pair.tokenizer.eos_token_ids)
    n_layers = len(decoder_stack(pair.target)["layers"])
    vocab = int(text_config(pair.target_config)["vocab_size"])

    def forward(x, cache) -> tuple[list, mx.array]:
        """x (B, n) through the target: (the positions' records as numpy, the next tokens)."""
        with capturing(pair.target, layers) as hidden:
            logits = pair.target(x, cache=cache)  # (B, n, V)
        records = position_records(hidden, layers, logits)
        lse = records[3][:, -1:]  # (B, 1) the last position's, computed for its record
        y = sample(logits[:, -1].astype(mx.float32) - lse)  # (B,)
        mx.eval(records, y)
        return [np.array(r) for r in records], y

    seqs, items = [], []
    for i in range(0, len(prompts), REPLY_BATCH):
        part = prompts[i : i + REPLY_BATCH]
        progress(f"the target's replies: {i + len(part)}/{len(prompts)} {what} prompts")
        mx.random.seed(seed + i)
        width = max(len(p) for p in part)
        pads = [width - len(p) for p in part]
        x = mx.array([[0] * pad + p for p, pad in zip(part, pads, strict=True)])  # (B, width)
        cache = [BatchKVCache(pads) for _ in range(n_layers)]
        # the prompts in column chunks: a whole long prompt's logits for 64 rows would not fit
        cols = max(1, PREFILL_FLOATS // (len(part) * vocab))
        chunks = [forward(x[:, c : c + cols], cache) for c in range(0, width, cols)]
        y = chunks[-1][1]
        steps = [[np.concatenate(r, 1) for r in zip(*(rec for rec, _ in chunks), strict=True)]]
        replies = [[] for _ in part]
        live = [True] * len(part)
        while True:
            for b, t in enumerate(y.tolist()):
                if live[b]:
                    replies[b].append(t)
                    live[b] = t not in ends and len(replies[b]) < settings.reply_tokens
            if not any(live):
                break
            records, y = forward(y[:, None], cache)
            steps.append(records)
        for b, (p, pad) in enumerate(zip(part, pads, strict=True)):
            n = len(replies[b])  # positions read: the prompt's, and the reply's but its last
            rows = [[r[b, pad:] for r in steps[0]]] + [[r[b] for r in st] for st in steps[1:n]]
            rows.append([np.zeros_like(r[b, :1]) for r in steps[0]])  # the last: never read
            seqs.append(Sequence(p + replies[b], len(p)))
            items.append(item(rows, seqs[-1].tokens, len(p)))
    return seqs, items


def engine_pair(pair, head: Eagle3Head, where: Path):
    """The pair drafting with `head` (in memory) through the engine, as `--head` would."""
    make_cache(pair.target, "target")
    config = pair.config.with_drafter("eagle3", head=str(where))
    return dataclasses.replace(pair, config=config, head=head)


def prepare(pair, prompts, settings, out: Path, progress, layers: tuple) -> dict:
    """The replies (sequences.json: a resumed run reads them); a fresh run on a target the
    batch can hold has their training items too ("items"), from the passes that made them."""
    cached = out / SEQUENCES_FILE
    if cached.is_file():
        return read_sequences(cached)
    train, held = split(prompts, settings.held_out, settings.seed)
    tok = pair.tokenizer
    started = time.perf_counter()
    train_ids, held_ids = [prompt_ids(tok, p) for p in train], [prompt_ids(tok, p) for p in held]
    data = {"measured_prompts": held_ids[: settings.eval_prompts]}
    try:
        check_batchable(pair.target, windows=False)
    except SpecError:  # a recurrent or sliding-window target: replies, then a features pass
        data["train"] = batch_replies(
            pair, train_ids, settings, settings.seed, progress, "training"
        )
        data["held_out"] = batch_replies(
            pair, held_ids, settings, settings.seed + 5_000, progress, "held-out"
        )
    else:
        data["train"], train_items = replies_with_features(
            pair, train_ids, layers, settings, settings.seed, progress, "training"
        )
        data["held_out"], held_items = replies_with_features(
            pair, held_ids, layers, settings, settings.seed + 5_000, progress, "held-out"
        )
        data["items"] = {"train": train_items, "held_out": held_items}
    data["seconds"] = time.perf_counter() - started
    write_sequences(cached, {k: v for k, v in data.items() if k != "items"})
    return data


def save_checkpoint(out: Path, head, config, optimizer, state: State, settings) -> None:
    """The head (its own layout), optimizer moments and progress, replaced as a whole."""
    from mlx.utils import tree_flatten

    tmp = out / f"{CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_head(tmp, head, config)  # a head directory itself: the moments go beside it
    (tmp / "optimizer").mkdir()
    mx.save_safetensors(str(tmp / OPTIMIZER), dict(tree_flatten(optimizer.state)))
    (tmp / "state.json").write_text(
        json.dumps({"state": asdict(state), "settings": settings.training_key()})
    )
    final, old = out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(where: Path, optimizer, settings) -> State:
    from mlx.utils import tree_unflatten

    saved = parse_json(read_text(where / "state.json"), str(where / "state.json"))
    if saved.get("settings") != json.loads(json.dumps(settings.training_key())):
        raise SpecError(
            f"the checkpoint in {where} was made with other settings; resume with the same "
            "options (only --steps may change) or choose another --out"
        )
    try:
        moments = mx.load(str(where / OPTIMIZER))
        optimizer.state = tree_unflatten(list(moments.items()))
        mx.eval(optimizer.state)
        return State(**saved["state"])
    except (ValueError, RuntimeError, OSError, TypeError) as err:
        raise SpecError(
            f"the checkpoint in {where} is damaged ({err}); remove it to restart"
        ) from None


def train_step(head, optimizer, loss_and_grad, items: list[dict], settings, step: int) -> float:
    """Training step `step`: its batch (drawn from the seed and the step alone), the update,
    evaluated; the batch's loss."""
    picked = batch_indices(len(items), settings, step)
    loss, grads = loss_and_grad(make_batch([items[i] for i in picked], head))
    optimizer.update(head, grads)
    mx.eval(loss, head.trainable_parameters(), optimizer.state)
    return loss.item()


def check_out(out: Path, resume: bool) -> None:
    """The output folder: new, empty, or a run to --resume; writable."""
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {out} exists and is not a folder")
    has_run = out.is_dir() and (out / SEQUENCES_FILE).exists()
    if out.is_dir() and any(out.iterdir()) and not (resume and has_run):
        hint = "pass --resume to continue it" if has_run else "it is not a distill run"
        raise SpecError(f"--out {out} is not empty; {hint}, or choose another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as err:
        raise SpecError(f"cannot write to --out {out}: {err.strerror}") from None


def train_head(
    pair,
    prompts,
    out: Path,
    settings,
    init: Path | None = None,
    resume: bool = False,
    progress=lambda message: None,
    bar=lambda state, loss, settings: None,
) -> dict:
    """Train (or fine-tune, from the head in `init`), measure before and after, write the head
    and the report into `out`."""
    import mlx.optimizers as optim

    settings.check()
    check_out(out, resume)
    t = text_config(pair.target_config)
    head_config(pair.target_config, (0, 0, 0), 2)  # a target a head can read: said first
    decoder_stack(pair.target)
    target_layers = int(t["num_hidden_layers"])
    init_cfg = init_config(init, pair.target_config) if init is not None else None
    if init is not None:  # a published head: its vocabulary must fit this target now
        load_head(init, pair.target, pair.target_config)

    where = checkpoint_dir(out) if resume else None
    if init is not None:
        layers = capture_layers(init_cfg, target_layers)
    elif where is not None:
        layers = capture_layers(json_config(where), target_layers)
    else:
        layers = default_layers(target_layers)
    data = prepare(pair, prompts, settings, out, progress, layers)
    train = [s.window(settings.max_length) for s in data["train"]]
    held = [s.window(settings.max_length) for s in data["held_out"]]

    if where is not None:  # other settings: refused before any work
        saved = parse_json(read_text(where / "state.json"), str(where / "state.json"))
        if saved.get("settings") != json.loads(json.dumps(settings.training_key())):
            raise SpecError(
                f"the checkpoint in {where} was made with other settings; resume with the same "
                "options (only --steps may change) or choose another --out"
            )
    start_dir = out / "init"
    if where is not None:
        config = json_config(where)
        head = load_head(where, pair.target, pair.target_config)
    elif init is not None:
        config = init_cfg
        head = load_head(init, pair.target, pair.target_config)
        start_dir.mkdir(exist_ok=True)
        write_head(start_dir, head, config)
        head = load_head(start_dir, pair.target, pair.target_config)  # the same, our layout
    else:
        draft_ids = choose_vocab(train, int(t["vocab_size"]), settings.draft_vocab)
        config = head_config(pair.target_config, layers, len(draft_ids), settings.intermediate)
        head = new_head(pair, config, draft_ids, start_dir, settings.seed)
    config = {**config, "mlx_spec": {"target": pair.config.target, "ttt_steps": settings.ttt_steps}}
    mx.eval(head.parameters())
    head.train()
    if getattr(head, "embedding", None) is not None:
        head.embedding.freeze()  # EAGLE-3 keeps the embedding fixed

    if head.layers_read != layers:
        raise SpecError(f"the head reads layers {head.layers_read}, not {layers}")  # a bug
    if "items" in data:
        train_items = [window_item(it, settings.max_length) for it in data["items"]["train"]]
        held_items = [window_item(it, settings.max_length) for it in data["items"]["held_out"]]
    else:
        progress("the target's features of the training and held-out sequences…")
        train_items = target_features(pair, layers, train, settings.batch_size, progress)
        held_items = target_features(pair, layers, held, settings.batch_size, progress)

    optimizer = optim.Adam(learning_rate=settings.learning_rate)
    optimizer.init(head.trainable_parameters())
    state = State()
    if where is not None:
        state = load_checkpoint(where, optimizer, settings)
        progress(f"resumed at step {state.step}")
    measured = data["measured_prompts"]
    if state.before is None:
        progress("held-out acceptance before training (drafting with the head)…")
        drafting = engine_pair(pair, head, start_dir)
        state.before = {
            **evaluate(head, held_items, settings.ttt_steps, settings.batch_size),
            "tokens_per_pass_t0": tokens_per_pass(drafting, measured, settings, 0.0),
            "tokens_per_pass_sampled": tokens_per_pass(
                drafting, measured, settings, settings.temperature
            ),
        }
        state.history.append({"step": 0, "loss": None, **state.before})

    # the first `ttt_warmup` steps train draft step 1 alone: the later steps' losses (weights
    # 0.8^i, 74% of the total at 7 steps) otherwise slow what every step builds on (demo
    # target, 100 steps: held-out agreement at step 1 0.223 trained alone, 0.121 with all 7)
    full = nn.value_and_grad(head, lambda b: ttt_loss(head, b, settings.ttt_steps))
    first = nn.value_and_grad(head, lambda b: ttt_loss(head, b, 1))
    recent = []
    started = time.perf_counter() - state.seconds
    while state.step < settings.steps:
        loss_and_grad = first if state.step < settings.ttt_warmup else full
        recent.append(train_step(head, optimizer, loss_and_grad, train_items, settings, state.step))
        state.step += 1
        state.seconds = time.perf_counter() - started
        last = state.step == settings.steps
        if state.step % settings.eval_every == 0 or last:
            now = evaluate(head, held_items, settings.ttt_steps, settings.batch_size)
            state.history.append({"step": state.step, "loss": float(np.mean(recent)), **now})
            recent = []
        shown = float(np.mean(recent)) if recent else state.history[-1]["loss"]
        bar(_BarState(state), shown, settings)
        if state.step % settings.save_every == 0 or last:
            save_checkpoint(out, head, config, optimizer, state, settings)

    head.eval()
    write_head(out, head, config, mx.float16 if settings.half else None)
    progress("held-out: tokens per target pass after, drafting with the trained head…")
    final = load_head(out, pair.target, pair.target_config)  # as `--head out` loads it
    drafting = engine_pair(pair, final, out)
    after = {
        **evaluate(final, held_items, settings.ttt_steps, settings.batch_size),
        "tokens_per_pass_t0": tokens_per_pass(drafting, measured, settings, 0.0),
        "tokens_per_pass_sampled": tokens_per_pass(
            drafting, measured, settings, settings.temperature
        ),
    }
    shutil.rmtree(start_dir, ignore_errors=True)
    report = {
        "kind": "eagle3",
        "target": pair.config.target,
        "init": str(init) if init is not None else None,
        "settings": asdict(settings),
        "draft_vocab": int(head._to_target.shape[0]),
        "capture_layers": list(head.layers_read),
        "train_sequences": len(train),
        "held_out_sequences": len(held),
        "held_out_positions": after["positions"],
        "measured_prompts": len(measured),
        "before": state.before,
        "after": after,
        "seconds": {"replies": data["seconds"], "training": state.seconds},
        "history": state.history,
    }
    write_json(out / REPORT_FILE, report)
    return report


class _BarState:
    """distill's Bar reads acceptance_t1 as one number: give it step 0's."""

    def __init__(self, state: State):
        self.step, self.seconds = state.step, state.seconds
        self.history = [
            {**h, "acceptance_t1": h["acceptance_t1"][0]}
            for h in state.history
            if h["loss"] is not None
        ]


def format_table(report: dict) -> str:
    s, b, a = report["settings"], report["before"], report["after"]

    def row(label: str, get, fmt: str) -> tuple:
        return label, get(b), get(a), fmt

    rows = [
        row("greedy agreement, draft step 1", lambda r: r["greedy_agreement"][0], FRACTION),
        row("acceptance at temperature 1, step 1", lambda r: r["acceptance_t1"][0], FRACTION),
        row(
            f"tokens per pass, offline greedy chain of {s['ttt_steps']}",
            lambda r: r["tokens_per_pass_offline"],
            TOKENS,
        ),
        row(
            f"tokens per target pass, temperature 0, k={s['k']}",
            lambda r: r["tokens_per_pass_t0"],
            TOKENS,
        ),
        row(
            f"tokens per target pass, temperature {s['temperature']:g}, k={s['k']}",
            lambda r: r["tokens_per_pass_sampled"],
            TOKENS,
        ),
    ]
    head = (
        f"held out (never trained on): {report['held_out_sequences']} prompts, "
        f"{report['held_out_positions']} positions; tokens per pass drafted with the head "
        f"through the engine over {report['measured_prompts']} of them"
    )
    return before_after(head, rows)


def plot(report: dict, path: str) -> None:
    """The held-out acceptance curve over training: greedy agreement per draft step and the
    offline tokens per pass (a LoRA run: its agreement and acceptance)."""
    plt = pyplot()
    hist = report["history"]
    steps = [h["step"] for h in hist]
    if not isinstance(hist[0]["greedy_agreement"], list):  # a LoRA run: one curve each
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in ("greedy_agreement", "acceptance_t1"):
            ax.plot(steps, [h[key] for h in hist], marker="o", label=key.replace("_", " "))
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(len(hist[0]["greedy_agreement"])):
        left.plot(steps, [h["greedy_agreement"][i] for h in hist], label=f"draft step {i + 1}")
    left.set_xlabel("training step")
    left.set_ylabel("held-out greedy agreement")
    left.legend(fontsize=7)
    right.plot(steps, [h["tokens_per_pass_offline"] for h in hist], marker="o")
    right.set_xlabel("training step")
    right.set_ylabel("tokens per target pass (offline, greedy)")
    fig.suptitle(f"EAGLE-3 head for {report['target']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
