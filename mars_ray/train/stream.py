"""Training data as a Ray Data stream (`streaming: true`), for datasets that do not fit the driver.

The driver only plans: each source becomes a Ray Data dataset (Parquet and JSONL files or folders are read
in blocks; bundled and other `datasets` sources are handed over whole), tokenized by `map_batches` tasks in
parallel, and Ray Train splits the union into one equal stream per worker (`get_dataset_shard`). Rows are
read and tokenized only as the workers consume them, so the first step starts at once and the driver never
holds the data.

A worker takes its micro-batches as a fixed number of rows (`batch_size`), of which the skipped ones are
dropped and counted, so every worker takes the same number of micro-steps per epoch and none waits for
another at an epoch's end. The loss is normalised by the joined batch's kept examples (or tokens), summed
over the workers, as in memory. `group_by_length` is the in-memory rule (`batching.py`), applied to each
worker's stream in windows of `MEGABATCH` micro-batches. Each epoch reads the blocks in a new seeded order
through a seeded local shuffle buffer.

`data_report.json` counts, per source, the rows the run has read (kept, cut, skipped by reason); it is
written at every checkpoint, and after a full epoch it equals the in-memory report. A resumed run skips the
rows its finished steps took; which rows those were within the epoch is Ray Data's order, not replayed.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from transformers import AutoTokenizer

from mars_ray import data
from mars_ray.core.errors import ConfigError
from mars_ray.core.objective import Example
from mars_ray.train import batching

SHUFFLE_BUFFER = 1024  # rows in each worker's local shuffle buffer
BLOCK_BYTES = 1 << 20


def source_dataset(source: str, split: str, tasks_count: int) -> ray.data.Dataset:
    """One source's rows, unread: Parquet and JSONL files or folders by block, anything else whole."""
    path = Path(source).expanduser()
    files = sorted(path.glob("*")) if path.is_dir() else [path]
    files = [p for p in files if p.is_file()]
    suffixes = {p.suffix for p in files}
    if suffixes == {".parquet"}:
        names = pq.read_schema(files[0]).names
        _require_messages(source, names)
        return ray.data.read_parquet(str(path), columns=[n for n in ("messages", "complete") if n in names])
    if suffixes == {".jsonl"}:
        with files[0].open() as first:
            _require_messages(source, list(json.loads(first.readline() or "{}")))
        return ray.data.read_json(str(path), lines=True)
    rows = data.load_chats(source, split, tasks_count)  # bundled, save_to_disk folders, Hub ids
    return ray.data.from_arrow(rows.data.table)


def _require_messages(source: str, columns: list[str]) -> None:
    """The first file's columns (or first row's keys) include `messages`: checked before any worker starts."""
    if "messages" not in columns:
        raise ValueError(f"{source!r} has no 'messages' column (columns: {', '.join(columns)})")


@functools.cache
def _tokenizer(model: str):
    return AutoTokenizer.from_pretrained(model)


def tokenize_batch(batch: pa.Table, source: str, model: str, max_length: int) -> pa.Table:
    """`data.tokenize_chat` over a block of rows: every row comes out, a skipped one with its reason."""
    tokenizer = _tokenizer(model)
    messages = batch.column("messages").to_pylist()
    completes = batch.column("complete").to_pylist() if "complete" in batch.column_names else None
    out: dict[str, list] = {"input_ids": [], "labels": [], "skipped": [], "truncated": []}
    for i, chat in enumerate(messages):
        complete = completes is None or completes[i] is not False
        result = data.tokenize_chat(tokenizer, chat, max_length, complete)
        skipped = result if isinstance(result, str) else ""
        out["input_ids"].append([] if skipped else result.input_ids)
        out["labels"].append([] if skipped else result.labels)
        out["skipped"].append(skipped)
        out["truncated"].append(not skipped and not result.complete)
    out["source"] = [source] * len(messages)
    return pa.table(out)


def plan(config, model: str) -> tuple[ray.data.Dataset, int]:
    """The tokenized union of `config.datasets` (nothing read yet but metadata) and its number of rows."""
    # Small output blocks: a worker's first rows are ready once a few thousand chats are tokenized, not
    # when a task has tokenized its whole file (Ray Data's default cuts blocks at 128 MiB).
    ray.data.DataContext.get_current().target_max_block_size = BLOCK_BYTES
    sources = data.load_each(
        config.datasets,
        "datasets",
        lambda source: source_dataset(source, config.split_of(source), config.tasks_count),
    )
    parts, rows = [], 0
    for source, source_rows in zip(config.datasets, sources, strict=True):
        rows += source_rows.count()  # before the map, which could change the count: Parquet metadata only
        parts.append(
            source_rows.map_batches(
                tokenize_batch,
                batch_format="pyarrow",
                batch_size=512,
                fn_kwargs={"source": source, "model": model, "max_length": config.max_length},
            )
        )
    union = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    if not rows:
        raise ConfigError("datasets", f"no rows in {config.datasets}")
    return union, rows


class StreamedBatches:
    """One worker's micro-batches from its Ray Data shard: `rows` rows each, skipped rows dropped and
    counted in `report` (source -> counts)."""

    def __init__(self, shard, rows: int, group_by_length: bool, seed: int) -> None:
        self.shard, self.rows, self.group_by_length, self.seed = shard, rows, group_by_length, seed
        self.report: dict[str, Counter] = {}
        self.pending: list[list[dict]] = []  # micro-batches of rows, ready
        self.order = random.Random(seed)  # of a window's length-grouped micro-batches
        self.stream = self._rows()

    def _rows(self) -> Iterator[dict]:
        for epoch in itertools.count():
            batches = self.shard.iter_batches(
                batch_size=256,
                batch_format="pyarrow",
                local_shuffle_buffer_size=SHUFFLE_BUFFER,
                local_shuffle_seed=batching.epoch_seed(self.seed, epoch),
            )
            for batch in batches:
                yield from batch.to_pylist()

    def _fill(self) -> None:
        if not self.group_by_length:
            self.pending.append(list(itertools.islice(self.stream, self.rows)))
            return
        rows = list(itertools.islice(self.stream, batching.MEGABATCH * self.rows))
        self.pending += batching.group_by_length(rows, self.rows, _length, self._permutation)

    def _permutation(self, count: int) -> list[int]:
        order = list(range(count))
        self.order.shuffle(order)
        return order

    def next(self, count: bool = True) -> list[Example]:
        """The next micro-batch's kept examples; `count=False` skips rows without counting them (resume)."""
        if not self.pending:
            self._fill()
        examples = []
        for row in self.pending.pop(0):
            counts = self.report.setdefault(row["source"], Counter()) if count else Counter()
            counts["rows"] += 1
            if row["skipped"]:
                counts[f"skipped:{row['skipped']}"] += 1
                continue
            counts["kept"] += 1
            counts["truncated"] += bool(row["truncated"])
            examples.append(Example(row["input_ids"], row["labels"], complete=not row["truncated"]))
        return examples


def _length(row: dict) -> int:
    return len(row["input_ids"])


def add_counts(reports: list[dict[str, Counter]]) -> dict[str, Counter]:
    """Several workers' counts (source -> counts), added up."""
    total: dict[str, Counter] = {}
    for report in reports:
        for source, counts in report.items():
            total.setdefault(source, Counter()).update(counts)
    return total


def data_reports(total: dict[str, Counter], sources: list[str]) -> list[dict]:
    """Added-up counts as `DataReport` dicts in the order of `config.datasets`."""
    merged = []
    for source in sources:
        counts = total.get(source, Counter())
        skipped = {k.removeprefix("skipped:"): v for k, v in counts.items() if k.startswith("skipped:")}
        report = data.DataReport(
            source, counts["rows"], counts["kept"], counts["truncated"], Counter(skipped)
        )
        merged.append(report.to_dict())
    return merged
