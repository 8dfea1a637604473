"""Chat data: the bundled offline sources, in OpenAI `messages` format.

Two sources ship with the project and are kept apart in every report:
- `chatterbot`: real English dialogs from the `chatterbot-corpus` package (about 2,400 exchanges).
- `tasks`: instructions with verifiable answers that this module generates (counting, sequences,
  copying, spelling, small sums), for exact-match accuracy. Not real user data.
Each has a deterministic held-out split (by a hash of the prompt) that training never sees.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
from pathlib import Path
from typing import Literal

import yaml

Split = Literal["train", "heldout"]
HELDOUT_PERCENT = 10


def _split_of(key: str) -> Split:
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def chatterbot_dialogs(split: Split = "train") -> list[dict]:
    """The English chatterbot dialogs as chats ending on an assistant turn."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "chatterbot-corpus is not installed: pip install --no-deps chatterbot-corpus==1.3.3"
        )
    rows = []
    for path in sorted((Path(spec.origin).parent / "data" / "english").glob("*.yml")):
        for turns in yaml.safe_load(path.read_text()).get("conversations") or []:
            turns = [str(t).strip() for t in turns if t is not None and str(t).strip()]
            turns = turns[: len(turns) // 2 * 2]
            if not turns:
                continue
            messages = [
                {"role": "user" if i % 2 == 0 else "assistant", "content": text}
                for i, text in enumerate(turns)
            ]
            rows.append({"messages": messages, "source": f"chatterbot/{path.stem}"})
    return [r for r in rows if _split_of(_prompt_key(r)) == split]


WORDS = (
    "apple river stone light music garden window paper orange silver cloud forest bread candle "
    "planet ocean yellow castle winter summer horse pencil mirror rocket button doctor flower "
    "market island basket dragon jacket letter marble nature pillow rabbit spider ticket violin "
    "wallet anchor bottle copper desert engine falcon guitar helmet insect jungle kettle lemon "
    "meadow needle oyster parrot quartz saddle tomato umbrella valley walnut zebra"
).split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November December").split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _task(rng: random.Random) -> tuple[str, str, str]:
    """One (kind, instruction, answer) with an answer that is checked by exact match."""
    kind = rng.choice(["count", "countdown", "letters", "days", "months", "repeat", "spell", "sum", "upper"])
    if kind == "count":
        a = rng.randint(0, 60)
        b = a + rng.randint(3, 12)
        prompt = rng.choice(
            ["Count from {a} to {b}.", "List the numbers from {a} to {b}.", "Count up from {a} to {b}."]
        )
        return kind, prompt.format(a=a, b=b), ", ".join(str(i) for i in range(a, b + 1))
    if kind == "countdown":
        b = rng.randint(5, 60)
        a = b - rng.randint(3, 10)
        return (
            kind,
            f"Count down from {b} to {max(a, 0)}.",
            ", ".join(str(i) for i in range(b, max(a, 0) - 1, -1)),
        )
    if kind == "letters":
        i = rng.randint(0, 20)
        j = rng.randint(i + 3, min(i + 10, 25))
        return kind, f"List the letters from {LETTERS[i]} to {LETTERS[j]}.", ", ".join(LETTERS[i : j + 1])
    if kind == "days":
        start = rng.randrange(7)
        n = rng.randint(3, 7)
        days = [DAYS[(start + k) % 7] for k in range(n)]
        return kind, f"Name {n} days of the week, starting with {days[0]}.", ", ".join(days)
    if kind == "months":
        start = rng.randrange(12)
        n = rng.randint(3, 8)
        months = [MONTHS[(start + k) % 12] for k in range(n)]
        return kind, f"Name {n} months in order, starting with {months[0]}.", ", ".join(months)
    if kind == "repeat":
        phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        prompt = rng.choice(["Repeat exactly: {p}", "Say this back to me: {p}", "Echo the words: {p}"])
        return kind, prompt.format(p=phrase), phrase
    if kind == "spell":
        word = rng.choice(WORDS)
        return kind, f"Spell the word {word}, letter by letter.", "-".join(word)
    if kind == "sum":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return kind, f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
    return kind, f"Write in capital letters: {phrase}", phrase.upper()


def verifiable_tasks(split: Split = "train", count: int = 4000, seed: int = 0) -> list[dict]:
    """`count` generated chats of `split` (deduplicated by prompt), each with its `answer` and `task` kind."""
    rng = random.Random(f"{seed}-{split}")
    rows, seen = [], set()
    while len(rows) < count:
        kind, prompt, answer = _task(rng)
        if prompt in seen or _split_of(prompt) != split:
            continue
        seen.add(prompt)
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "answer": answer, "task": kind, "source": "tasks"})
    return rows


def _prompt_key(row: dict) -> str:
    return "\n".join(m["content"] for m in row["messages"][:-1])


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat up to the assistant's turn: the chat template with the generation prompt.

    A tokenizer without a chat template gets the plain concatenated contents.
    """
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
