"""Distil the draft towards its target: a LoRA adapter trained on the target's own replies.

Acceptance decides the speed-up, and at temperature 1 it is `Σ min(p, q)` per position — one
minus the total variation between the target's distribution `p` and the draft's `q`. So the
draft is trained, token by token, to match the target's whole distribution on sequences the
target itself wrote (its replies to the user's prompts), with LoRA layers from mlx-lm's tuner.
The output of a pair stays exactly the target's whatever the draft proposes; only the speed
changes. See docs/design.md for the loss and its numbers.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import SpecError
from ..models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_draft_adapter
from ..pairs.loading import load_draft_model
from .common import (
    CHECKPOINT,
    FRACTION,
    REPORT_FILE,
    SEQUENCES_FILE,
    TOKENS,
    Prompt,
    Sequence,
    State,
    batch_indices,
    before_after,
    checkpoint_dir,
    parse_json,
    prompt_ids,
    read_sequences,
    read_text,
    replies,
    split,
    tokens_per_pass,
    write_json,
    write_sequences,
)
from .settings import Settings

# ----------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------- sequences


# ----------------------------------------------------------------------------- the loss


def position_loss(draft_logits: mx.array, target_logits: mx.array, kind: str) -> mx.array:
    """Per-position divergence of the draft from the target at temperature 1: (B, T)."""
    log_q = draft_logits.astype(mx.float32)
    log_q = log_q - mx.logsumexp(log_q, axis=-1, keepdims=True)  # (B, T, V)
    log_p = target_logits.astype(mx.float32)
    log_p = log_p - mx.logsumexp(log_p, axis=-1, keepdims=True)
    p = mx.exp(log_p)
    if kind == "tv":  # 1 - Σ min(p, q): one minus the acceptance probability
        return 1 - mx.minimum(p, mx.exp(log_q)).sum(-1)
    return (p * (log_p - log_q)).sum(-1)  # forward KL(p || q)


def batch_arrays(seqs: list[Sequence]) -> tuple[mx.array, mx.array]:
    """Right-padded tokens (B, T) and the mask of positions that predict a reply token."""
    width = max(len(s.tokens) for s in seqs)
    tokens = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), np.float32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s.tokens)] = s.tokens
        mask[i, s.start - 1 : len(s.tokens) - 1] = 1  # position j predicts token j + 1
    return mx.array(tokens), mx.array(mask)


def masked_loss(model, tokens, mask, target_logits, kind: str) -> mx.array:
    per = position_loss(model(tokens), target_logits, kind)
    return (per * mask).sum() / mx.maximum(mask.sum(), 1)


def agreement(draft, target, seqs: list[Sequence], batch_size: int) -> dict:
    """Teacher-forced on the target's own sequences: how often the draft's argmax is the
    target's (greedy acceptance) and Σ min(p, q) (acceptance at temperature 1)."""
    greedy = accept = count = 0.0
    for i in range(0, len(seqs), batch_size):
        tokens, mask = batch_arrays(seqs[i : i + batch_size])
        t_logits, d_logits = target(tokens), draft(tokens)
        same = (mx.argmax(t_logits, -1) == mx.argmax(d_logits, -1)) * mask
        overlap = (1 - position_loss(d_logits, t_logits, "tv")) * mask
        g, a, c = mx.stack([same.sum(), overlap.sum(), mask.sum()]).tolist()  # one sync
        greedy, accept, count = greedy + g, accept + a, count + c
    count = max(count, 1)
    return {
        "greedy_agreement": greedy / count,
        "acceptance_t1": accept / count,
        "positions": int(count),
    }


# ----------------------------------------------------------------------------- training


def training_copy(pair, settings: Settings) -> nn.Module:
    """A fresh copy of the draft with LoRA layers, the rest frozen. On the CPU backend the
    quantized weights are dequantized first: the same values and function, but MLX's CPU
    quantized matmul is many times slower than float BLAS for the multi-token passes training
    runs. On Metal the quantized layers stay (QLoRA)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import dequantize_model

    model = load_draft_model(pair)
    if not mx.metal.is_available():
        model = dequantize_model(model)
    model.freeze()
    mx.random.seed(settings.seed)  # the LoRA A matrices start the same on every run
    linear_to_lora_layers(model, settings.num_layers, lora_parameters(settings))
    mx.eval(model.parameters())
    return model


def lora_parameters(settings: Settings) -> dict:
    return {"rank": settings.rank, "scale": settings.scale, "dropout": 0.0}


def save_checkpoint(out: Path, model, optimizer, state: State, settings: Settings) -> None:
    """Adapter, optimizer moments and progress, replaced as a whole (never half-written)."""
    from mlx.utils import tree_flatten

    tmp = out / f"{CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    mx.save_safetensors(
        str(tmp / ADAPTER_WEIGHTS), dict(tree_flatten(model.trainable_parameters()))
    )
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    (tmp / "state.json").write_text(
        json.dumps({"state": asdict(state), "settings": settings.training_key()})
    )
    final, old = out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(out: Path, model, optimizer, settings: Settings) -> State:
    from mlx.utils import tree_unflatten

    where = checkpoint_dir(out)
    saved = parse_json(read_text(where / "state.json"), str(where / "state.json"))
    if saved.get("settings") != json.loads(json.dumps(settings.training_key())):
        raise SpecError(
            f"the checkpoint in {where} was made with other settings; resume with the same "
            "options (only --steps may change) or choose another --out"
        )
    try:
        model.load_weights(list(mx.load(str(where / ADAPTER_WEIGHTS)).items()), strict=False)
        moments = mx.load(str(where / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(moments.items()))
        mx.eval(model.parameters(), optimizer.state)
        return State(**saved["state"])
    except (ValueError, RuntimeError, OSError, TypeError) as err:
        raise SpecError(
            f"the checkpoint in {where} is damaged ({err}); remove it to restart"
        ) from None


def write_adapter(out: Path, model, settings: Settings, base: dict) -> None:
    """mlx-lm's adapter layout (so `mlx_lm.load(..., adapter_path=out)` reads it too), plus
    what it was trained for."""
    from mlx.utils import tree_flatten

    config = {
        "fine_tune_type": "lora",
        "num_layers": settings.num_layers,
        "lora_parameters": lora_parameters(settings),
        "mlx_spec": {"base": base, "loss": settings.loss},
    }
    weights = dict(tree_flatten(model.trainable_parameters()))
    tmp = out / "adapters.tmp.safetensors"  # MLX appends .safetensors to any other name
    mx.save_safetensors(str(tmp), weights)
    tmp.replace(out / ADAPTER_WEIGHTS)
    (out / f"{ADAPTER_CONFIG}.tmp").write_text(json.dumps(config, indent=2))
    (out / f"{ADAPTER_CONFIG}.tmp").replace(out / ADAPTER_CONFIG)


def prepare_sequences(pair, prompts, settings: Settings, out: Path, progress) -> dict:
    """The target's replies to the training prompts, and to the held-out ones while measuring
    tokens per target pass before training (kept in the output folder for a resumed run)."""
    cached = out / SEQUENCES_FILE
    if cached.is_file():
        return read_sequences(cached)
    train, held = split(prompts, settings.held_out, settings.seed)
    tok = pair.tokenizer
    started = time.perf_counter()
    train_ids, held_ids = [prompt_ids(tok, p) for p in train], [prompt_ids(tok, p) for p in held]
    train_seqs = replies(pair, train_ids, settings, settings.seed, progress, "training")
    held_seqs = replies(pair, held_ids, settings, settings.seed + 5_000, progress, "held-out")
    measured = held_ids[: settings.eval_prompts]
    progress(f"tokens per target pass before: {len(measured)} held-out prompts, k={settings.k}")
    data = {
        "train": train_seqs,
        "held_out": held_seqs,
        "measured_prompts": measured,
        "tokens_per_pass": {
            "t0": tokens_per_pass(pair, measured, settings, 0.0),
            "sampled": tokens_per_pass(pair, measured, settings, settings.temperature),
        },
        "seconds": time.perf_counter() - started,
    }
    write_sequences(cached, data)
    return data


def distill(
    pair,
    prompts: list[Prompt],
    out: Path,
    settings: Settings,
    base: dict,
    resume: bool = False,
    progress=lambda message: None,
    bar=lambda state, loss, settings: None,
) -> dict:
    """Train, measure before and after, write the adapter and the report into `out`. The
    adapter ends up applied to `pair.draft` (the after-measurement decodes with it)."""
    import mlx.optimizers as optim

    settings.check()
    if pair.draft is None:
        raise SpecError("distill needs a draft model (--draft, --draft-bits or a pair with one)")
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {out} exists and is not a folder")
    has_run = out.is_dir() and (out / SEQUENCES_FILE).exists()
    if out.is_dir() and any(out.iterdir()) and not (resume and has_run):
        hint = "pass --resume to continue it" if has_run else "it is not a distill run"
        raise SpecError(f"--out {out} is not empty; {hint}, or choose another folder")
    out.mkdir(parents=True, exist_ok=True)

    data = prepare_sequences(pair, prompts, settings, out, progress)
    train = [s.window(settings.max_length) for s in data["train"]]
    held = [s.window(settings.max_length) for s in data["held_out"]]

    progress("preparing the draft for training (LoRA)…")
    model = training_copy(pair, settings)
    optimizer = optim.Adam(learning_rate=settings.learning_rate)
    optimizer.init(model.trainable_parameters())
    state = State()
    if resume and checkpoint_dir(out) is not None:
        state = load_checkpoint(out, model, optimizer, settings)
        progress(f"resumed at step {state.step}")
    if state.before is None:
        progress("held-out agreement before training…")
        state.before = agreement(model, pair.target, held, settings.batch_size)

    loss_and_grad = nn.value_and_grad(model, masked_loss)
    recent = []
    started = time.perf_counter() - state.seconds
    while state.step < settings.steps:
        tokens, mask = batch_arrays(
            [train[i] for i in batch_indices(len(train), settings, state.step)]
        )
        target_logits = mx.stop_gradient(pair.target(tokens))  # (B, T, V)
        loss, grads = loss_and_grad(model, tokens, mask, target_logits, settings.loss)
        optimizer.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), optimizer.state)
        state.step += 1
        recent.append(loss.item())  # one sync per step: the step already synced
        state.seconds = time.perf_counter() - started
        last = state.step == settings.steps
        if state.step % settings.eval_every == 0 or last:
            now = agreement(model, pair.target, held, settings.batch_size)
            state.history.append({"step": state.step, "loss": float(np.mean(recent)), **now})
            recent = []
        bar(state, float(np.mean(recent)) if recent else state.history[-1]["loss"], settings)
        if state.step % settings.save_every == 0 or last:
            save_checkpoint(out, model, optimizer, state, settings)

    after = agreement(model, pair.target, held, settings.batch_size)
    write_adapter(out, model, settings, base)
    del model

    progress("held-out: tokens per target pass after, with the adapter…")
    apply_draft_adapter(pair.draft, out, pair.config.draft_bits)
    measured = data["measured_prompts"]
    tpp_greedy = tokens_per_pass(pair, measured, settings, 0.0)
    tpp_sampled = tokens_per_pass(pair, measured, settings, settings.temperature)
    before_tpp = data["tokens_per_pass"]
    report = {
        "base": base,
        "settings": asdict(settings),
        "train_sequences": len(train),
        "held_out_sequences": len(held),
        "held_out_positions": after["positions"],
        "measured_prompts": len(measured),
        "before": {
            "greedy_agreement": state.before["greedy_agreement"],
            "acceptance_t1": state.before["acceptance_t1"],
            "tokens_per_pass_t0": before_tpp["t0"],
            "tokens_per_pass_sampled": before_tpp["sampled"],
        },
        "after": {
            "greedy_agreement": after["greedy_agreement"],
            "acceptance_t1": after["acceptance_t1"],
            "tokens_per_pass_t0": tpp_greedy,
            "tokens_per_pass_sampled": tpp_sampled,
        },
        "seconds": {"replies": data["seconds"], "training": state.seconds},
        "history": state.history,
    }
    write_json(out / REPORT_FILE, report)
    return report


def format_table(report: dict) -> str:
    s, b, a = report["settings"], report["before"], report["after"]
    rows = [
        ("greedy agreement (argmax q = argmax p)", "greedy_agreement", FRACTION),
        ("acceptance at temperature 1, Σ min(p, q)", "acceptance_t1", FRACTION),
        (f"tokens per target pass, temperature 0, k={s['k']}", "tokens_per_pass_t0", TOKENS),
        (
            f"tokens per target pass, temperature {s['temperature']:g}, k={s['k']}",
            "tokens_per_pass_sampled",
            TOKENS,
        ),
    ]
    head = (
        f"held out (never trained on): {report['held_out_sequences']} prompts, "
        f"{report['held_out_positions']} positions; tokens per pass over "
        f"{report['measured_prompts']} of them"
    )
    return before_after(head, [(label, b[key], a[key], fmt) for label, key, fmt in rows])
