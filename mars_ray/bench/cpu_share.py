"""Where a server's CPU goes per token: streamed greedy chats sent to an OpenAI server on 127.0.0.1 at a
concurrency, and the CPU seconds each process on the machine spent meanwhile, grouped by process title (Ray
names its actors `ray::<class>`, vLLM its engine core `VLLM::EngineCore`), per 1,000 completion tokens.

    .venv/bin/python -m mars_ray.bench.cpu_share --url http://127.0.0.1:8200 --model peer --concurrency 1

On a machine with few cores every process on a token's way takes its CPU from the decoding threads: this
tells the cost of each hop (HTTP proxy, ingress, engine replica, engine core) apart, for any server.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args
from mars_ray.bench import machine
from mars_ray.bench.client import SERVED_SOURCE_HELP, ServedSource, heldout_chats
from mars_ray.bench.loadtest import run_clients

TICKS = os.sysconf("SC_CLK_TCK")


class CpuShareConfig(BaseModel):
    """`python -m mars_ray.bench.cpu_share`: the server, the load, and what each request asks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(description="the OpenAI server's base URL (127.0.0.1)")
    model: str = Field(description="the model name it serves")
    label: str = Field("server", description="the server's name in the report")
    requests: int = Field(16, ge=1, description="chats sent")
    concurrency: int = Field(1, ge=1, description="chats in flight at once")
    max_tokens: int = Field(64, ge=1, description="new tokens per chat")
    source: ServedSource = Field("tasks", description=SERVED_SOURCE_HELP)
    fields: cli_args.JsonObject = Field(
        "{}", description="extra request fields, a JSON object (e.g. mars-ray's tau)"
    )
    output: Path | None = Field(None, description="a JSON report")


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's title and CPU seconds so far (user + system), this one left out."""
    seen = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
        words = [w.decode(errors="replace") for w in argv if w]
        # a kernel thread has no command line: its name is the kernel's
        name = title(words) if words else stat[stat.index("(") + 1 : stat.rindex(")")]
        seen[int(entry.name)] = (name, ticks / TICKS)
    return seen


def title(argv: list[str]) -> str:
    """A process's name as its reader knows it: Ray and vLLM retitle theirs (`ray::ServeReplica:...`,
    `VLLM::EngineCore`); a Python program is its script or module, not `python`."""
    name = argv[0].split()[0].rsplit("/", 1)[-1]
    if name.startswith("python"):
        words = iter(argv[1:])
        for word in words:
            if word == "-m":
                return next(words, name)[:64]
            if word == "-c":
                return f"{name} -c"
            if not word.startswith("-"):
                return word.rsplit("/", 1)[-1][:64]
    return name[:64]


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per process title between two readings (a process started between them from zero)."""
    by_title: dict[str, float] = defaultdict(float)
    for pid, (title, seconds) in after.items():
        by_title[title] += seconds - before.get(pid, (title, 0.0))[1]
    return {title: s for title, s in sorted(by_title.items(), key=lambda item: -item[1]) if s > 0}


def main(argv: list[str] | None = None) -> None:
    args = cli_args.parse_command(
        CpuShareConfig, argv, prog="python -m mars_ray.bench.cpu_share", description=__doc__.split("\n")[0]
    )
    chats = heldout_chats(args.source, args.requests)
    extra = {"max_tokens": args.max_tokens, "temperature": 0, **json.loads(args.fields)}
    bodies = [{"model": args.model, "messages": chat, **extra} for chat in chats]
    asyncio.run(run_clients(args.url, bodies[:2], 2))  # warm
    before, started = cpu_seconds(), time.perf_counter()
    records, _ = asyncio.run(run_clients(args.url, bodies, args.concurrency))
    wall, after = time.perf_counter() - started, cpu_seconds()
    tokens = sum(r.completion_tokens for r in records)
    per_title = spent(before, after)
    total = sum(per_title.values())
    report = {
        "label": args.label,
        "machine": machine.describe(),
        "config": args.model_dump(mode="json"),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "cpu_s": total,
        "cores_busy": total / wall,
        "cpu_s_per_1k_tokens": {title: 1000 * s / tokens for title, s in per_title.items()},
    }
    print(f"| {args.label}, concurrency {args.concurrency} | CPU s | per 1k tokens | share |")
    print("|---|---:|---:|---:|")
    for title, seconds in per_title.items():
        if seconds >= 0.01 * total:
            print(f"| {title} | {seconds:.1f} | {1000 * seconds / tokens:.1f} | {seconds / total:.0%} |")
    print(
        f"{tokens} tokens in {wall:.1f} s ({tokens / wall:.1f} tokens/s); {total:.1f} CPU s, "
        f"{total / wall:.2f} cores busy",
        file=sys.stderr,
    )
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
