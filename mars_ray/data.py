"""Chat data in OpenAI `messages` format: the bundled offline sources, any `datasets` source, and the
tokenization that training uses (only the last assistant turn supervised, every skipped row counted).

Sources that ship with the project, kept apart in every report:
- `chatterbot`: real English dialogs from the `chatterbot-corpus` package (about 2,400 exchanges).
- `chatterbot-prompts`: every distinct utterance of the `chatterbot` dialogs of a split, as a one-turn
  prompt with no reply: prompts for `mars-ray distill`, which writes the replies.
- `tasks`: instructions with verifiable answers that this module generates (counting, sequences,
  copying, spelling, small sums), for exact-match accuracy. Not real user data.
Each has deterministic splits by a hash: `heldout` (10%: evaluation), `calibration` (5%: fitting decoding
knobs such as confidence temperatures) and `train` (the rest), which never meet. Dialogs are split by their
prompt; a task by its content (kind and answer), since one task has several wordings.

A row may carry `complete: false` (a distilled reply cut at its token budget): its chat is then not
closed, so training never learns to end a reply where the budget happened to cut it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import datasets
import yaml
from jinja2 import TemplateError

from mars_ray.core.errors import ConfigError
from mars_ray.core.objective import IGNORE, Example

Split = Literal["train", "calibration", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "calibration", "heldout")
HELDOUT_PERCENT, CALIBRATION_PERCENT = 10, 5


def _split_of(key: str) -> Split:
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    return "calibration" if bucket < HELDOUT_PERCENT + CALIBRATION_PERCENT else "train"


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


def chatterbot_prompts(split: Split = "train") -> list[dict]:
    """Each distinct utterance of the split's dialogs as a one-turn user prompt, in corpus order.

    An utterance that also occurs in another split's dialogs is left out, so no other split's text is
    ever a prompt here.
    """

    def utterances(rows: list[dict]) -> dict[str, None]:
        return dict.fromkeys(m["content"] for r in rows for m in r["messages"])

    own = utterances(chatterbot_dialogs(split))
    others = {u for other in SPLITS if other != split for u in utterances(chatterbot_dialogs(other))}
    return [
        {"messages": [{"role": "user", "content": u}], "source": "chatterbot-prompts"}
        for u in own
        if u not in others
    ]


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
    """`count` generated chats of `split` (deduplicated by prompt), each with its `answer` and `task` kind.

    A task's split is that of its content, not of its wording: "Count from 13 to 18." and "List the numbers
    from 13 to 18." are one task, so they are never in different splits. Within a kind the answer names the
    task's arguments, so kind and answer are the content.
    """
    rng = random.Random(f"{seed}-{split}")
    rows, seen = [], set()
    while len(rows) < count:
        kind, prompt, answer = _task(rng)
        if prompt in seen or _split_of(f"{kind}\n{answer}") != split:
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


BUNDLED_SOURCES = ("tasks", "chatterbot", "chatterbot-prompts")


def load_chats(source: str, split: str = "train", tasks_count: int = 4000) -> datasets.Dataset:
    """Any chat source as a `datasets.Dataset` with a `messages` column.

    `source` is a bundled name (`tasks`, `chatterbot`, `chatterbot-prompts`: their own splits), a local
    JSONL, JSON or Parquet file, a folder (`save_to_disk` output or files `datasets` recognises), or a Hub
    dataset id.
    """
    if source in BUNDLED_SOURCES and split not in SPLITS:
        raise ValueError(f"{source!r} has the splits {', '.join(SPLITS)}, not {split!r}")
    if source == "tasks":
        dataset = datasets.Dataset.from_list(verifiable_tasks(split, count=tasks_count))
    elif source == "chatterbot":
        dataset = datasets.Dataset.from_list(chatterbot_dialogs(split))
    elif source == "chatterbot-prompts":
        dataset = datasets.Dataset.from_list(chatterbot_prompts(split))
    else:
        dataset = _load_external(source, split)
    if "messages" not in dataset.column_names:
        raise ValueError(f"{source!r} has no 'messages' column (columns: {', '.join(dataset.column_names)})")
    return dataset


Loaded = TypeVar("Loaded")


def load_each(sources: Sequence[str], field: str, load: Callable[[str], Loaded]) -> list[Loaded]:
    """`load(source)` for each of the config list `field`; a source that cannot be loaded (missing, not
    chats, no such split) is a `ConfigError` on `field[i]`, raised before any work starts."""
    loaded = []
    for i, source in enumerate(sources):
        try:
            loaded.append(load(source))
        except (ValueError, OSError) as error:
            raise ConfigError(f"{field}[{i}]", str(error)) from None
    return loaded


def _load_external(source: str, split: str) -> datasets.Dataset:
    path = Path(source).expanduser()
    formats = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if path.is_file():
        if path.suffix not in formats:
            raise ValueError(f"{source!r}: unsupported file type (use .jsonl, .json or .parquet)")
        return datasets.load_dataset(formats[path.suffix], data_files=str(path), split="train")
    if path.is_dir() and (path / "dataset_info.json").exists():
        loaded = datasets.load_from_disk(str(path))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    if not path.exists() and source.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"dataset {source!r}: no such file or folder")
    return datasets.load_dataset(str(path) if path.is_dir() else source, split=split)


@dataclass
class DataReport:
    """What became of each row of one source: kept (and how many cut to max_length), or skipped and why."""

    source: str
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{count} {reason}" for reason, count in self.skipped.most_common()) or "none"
        kept = f"{self.kept}/{self.rows} rows kept ({self.truncated} truncated)"
        return f"{self.source}: {kept}; skipped: {reasons}"

    def to_dict(self) -> dict:
        return {**asdict(self), "skipped": dict(self.skipped)}


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a whole chat: the chat template without a generation prompt (`chat_prompt_ids`' twin)."""
    if tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]


def _malformed(messages) -> str | None:
    """Why a `messages` value cannot be trained on, or None when it can."""
    if not isinstance(messages, list) or not messages:
        return "missing messages"
    for message in messages:
        if not isinstance(message, dict) or not all(
            isinstance(message.get(key), str) for key in ("role", "content")
        ):
            return "malformed message"
    if messages[-1]["role"] != "assistant":
        return "last turn not assistant"
    return None


def tokenize_chat(tokenizer, messages, max_length: int, complete: bool = True) -> Example | str:
    """One chat as an `Example` supervising only its last (assistant) turn, or why it is skipped.

    The prompt is the template over `messages[:-1]` with the generation prompt; it must be a prefix of the
    whole chat. A chat whose prompt alone fills `max_length` is skipped (nothing would be supervised); a
    longer one keeps its first `max_length` tokens, so a long answer loses its tail and its EOS (the
    reference code does the same). `complete=False`: the last turn was cut short, so the template's closing
    tokens after it (ChatML: `<|im_end|>` and a newline) are left out. Either cut gives an example with
    `complete=False`, which training never teaches to end.
    """
    problem = _malformed(messages)
    if problem:
        return problem
    try:
        ids = chat_ids(tokenizer, messages)
        prompt = chat_prompt_ids(tokenizer, messages[:-1])
        if not complete:
            empty = messages[:-1] + [{"role": messages[-1]["role"], "content": ""}]
            closing = len(chat_ids(tokenizer, empty)) - len(prompt)
            ids = ids[: len(ids) - max(closing, 0)]
    except (TemplateError, ValueError, TypeError):  # a template may reject a chat (roles out of order)
        return "chat template failed"
    if ids[: len(prompt)] != prompt:
        return "prompt not a prefix of the chat"
    if len(prompt) >= max_length:
        return "prompt fills max_length"
    labels = [IGNORE] * len(prompt) + ids[len(prompt) :]
    return Example(ids[:max_length], labels[:max_length], complete and len(ids) <= max_length)


def tokenize_chats(
    rows: datasets.Dataset, tokenizer, max_length: int, source: str
) -> tuple[list[Example], DataReport]:
    """Tokenize every row of one source (`tokenize_chat`), counting what is kept, cut and skipped (never
    silently): a row cut at `max_length` or with `complete: false` (a reply cut at its budget) counts as
    truncated."""
    report = DataReport(source)
    examples = []
    completes = rows["complete"] if "complete" in rows.column_names else [True] * len(rows)
    for messages, complete in zip(rows["messages"], completes, strict=True):
        report.rows += 1
        result = tokenize_chat(tokenizer, messages, max_length, complete is not False)
        if isinstance(result, str):
            report.skipped[result] += 1
            continue
        report.kept += 1
        report.truncated += not result.complete
        examples.append(result)
    return examples, report
