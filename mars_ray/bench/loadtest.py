"""Served speed at fixed concurrency: MARS at several tau against the AR baseline, same replica, same run.

    python -m mars_ray.bench.loadtest --model PATH [--concurrency 8] [--requests 64] [--taus 1.0 0.9]

Starts its own local Ray + Serve app on 127.0.0.1 (or targets `--url`), then for each setting sends
`--requests` chat requests from the held-out prompts through `--concurrency` streaming clients and reports
served tokens/s, request latency and time to first token (p50/p95), and tokens per forward. The AR
baseline is the same replica at `block_size=1`: no mask tokens at all, plain KV-cache decoding. `--hf-peer`
adds transformers' static-batch `generate` on the same machine (offline, no server) for reference.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mars_ray import cli_args, data
from mars_ray.bench import machine
from mars_ray.bench.client import (
    SERVED_SOURCE_HELP,
    ReplicaStreamInterval,
    RequestRecord,
    ServedSource,
    heldout_chats,
    percentile,
    stream_chat,
)
from mars_ray.bench.cluster import start_local_ray
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.dtypes import DtypeName, torch_dtype
from mars_ray.serve.config import BlockSize, ModelConfig, Tau
from mars_ray.vllm.config import ENGINE_HELP, Engine


class LoadtestConfig(BaseModel):
    """`python -m mars_ray.bench.loadtest`: what is served, how hard it is driven, and the peers beside it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="a MARS checkpoint folder (or a preset, to validate)")
    url: str | None = Field(None, description="an app already serving --model-name (default: start one here)")
    model_name: str = Field("bench", description="the served model name, with --url")
    concurrency: int = Field(8, ge=1, description="streaming clients at once")
    requests: int = Field(64, ge=1, description="requests per setting")
    rounds: int = Field(2, ge=1, description="settings alternate this many times")
    max_tokens: int = Field(128, ge=1, description="reply budget per request")
    taus: tuple[Tau, ...] = Field((1.0, 0.9), description="lossy MARS at these taus, a row each")
    block_size: BlockSize = Field(4, description="the MARS window (the training block size)")
    verify_taus: tuple[Tau, ...] = Field((), description="verified MARS at these taus, a row each")
    peer_url: str | None = Field(
        None, description="an OpenAI server of a peer (e.g. vLLM) on 127.0.0.1, same prompts"
    )
    peer_name: str | None = Field(None, description="the model name the peer serves")
    peer_label: str = Field("peer", description="the peer's row in the table")
    source: ServedSource = Field("tasks", description=SERVED_SOURCE_HELP)
    port: int = Field(8124, ge=1, le=65535, description="the local app's port (without --url)")
    dtype: DtypeName = Field("auto", description="the replica's weights")
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved for the replica")
    torch_threads: int | None = Field(
        None,
        ge=1,
        validate_default=True,
        description="torch threads of the replica and of --hf-peer (default: the replica's whole CPUs, >= 1)",
    )
    stream_interval_s: ReplicaStreamInterval = 0.0
    compile: bool | None = Field(
        None, description="the replica's `compile`: compiled decode steps (default: the engine's own)"
    )
    hf_peer: bool = Field(False, description="also time transformers' static-batch generate")
    engine: Engine = Field("native", description=ENGINE_HELP)
    output: Path | None = Field(None, description="also write the rows to this JSON file")

    @field_validator("torch_threads")
    @classmethod
    def _replica_default(cls, threads: int | None, info: ValidationInfo) -> int:
        """Left out: the replica's own default, so the HF peer and the report use the count it runs."""
        return threads or max(1, int(info.data.get("num_cpus", 1)))


@dataclass
class Setting:
    """One way of being served: the body fields it adds, and where (None: the app under test)."""

    label: str
    fields: dict
    url: str | None = None
    model: str | None = None


async def run_clients(
    url: str, bodies: list[dict], concurrency: int, timeout_s: float = 600
) -> tuple[list[RequestRecord], float]:
    """Send `bodies` through `concurrency` clients, each taking the next body when its last one ends.

    Returns the records and the wall time from the first send to the last answer."""
    queue = list(reversed(bodies))
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def worker() -> None:
            while queue:
                records.append(await stream_chat(client, url, queue.pop()))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - started


def summarize(label: str, records: list[RequestRecord], wall: float) -> dict:
    tokens = sum(r.completion_tokens for r in records)
    latencies = [r.latency for r in records]
    ttft = [r.first_token - r.started for r in records if r.first_token is not None]
    itl = [i for r in records if (i := r.inter_token) is not None]
    return {
        "setting": label,
        "requests": len(records),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_forward": (
            tokens / max(1, sum(r.forward_passes for r in records))
            if all(r.forward_passes is not None for r in records)
            else float("nan")
        ),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p95_s": percentile(itl, 0.95),
    }


def table(rows: list[dict]) -> str:
    header = (
        "| setting | requests | tokens | tokens/s | x AR | tok/fwd | latency p50 s | p95 s "
        "| TTFT p50 s | p95 s | ITL p50 s | p95 s |"
    )
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = rows[0]["tokens_per_s"] if rows else float("nan")  # the AR baseline comes first
    for r in rows:
        itl = [r.get("itl_p50_s", float("nan")), r.get("itl_p95_s", float("nan"))]
        lines.append(
            f"| {r['setting']} | {r['requests']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base:.2f} | "
            f"{r['tokens_per_forward']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | "
            f"{r['ttft_p50_s']:.3f} | {r['ttft_p95_s']:.3f} | {itl[0]:.4f} | {itl[1]:.4f} |"
        )
    return "\n".join(lines)


def hf_static_batches(args: LoadtestConfig, chats: list[list[dict]]) -> dict:
    """transformers `generate`, greedy, left-padded static batches of `--concurrency`: the offline peer."""
    import torch

    from mars_ray import models
    from mars_ray.bench.baseline import hf_greedy_tokens

    torch.set_num_threads(args.torch_threads)
    model, tokenizer = models.load(args.model, dtype=torch_dtype(args.dtype))
    stops = DecodeConfig.for_model(model, tokenizer).stop_token_ids
    tokens, started = 0, time.perf_counter()
    for i in range(0, len(chats), args.concurrency):
        prompts = [data.chat_prompt_ids(tokenizer, m) for m in chats[i : i + args.concurrency]]
        tokens += sum(
            map(len, hf_greedy_tokens(model, prompts, args.max_tokens, stops, tokenizer.pad_token_id))
        )
    wall = time.perf_counter() - started
    nan = float("nan")
    return {
        "setting": f"HF generate, static batch {args.concurrency} (offline)",
        "requests": len(chats),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_forward": 1.0,
        **dict.fromkeys(["latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s"], nan),
    }


def measure(
    url: str, name: str, settings: list[Setting], chats: list[list[dict]], args: LoadtestConfig
) -> list[dict]:
    """Warm every setting up, then let the settings take turns, round by round, each on its share of the
    prompts: a shared machine's load drifts, and this way every setting meets the same drift."""
    for setting in settings:
        target, model = setting.url or url, setting.model or name
        warm = {"model": model, "messages": chats[0], "max_tokens": 8, **setting.fields}
        asyncio.run(run_clients(target, [warm] * 2, 2))
    results = {setting.label: ([], 0.0) for setting in settings}
    for round_index in range(args.rounds):
        for setting in settings:
            target, model = setting.url or url, setting.model or name
            extra = {**setting.fields, "max_tokens": args.max_tokens}
            if setting.url:  # a peer: the same budget, exactly (it may not stop at EOS otherwise)
                extra |= {"temperature": 0}
            bodies = [{"model": model, "messages": m, **extra} for m in chats[round_index :: args.rounds]]
            records, wall = asyncio.run(run_clients(target, bodies, args.concurrency))
            done, seconds = results[setting.label]
            results[setting.label] = (done + records, seconds + wall)
            speed = sum(r.completion_tokens for r in records) / wall
            print(
                f"round {round_index + 1}, {setting.label}: {speed:.1f} tokens/s", file=sys.stderr, flush=True
            )
    return [summarize(label, records, wall) for label, (records, wall) in results.items()]


def replica(args: LoadtestConfig) -> ModelConfig:
    """The one engine replica the driver serves `--model` with, sized for `--concurrency`."""
    return ModelConfig(
        model=args.model,
        name="bench",
        num_cpus=args.num_cpus,
        dtype=args.dtype,
        torch_threads=args.torch_threads,
        max_tokens=args.max_tokens,
        max_batch_size=args.concurrency,
        max_block_size=max(args.block_size, 16),
        max_ongoing_requests=max(64, 2 * args.concurrency),
        stream_interval_s=args.stream_interval_s,
        compile=args.compile,
        engine=args.engine,
    )


def start_server(args: LoadtestConfig) -> str:
    """A local Ray of its own and one engine replica of `--model` on 127.0.0.1."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray import serve

    from mars_ray.serve.app import build_app

    start_local_ray(args.num_cpus)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app({"models": [replica(args)]}), name="mars-bench", route_prefix="/")
    return f"http://127.0.0.1:{args.port}"


def main(argv: list[str] | None = None) -> None:
    args = cli_args.parse_command(
        LoadtestConfig, argv, prog="python -m mars_ray.bench.loadtest", description=__doc__.split("\n")[0]
    )

    chats = heldout_chats(args.source, args.requests)
    window = args.block_size
    settings = [Setting("AR baseline (KV cache, block_size=1)", {"tau": 1.0, "block_size": 1})]
    settings += [
        Setting(f"MARS tau={tau} (block_size={window})", {"tau": tau, "block_size": window})
        for tau in args.taus
    ]
    settings += [
        Setting(
            f"MARS verified, tau={tau} (block_size={window})",
            {"tau": tau, "block_size": window, "verify": True},
        )
        for tau in args.verify_taus
    ]
    if args.peer_url:
        settings.append(Setting(args.peer_label, {}, args.peer_url, args.peer_name))
    url = args.url or start_server(args)
    name = args.model_name if args.url else "bench"
    try:
        rows = measure(url, name, settings, chats, args)
    finally:
        if not args.url:
            import ray

            ray.shutdown()
    if args.hf_peer:
        rows.append(hf_static_batches(args, chats))

    print(
        f"{time.strftime('%Y-%m-%d')} · {machine.describe()} · {args.model} · "
        f"{args.source} held-out, {len(chats)} requests per setting in {args.rounds} rounds, "
        f"concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, greedy, torch threads {args.torch_threads}, "
        f"stream interval {args.stream_interval_s} s, "
        f"{'compiled' if replica(args).compiled else 'eager'} steps, "
        f"{args.engine} engine"
    )
    print(table(rows))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
