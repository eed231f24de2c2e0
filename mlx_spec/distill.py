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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import SpecError
from .loading import ADAPTER_CONFIG, ADAPTER_WEIGHTS

LOSSES = ("tv", "kl")
SEQUENCES_FILE = "sequences.json"
REPORT_FILE = "distill.json"
CHECKPOINT = "checkpoint"
CHUNK_CHARS = 1200  # a document is cut into prompts of about this many characters
MAX_FILE_BYTES = 1 << 20  # larger files in a data folder are skipped (data dumps, not text)
SKIP_DIRS = {".git", ".hg", ".svn", ".venv", "venv", "node_modules", "__pycache__", "build"}

# A mixed set: chat questions, explanations, code, lists, summaries, rewriting, stories.
BUILTIN_PROMPTS = [
    "What are three tips for staying focused while working from home?",
    "Explain how a refrigerator keeps food cold.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How do vaccines train the immune system?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion to a ten-year-old.",
    "Write a SQL query that counts orders per customer.",
    "What causes the seasons on Earth?",
    "Suggest five names for a small coffee shop.",
    "How does a bicycle's gear system make pedalling easier?",
    "Write a polite email asking my manager for a day off next Friday.",
    "What is photosynthesis?",
    "Write a JavaScript function that reverses an array without using reverse().",
    "List the planets of the solar system in order from the Sun.",
    "How can I improve my sleep?",
    "Explain what an API is in simple terms.",
    "Tell me a short story about a robot who learns to paint.",
    "What are the pros and cons of electric cars?",
    "Write a bash command that finds all .txt files larger than 1 MB.",
    "How do I make a good cup of tea?",
    "Explain the difference between weather and climate.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "What is the Pythagorean theorem? Give an example.",
    "Give three arguments for learning a second language.",
    "Describe how a bill becomes a law, briefly.",
    "Rewrite this sentence to be more formal: hey, can u send me the report asap?",
    "What is machine learning?",
    "How does the internet route a message from one computer to another?",
    "Write a limerick about a cat who loves cheese.",
    "Explain what a black hole is.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are good habits for saving money?",
    "Why do leaves change colour in autumn?",
    "Translate to French: Good morning, how are you today?",
    "What is the capital of Australia, and why was it chosen?",
    "Explain the rules of chess in a few sentences.",
    "Write a to-do list app outline with its main features.",
    "How does compound interest work?",
    "What happens when you boil water at high altitude?",
    "Give me a motivational quote and explain it.",
    "Explain how a hash table works.",
    "What is the water cycle?",
    "Write a short product description for a reusable water bottle.",
]


@dataclass(frozen=True)
class Prompt:
    """Chat turns ending with the user's (the target replies), or a document chunk (raw text
    the target continues)."""

    messages: tuple = ()
    text: str | None = None

    @staticmethod
    def chat(text: str) -> Prompt:
        return Prompt(messages=({"role": "user", "content": text},))


@dataclass
class Settings:
    steps: int = 200
    batch_size: int = 4
    learning_rate: float = 1e-4
    rank: int = 8
    scale: float = 20.0  # mlx-lm's default LoRA scale
    num_layers: int = -1  # LoRA in the last N blocks (-1: all)
    loss: str = "tv"
    reply_tokens: int = 64  # tokens of each target reply
    max_length: int = 256  # longest training sequence (a prompt's start is cut beyond it)
    held_out: float = 0.2  # share of prompts never trained on
    eval_every: int = 25
    save_every: int = 25
    seed: int = 0
    temperature: float = 1.0  # the target's replies are sampled at this temperature
    k: int = 4  # draft length when measuring tokens per target pass
    eval_prompts: int = 4  # held-out prompts decoded with the pair to count tokens per pass
    max_prompts: int | None = None

    def check(self) -> None:
        if self.loss not in LOSSES:
            raise SpecError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if not 0 < self.held_out < 1:
            raise SpecError(f"--held-out must be in (0, 1), got {self.held_out}")
        if self.reply_tokens >= self.max_length:
            raise SpecError("--reply-tokens must be below --max-length")
        if not self.learning_rate > 0:
            raise SpecError(f"--learning-rate must be > 0, got {self.learning_rate}")
        if self.temperature < 0:
            raise SpecError(f"--temp must be >= 0, got {self.temperature}")

    def training_key(self) -> dict:
        """What a resumed run must share with the run it continues (all but the length)."""
        return {
            k: v for k, v in asdict(self).items() if k not in ("steps", "eval_every", "save_every")
        }


# ----------------------------------------------------------------------------- data


def read_data(path: str | None, max_prompts: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts from a file or folder (see `mlx-spec distill --help`), or the built-in set."""
    if path is None:
        prompts = [Prompt.chat(p) for p in BUILTIN_PROMPTS]
    else:
        where = Path(path).expanduser()
        if not where.exists():
            raise SpecError(f"data path does not exist: {path}")
        prompts = _read_folder(where) if where.is_dir() else _read_file(where)
        if not prompts:
            raise SpecError(f"{path} holds no prompts")
    if max_prompts is not None and len(prompts) > max_prompts:
        keep = np.random.default_rng(seed).choice(len(prompts), max_prompts, replace=False)
        prompts = [prompts[i] for i in sorted(keep)]
    return prompts


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{path} is not UTF-8 (byte {err.start})") from None


def _read_file(path: Path) -> list[Prompt]:
    text = _read_text(path)
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                prompts += _from_record(_json(line, f"{path}:{n}"), f"{path}:{n}")
        return prompts
    if path.suffix == ".json":
        data = _json(text, str(path))
        records = data if isinstance(data, list) else [data]
        return [p for r in records for p in _from_record(r, str(path))]
    if path.suffix == ".txt":  # one prompt per line, as `bench --prompts`
        return [Prompt.chat(line.strip()) for line in text.splitlines() if line.strip()]
    return chunks(text)


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as err:
        raise SpecError(f"{where}: not JSON ({err})") from None


def _from_record(record, where: str) -> list[Prompt]:
    """A string (a user message), {"prompt": ...}, {"text": ...} (a document) or a
    conversation {"messages": [...], "system"?: ...} as the chat app saves it (a prompt per
    user turn, with the turns before it)."""
    if isinstance(record, str):
        return [Prompt.chat(record)] if record.strip() else []
    if not isinstance(record, dict):
        raise SpecError(f"{where}: expected a string or an object, got {type(record).__name__}")
    if isinstance(record.get("messages"), list):
        return _conversation(record["messages"], record.get("system"), where)
    if isinstance(record.get("prompt"), str):
        return [Prompt.chat(record["prompt"])] if record["prompt"].strip() else []
    if isinstance(record.get("text"), str):
        return chunks(record["text"])
    raise SpecError(f"{where}: an object needs messages, prompt or text")


def _conversation(messages: list, system, where: str) -> list[Prompt]:
    turns = []
    if isinstance(system, str) and system.strip():
        turns.append({"role": "system", "content": system})
    prompts = []
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise SpecError(f"{where}: a message needs a role and content")
        if not isinstance(m.get("content"), str):
            raise SpecError(f"{where}: a message needs a role and content")
        turns.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user" and m["content"].strip():
            prompts.append(Prompt(messages=tuple(turns)))
    return prompts


def chunks(text: str, size: int = CHUNK_CHARS) -> list[Prompt]:
    """Cut a document at line ends into pieces of about `size` characters."""
    out, piece = [], ""
    for line in text.splitlines(keepends=True):
        if piece and len(piece) + len(line) > size:
            out.append(piece)
            piece = ""
        piece += line[: size * 2]
    if piece.strip():
        out.append(piece)
    return [Prompt(text=p) for p in out if p.strip()]


def _read_folder(root: Path) -> list[Prompt]:
    """Every text file under `root` (a code repository, notes, saved chats): chat saves and
    JSON Lines as records, everything else as documents cut into prompts. Binary, large and
    hidden files are skipped."""
    prompts = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).parts
        if any(p.startswith(".") or p in SKIP_DIRS for p in rel) or not path.is_file():
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            raw = path.read_bytes()
        except OSError:
            continue
        if b"\0" in raw[:4096]:
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if path.suffix in (".json", ".jsonl"):
            try:
                prompts += _read_file(path)
            except SpecError:  # JSON that is not ours (package.json…): a document
                prompts += chunks(text)
        else:
            prompts += chunks(text)
    return prompts


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    from .engine import encode_prompt

    if prompt.text is not None:
        return encode_prompt(tokenizer, prompt.text)
    if tokenizer.has_chat_template:
        return encode_prompt(tokenizer, list(prompt.messages))
    return encode_prompt(tokenizer, "\n\n".join(m["content"] for m in prompt.messages))


def split(prompts: list, held_out: float, seed: int) -> tuple[list, list]:
    """A fixed held-out share (at least one prompt), never trained on."""
    if len(prompts) < 2:
        raise SpecError(
            f"need at least 2 prompts (one to train on, one held out), got {len(prompts)}"
        )
    order = np.random.default_rng(seed).permutation(len(prompts))
    n = min(len(prompts) - 1, max(1, round(held_out * len(prompts))))
    return [prompts[i] for i in sorted(order[n:])], [prompts[i] for i in sorted(order[:n])]


# ----------------------------------------------------------------------------- sequences


@dataclass
class Sequence:
    tokens: list[int]
    start: int  # index of the first reply token

    def window(self, max_length: int) -> Sequence:
        """The last `max_length` tokens (a long prompt loses its beginning)."""
        cut = max(0, len(self.tokens) - max_length)
        return Sequence(self.tokens[cut:], max(1, self.start - cut))


def drafting_pays(pair) -> bool:
    """Whether the replies are generated with speculation. Not with a quantized draft on the
    CPU backend: MLX's quantized matmuls there are compute-bound (8 rows cost ~7x one), so the
    draft's prompt pass alone costs more than the speculation saves (measured on the demo:
    replies at ~1.6 tokens/s with the 3-bit self-draft, see docs/design.md)."""
    if mx.metal.is_available() or pair.draft is None:
        return pair.speculative
    return not any(isinstance(m, nn.QuantizedLinear) for _, m in pair.draft.named_modules())


def reply(pair, ids: list[int], settings: Settings, seed: int, k=None, temperature=None,
          use_draft: bool = True):  # fmt: skip
    """The target's reply (the output is the target's with or without the draft) and the
    counts of tokens and target passes."""
    from .engine import generate

    res = generate(
        pair,
        ids,
        max_tokens=settings.reply_tokens,
        temperature=settings.temperature if temperature is None else temperature,
        num_draft_tokens=k,
        seed=seed,
        use_draft=use_draft,
    )
    return res.tokens, res.stats.generated_tokens, res.stats.target_passes


def tokens_per_pass(pair, prompts_ids: list[list[int]], settings: Settings, temperature: float):
    """Measured tokens per target pass with the pair at a fixed k over held-out prompts."""
    tokens = passes = 0
    for i, ids in enumerate(prompts_ids):
        _, n, p = reply(pair, ids, settings, settings.seed + 10_000 + i, settings.k, temperature)
        tokens, passes = tokens + n, passes + p
    return tokens / max(passes, 1)


def replies(pair, prompts: list[list[int]], settings: Settings, seed: int, progress, what: str):
    speculative = drafting_pays(pair)
    seqs = []
    for i, ids in enumerate(prompts):
        progress(f"the target's replies: {i + 1}/{len(prompts)} {what} prompts")
        out, _, _ = reply(pair, ids, settings, seed + i, use_draft=speculative)
        seqs.append(Sequence(ids + out, len(ids)))
    return seqs


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

    from .loading import load_draft_model

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


def batch_indices(n: int, settings: Settings, step: int) -> list[int]:
    """The sequences of a step: a pure function of (seed, step), so a resumed run draws
    exactly what an uninterrupted one would."""
    rng = np.random.default_rng([settings.seed, step])
    return sorted(rng.choice(n, min(settings.batch_size, n), replace=False).tolist())


@dataclass
class State:
    step: int = 0
    history: list = field(default_factory=list)  # {"step", "loss", "acceptance_t1", ...}
    before: dict | None = None
    seconds: float = 0.0


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


def checkpoint_dir(out: Path) -> Path | None:
    """The last complete checkpoint (the previous one if a save died between its renames)."""
    for where in (out / CHECKPOINT, out / f"{CHECKPOINT}.old"):
        if (where / "state.json").is_file():
            return where
    return None


def load_checkpoint(out: Path, model, optimizer, settings: Settings) -> State:
    from mlx.utils import tree_unflatten

    where = checkpoint_dir(out)
    saved = _json(_read_text(where / "state.json"), str(where / "state.json"))
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


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_sequences(path: Path) -> dict:
    """A run's kept replies (sequences.json): the training and held-out Sequences."""
    data = _json(_read_text(path), str(path))
    data["train"] = [Sequence(**s) for s in data["train"]]
    data["held_out"] = [Sequence(**s) for s in data["held_out"]]
    return data


def write_sequences(path: Path, data: dict) -> None:
    write_json(path, {**data, "train": [asdict(s) for s in data["train"]],
                      "held_out": [asdict(s) for s in data["held_out"]]})  # fmt: skip


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
    from .loading import apply_draft_adapter

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


FRACTION, TOKENS = "{:.3f}", "{:.2f}"


def before_after(head: str, rows: list) -> str:
    """The before/after table distill prints: rows of (label, before, after, format)."""
    width = max(len(r[0]) for r in rows)
    lines = [head, f"{'':<{width}}  before   after"]
    for label, before, after, fmt in rows:
        lines.append(f"{label:<{width}}  {fmt.format(before):>6}  {fmt.format(after):>6}")
    return "\n".join(lines)
