"""What both trainers share (`lora.py` distils a draft model, `eagle_head.py` trains an EAGLE-3
head): the prompts (built in, a file, a folder of documents), the target's replies to them,
the base settings, the run's folder (sequences, checkpoints, report) and its tables.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..decode.generate import generate
from ..decode.prompts import encode_prompt
from ..errors import SpecError
from .settings import Settings

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
    if len(prompts) < 2:  # (said here, before anything is loaded or an --out folder made)
        raise SpecError(
            f"need at least 2 prompts (one to train on, one held out), got {len(prompts)}"
        )
    return prompts


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise SpecError(f"{path} is not UTF-8 (byte {err.start})") from None


def _read_file(path: Path) -> list[Prompt]:
    text = read_text(path)
    if path.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                prompts += _from_record(parse_json(line, f"{path}:{n}"), f"{path}:{n}")
        return prompts
    if path.suffix == ".json":
        data = parse_json(text, str(path))
        records = data if isinstance(data, list) else [data]
        return [p for r in records for p in _from_record(r, str(path))]
    if path.suffix == ".txt":  # one prompt per line, as `bench --prompts`
        return [Prompt.chat(line.strip()) for line in text.splitlines() if line.strip()]
    return chunks(text)


def parse_json(text: str, where: str):
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


def checkpoint_dir(out: Path) -> Path | None:
    """The last complete checkpoint (the previous one if a save died between its renames)."""
    for where in (out / CHECKPOINT, out / f"{CHECKPOINT}.old"):
        if (where / "state.json").is_file():
            return where
    return None


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def read_sequences(path: Path) -> dict:
    """A run's kept replies (sequences.json): the training and held-out Sequences."""
    data = parse_json(read_text(path), str(path))
    data["train"] = [Sequence(**s) for s in data["train"]]
    data["held_out"] = [Sequence(**s) for s in data["held_out"]]
    return data


def write_sequences(path: Path, data: dict) -> None:
    write_json(path, {**data, "train": [asdict(s) for s in data["train"]],
                      "held_out": [asdict(s) for s in data["held_out"]]})  # fmt: skip


FRACTION = "{:.3f}"


TOKENS = "{:.2f}"


def before_after(head: str, rows: list) -> str:
    """The before/after table distill prints: rows of (label, before, after, format)."""
    width = max(len(r[0]) for r in rows)
    lines = [head, f"{'':<{width}}  before   after"]
    for label, before, after, fmt in rows:
        lines.append(f"{label:<{width}}  {fmt.format(before):>6}  {fmt.format(after):>6}")
    return "\n".join(lines)
