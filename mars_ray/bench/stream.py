"""Streamed training data at scale: `mars-ray train streaming=true` over a Parquet folder of generated chats,
timed to its first step, with the driver's peak memory.

    .venv/bin/python -m mars_ray.bench.stream --chats 200000

The chats are generated (a prompt and a short reply each, in `files` Parquet files); the run is `tiny` on
2 Ray Train workers with its own local Ray, so what is measured is the data path, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args
from mars_ray.bench import machine

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def chat(i: int, reply_words: int = 6) -> list[dict]:
    """A deterministic two-turn chat."""
    words = " ".join(f"w{(i * 7 + k) % 97}" for k in range(reply_words))
    return [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}: {words}"}]


def write_parquet(folder: Path, chats: list, files: int) -> None:
    """`chats` (a `messages` value each, None allowed) as `files` Parquet files in a new folder."""
    folder.mkdir(parents=True)
    per_file = -(-len(chats) // files)
    for f in range(files):
        part = chats[f * per_file : (f + 1) * per_file]
        table = pa.table({"messages": pa.array(part, type=MESSAGES)})
        pq.write_table(table, folder / f"part-{f:03d}.parquet")


class StreamBenchConfig(BaseModel):
    """`python -m mars_ray.bench.stream`: how much data, in how many files, and how many steps over it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chats: int = Field(200_000, ge=1, description="generated chats")
    files: int = Field(8, ge=1, description="Parquet files they are written in")
    steps: int = Field(4, ge=1, description="training steps streamed")


@dataclass
class StreamedRun:
    returncode: int
    output: str
    steps: list[dict]  # metrics.jsonl
    first_step_s: float  # from the command's start to the first step's report
    driver_peak_mb: float  # the driver process's peak RSS (VmHWM)
    report: list[dict]  # data_report.json


def _peak_rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1]) / 1024


def run_streamed(data: Path, runs: Path, steps: int = 4, timeout: float = 600) -> StreamedRun:
    """`mars-ray train` (tiny, 2 workers, batch 8, length-grouped) streaming `data`, watched from outside."""
    command = [
        sys.executable, "-m", "mars_ray.cli", "train", "model=tiny", f"datasets=[{data}]", "streaming=true",
        "stages=[mars]", f"steps={steps}", "batch_size=8", "num_workers=2", f"checkpoint_every={steps}",
        "max_length=48", "group_by_length=true", f"output_dir={runs}", "name=stream",
    ]  # fmt: skip
    began = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0.0]

    def watch() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], _peak_rss_mb(process.pid))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    output, _ = process.communicate(timeout=timeout)
    watcher.join()
    log, report = runs / "stream" / "mars" / "metrics.jsonl", runs / "stream" / "data_report.json"
    steps_logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    first = steps_logged[0]["time"] - began if steps_logged else float("nan")
    reported = json.loads(report.read_text()) if report.exists() else []
    return StreamedRun(process.returncode, output, steps_logged, first, peak[0], reported)


def main(argv: list[str] | None = None) -> None:
    args = cli_args.parse_command(
        StreamBenchConfig,
        argv,
        prog="python -m mars_ray.bench.stream",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        write_parquet(Path(folder) / "chats", [chat(i) for i in range(args.chats)], args.files)
        written = time.perf_counter() - began
        run = run_streamed(Path(folder) / "chats", Path(folder) / "runs", args.steps)
    if run.returncode:
        sys.exit(run.output[-3000:])
    print(f"{machine.describe()}, {time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.1f}")
    print(f"{args.chats} chats in {args.files} Parquet files (written in {written:.1f} s)")
    print(f"first step {run.first_step_s:.1f} s after the command started")
    print(f"driver peak RSS {run.driver_peak_mb:.0f} MB")
    pace = (run.steps[-1]["time"] - run.steps[0]["time"]) / max(len(run.steps) - 1, 1)
    print(f"{len(run.steps)} steps, {pace:.2f} s a step after the first; rows read: {run.report[0]['rows']}")


if __name__ == "__main__":
    main()
