"""Streamed training data (`streaming: true`): Ray Data reads and tokenizes the sources as the workers train,
counts every row as the in-memory path does, and a Parquet folder of 200,000 chats trains with a small
driver (slow: Ray Train fits)."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
import ray
import ray.data
from test_train_data import CUT_AT, assert_eos_supervised_only_where_the_reply_ended, cut_and_whole_rows
from transformers import AutoTokenizer

from mars_ray import models
from mars_ray.bench.stream import chat, run_streamed, write_parquet
from mars_ray.train import stream
from mars_ray.train.config import TrainConfig
from mars_ray.train.run import prepare_data, run_training

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    # Three CPUs: two training workers and a Ray Data task beside them (the machine may have fewer).
    ray.init(address="local", num_cpus=3, include_dashboard=False)
    yield
    ray.shutdown()


def test_streamed_rows_are_counted_as_the_in_memory_path_counts_them(local_ray, tmp_path):
    """One worker reads every row exactly once (one step of all the rows): its per-source report is the
    in-memory run's, skipped rows and their reasons included."""
    chats = [chat(i) for i in range(20)]
    chats += [None, chat(20)[:1], [{"role": "user", "content": "x " * 200}, chat(21)[1]]]  # 3 skipped
    write_parquet(tmp_path / "parquet", chats, files=2)
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in [chat(i, 40) for i in range(7)]))
    values = dict(
        model="tiny",
        datasets=["tasks", str(tmp_path / "parquet"), str(jsonl)],
        tasks_count=30,
        max_length=48,  # the long prompt fills it; the long JSONL replies are cut
        stages=["mars"],
        num_workers=1,
        output_dir=str(tmp_path / "runs"),
    )
    tokenizer = AutoTokenizer.from_pretrained(models.resolve("tiny"))
    in_memory = [r.to_dict() for r in prepare_data(TrainConfig(**values), tokenizer)[1]]
    rows = sum(r["rows"] for r in in_memory)
    assert [r["skipped"] for r in in_memory][1] == {
        "missing messages": 1,
        "last turn not assistant": 1,
        "prompt fills max_length": 1,
    }
    assert in_memory[2]["truncated"] == 7

    no_messages = tmp_path / "text.jsonl"
    no_messages.write_text(json.dumps({"text": "hello"}) + "\n")
    bad = TrainConfig(**{**values, "datasets": ["tasks", str(no_messages)]}, name="bad", streaming=True)
    with pytest.raises(ValueError, match=r"datasets\[1\]: .* no 'messages' column"):
        run_training(bad)
    assert not (bad.run_dir / "mars").exists()  # no worker started

    config = TrainConfig(**values, name="stream", streaming=True, steps=1, batch_size=rows)
    finals = run_training(config)
    assert json.loads((config.run_dir / "data_report.json").read_text()) == in_memory
    assert (finals["mars"] / "model.safetensors").exists()
    (step,) = [
        json.loads(line) for line in (config.run_dir / "mars" / "metrics.jsonl").read_text().splitlines()
    ]
    assert step["loss"] > 0 and step["epoch"] == pytest.approx(1.0)


def test_streamed_cut_replies_never_teach_eos(local_ray):
    """The streamed rows keep what was cut (a `complete: false` reply, a reply cut at `max_length`): their
    examples are not closed with supervised EOS, as in memory (`test_train_data`)."""
    source = models.resolve("tiny")
    rows = pa.Table.from_pylist(cut_and_whole_rows())
    tokenized = stream.tokenize_batch(rows, "rows", source, max_length=CUT_AT)
    batches = stream.StreamedBatches(ray.data.from_arrow(tokenized), 3, group_by_length=False, seed=0)
    examples = sorted(batches.next(), key=lambda e: e.complete)  # the shuffle buffer reorders rows
    batches.stream.close()  # its Ray Data iterator, before the cluster goes
    assert batches.report["rows"]["truncated"] == 2
    assert_eos_supervised_only_where_the_reply_ended(examples, AutoTokenizer.from_pretrained(source))


def test_a_micro_batch_of_skipped_rows_trains_on(local_ray, tmp_path):
    """`batch_size=1` on two workers, half the rows ending on a user turn (skipped): some micro-batches
    hold no example, on one worker or both, and the step still runs on every worker (no restart: none is
    allowed) with the losses of the rows that were kept."""
    chats = [chat(0), chat(1)[:1], chat(2), chat(3)[:1]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    config = TrainConfig(
        model="tiny",
        datasets=[str(path)],
        stages=["mars"],
        streaming=True,
        batch_size=1,
        num_workers=2,
        steps=4,
        checkpoint_every=4,
        max_failures=0,
        output_dir=str(tmp_path / "runs"),
        name="skipped",
    )
    run_training(config)
    steps = [
        json.loads(line) for line in (config.run_dir / "mars" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and steps[0]["resumed_from"] == 0
    assert all(math.isfinite(s["loss"]) for s in steps) and any(s["loss"] > 0 for s in steps)
    (report,) = json.loads((config.run_dir / "data_report.json").read_text())
    assert (report["rows"], report["kept"], report["skipped"]) == (8, 4, {"last turn not assistant": 4})


def test_a_parquet_folder_of_200k_chats_streams_with_a_small_driver(tmp_path):
    """`mars-ray train` over 200,000 generated chats in 8 Parquet files, on 2 workers and its own Ray: the
    driver reads metadata only (its peak RSS stays under 1 GiB) and the workers read what they train on.
    `python -m mars_ray.bench.stream` times the same run."""
    write_parquet(tmp_path / "chats", [chat(i) for i in range(200_000)], files=8)
    run = run_streamed(tmp_path / "chats", tmp_path / "runs", steps=4)
    assert run.returncode == 0, run.output[-3000:]
    assert "200000 rows streamed" in run.output
    print(f"first step {run.first_step_s:.1f} s after start; driver peak RSS {run.driver_peak_mb:.0f} MB")
    assert [s["step"] for s in run.steps] == [1, 2, 3, 4]
    assert 0 < run.driver_peak_mb < 1024
    (report,) = run.report
    assert report["rows"] == 4 * 8 * 2 and report["kept"] == report["rows"]  # read: what was trained on
