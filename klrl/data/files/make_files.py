"""Regenerates the shipped prompt files (run from the repository root; not part of the package).

``instructions.jsonl``: short open instructions written for klrl, composed from the hand-written
templates and topics below (no copied data); ``arithmetic.jsonl``: verifier prompts with answers.

    PYTHONPATH=$PWD python klrl/data/files/make_files.py
"""

import json
import random
from pathlib import Path
from typing import Any

TEMPLATES = [
    "Describe {t} in one sentence.",
    "Describe {t} in two short sentences.",
    "Write a short review of {t}.",
    "What do you think about {t}?",
    "Tell a friend about {t} in a few words.",
    "Write a one-line note about {t}.",
    "Give one reason to enjoy {t}.",
    "Write a short postcard message about {t}.",
    "How would you describe {t} to a child?",
    "Write a tweet about {t}.",
    "Sum up {t} in three words, then explain them briefly.",
    "Write a short diary entry about {t}.",
    "What is the best thing about {t}?",
    "What is the hardest thing about {t}?",
    "Write a haiku about {t}.",
    "Give a short, honest opinion of {t}.",
    "Write a two-sentence story that involves {t}.",
    "Explain why some people like {t}.",
    "Write a short message recommending {t} to a neighbour.",
    "Describe how {t} makes you feel.",
    "Write a friendly sentence about {t}.",
    "Complete the sentence: My favourite thing about {t} is",
    "In one sentence, what would you change about {t}?",
    "Write a short comment about {t} for a travel blog.",
]

# fmt: off
TOPICS = [
    "a rainy afternoon", "the local library", "your morning coffee", "a long train ride", "a city park",
    "an old bicycle", "a busy market", "a quiet beach", "a mountain hike", "a small bakery",
    "a school garden", "a winter evening", "a family dinner", "a summer festival", "a new neighbour",
    "a crowded bus", "a lost umbrella", "a birthday party", "a first day at work", "a used bookshop",
    "a thunderstorm", "a picnic by the river", "a museum visit", "a late flight", "a street musician",
    "a home-cooked meal", "a snowy morning", "a football match", "an early alarm", "a village square",
    "a cup of tea", "a road trip", "a board game night", "a power cut", "a garden in spring",
    "a music lesson", "a hospital waiting room", "a lighthouse", "a farmers' market",
    "a cat on a windowsill",
    "a dog at the park", "a noisy restaurant", "a traffic jam", "a quiet library corner", "a sunset",
    "a camping trip", "a chess club", "a science fair", "a cooking class", "a bike repair shop",
    "an autumn walk", "a bakery queue", "a concert in the rain", "a ferry crossing", "a night market",
    "a broken phone screen", "a handwritten letter", "a long weekend", "a school reunion", "a new recipe",
]
# fmt: on


def instructions(n: int = 400, seed: int = 15) -> list[dict]:
    pairs = [(t, p) for t in TEMPLATES for p in TOPICS]
    random.Random(seed).shuffle(pairs)
    return [{"id": i, "prompt": t.format(t=p), "topic": p} for i, (t, p) in enumerate(pairs[:n])]


def arithmetic_records(n: int, *, seed: int = 0, max_operand: int = 50) -> list[dict[str, Any]]:
    """``n`` prompts "What is a + b?" (+, -, *) with their integer ``answer``: a verifier task."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(1, max_operand), rng.randint(1, max_operand), rng.choice("+-*")
        ans = a + b if op == "+" else a - b if op == "-" else a * b
        word = {"+": "plus", "-": "minus", "*": "times"}[op]
        form = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"What is {a} {word} {b}?"])
        out.append({"prompt": form + " Give the answer as a number.", "answer": ans})
    return out


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    write(here / "instructions.jsonl", instructions())
    write(here / "arithmetic.jsonl", arithmetic_records(500, seed=15))
