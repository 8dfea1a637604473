"""The load-adaptive tau, proven under a ramp: fixed tau=1.0, fixed tau=tau_min, and the controller.

    python -m mars_ray.bench.ramp --model PATH [--levels 1 4 8 16 16 8 2] [--stage-s 15] [--out DIR]

For each mode, a local Serve app with one replica of `--model` on 127.0.0.1 takes the same bounded ramp of
closed-loop streaming clients (`--levels`, `--stage-s` seconds each), then `--tail-s` idle seconds (the
controller should return to tau_max there). The run samples `GET /v1/status` twice a second (tau, replicas,
queue) and records every request. It prints a table (throughput over the ramp and at its peak stages beside
the fixed tau=1.0 run's, request latency and per-token latency p50/p95 at the peak, time-weighted tau, final
tau) and writes `ramp.json` and `ramp.png` (throughput, p95 per-token latency against the objective, and
tau, over time). It stops by itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from mars_ray import cli_args
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
from mars_ray.core.dtypes import DtypeName
from mars_ray.serve.config import BlockSize, Tau, TauOrNone
from mars_ray.vllm.config import ENGINE_HELP, Engine


class RampConfig(BaseModel):
    """`python -m mars_ray.bench.ramp`: the replica, the ramp of clients, and the controller's objective."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="a MARS checkpoint folder (or a preset)")
    levels: tuple[PositiveInt, ...] = Field(
        (1, 4, 8, 16, 16, 8, 2), min_length=1, description="clients at each stage, in turn"
    )
    stage_s: float = Field(15.0, gt=0, description="seconds each stage lasts")
    tail_s: float = Field(20.0, ge=0, description="idle seconds after the last stage")
    max_tokens: int = Field(64, ge=1, description="reply budget per request")
    tau_min: Tau = Field(0.7, description="the controller's floor, and the second fixed tau")
    tau_step: float = Field(0.05, gt=0, le=1, description="how far the controller moves tau per decision")
    target: float = Field(0.03, gt=0, description="objective: p95 seconds per token")
    block_size: BlockSize = Field(4, description="the MARS window (the training block size)")
    verify_tau: TauOrNone = Field(
        None, description="the controller's lossless first step: verified decoding at this tau"
    )
    dtype: DtypeName = Field("auto", description="the replica's weights")
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved for the replica")
    engine: Engine = Field("native", description=ENGINE_HELP)
    stream_interval_s: ReplicaStreamInterval = 0.0
    port: int = Field(8125, ge=1, le=65535, description="the local app's port")
    source: ServedSource = Field("tasks", description=SERVED_SOURCE_HELP)
    out: Path = Field(Path("results/ramp"), description="folder for ramp.json and ramp.png")


@dataclass
class Sample:
    at: float
    clients: int
    tau: float | None
    replicas: int
    waiting: int
    verified: float = 0.0  # the share of replicas at the verified (lossless) operating point


async def ramp(
    url: str, chats: list[list[dict]], args: RampConfig
) -> tuple[list[RequestRecord], list[Sample]]:
    """Drive the ramp: client i is active while the stage's level exceeds i; sample status meanwhile."""
    records: list[RequestRecord] = []
    samples: list[Sample] = []
    level = 0
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=max(args.levels) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def run_client(index: int) -> None:
            turn = index
            while not stop.is_set():
                if index >= level:
                    await asyncio.sleep(0.05)
                    continue
                messages = chats[turn % len(chats)]
                turn += max(args.levels)
                body = {"model": "bench", "messages": messages, "max_tokens": args.max_tokens}
                records.append(await stream_chat(client, url, body))

        async def watch() -> None:
            while not stop.is_set():
                try:
                    status = (await client.get(f"{url}/v1/status")).json()["models"].get("bench", {})
                except (httpx.HTTPError, ValueError):
                    status = {}
                taus = [s.get("controller", {}).get("tau", s["stats"]["tau"]) for s in status.values()]
                verified = [s.get("controller", {}).get("verify", False) for s in status.values()]
                waiting = sum(s["stats"]["waiting"] for s in status.values())
                tau = sum(taus) / len(taus) if taus else None
                share = sum(verified) / len(verified) if verified else 0.0
                samples.append(Sample(time.perf_counter(), level, tau, len(status), waiting, share))
                await asyncio.sleep(0.5)

        tasks = [asyncio.create_task(run_client(i)) for i in range(max(args.levels))]
        tasks.append(asyncio.create_task(watch()))
        for stage_level in args.levels:
            level = stage_level  # the clients read it
            await asyncio.sleep(args.stage_s)
        level = 0
        await asyncio.sleep(args.tail_s)
        stop.set()
        await asyncio.gather(*tasks)
    return records, samples


def time_weighted_mean(points: list[tuple[float, float]]) -> float:
    """Mean of a step function given as (time, value) points."""
    if len(points) < 2:
        return float("nan")
    area = sum(value * (later - at) for (at, value), (later, _) in zip(points, points[1:], strict=False))
    return area / (points[-1][0] - points[0][0])


def peak_window(args: RampConfig) -> tuple[float, float]:
    """Seconds from the ramp's start: the first run of stages at the highest level."""
    first = args.levels.index(max(args.levels))
    stages = next(
        (n for n, level in enumerate(args.levels[first:]) if level != args.levels[first]),
        len(args.levels) - first,
    )
    return first * args.stage_s, (first + stages) * args.stage_s


def tokens_within(records: list[RequestRecord], lo: float, hi: float) -> float:
    """Tokens streamed between lo and hi, each reply's tokens spread evenly from its first to its last."""
    total = 0.0
    for r in records:
        if r.first_token is None or r.completion_tokens == 0:
            continue
        span = r.finished - r.first_token
        if span <= 0:
            total += r.completion_tokens * (lo <= r.finished < hi)
        else:
            overlap = min(hi, r.finished) - max(lo, r.first_token)
            total += r.completion_tokens * max(0.0, overlap) / span
    return total


def summarize(
    mode: str, records: list[RequestRecord], samples: list[Sample], start: float, args: RampConfig
) -> dict:
    loaded_until = start + args.stage_s * len(args.levels)
    loaded = [r for r in records if r.finished <= loaded_until + 30]
    peak_lo, peak_hi = (start + t for t in peak_window(args))
    peak = [r for r in loaded if peak_lo <= r.started < peak_hi]
    per_token = [p for r in peak if (p := r.inter_token) is not None]
    latencies = [r.latency for r in peak]
    span = max(r.finished for r in loaded) - start if loaded else 1.0
    weighted = time_weighted_mean(
        [(s.at, s.tau) for s in samples if s.tau is not None and s.at <= loaded_until]
    )
    final = [s.tau for s in samples if s.tau is not None]
    verified = time_weighted_mean([(s.at, s.verified) for s in samples if s.at <= loaded_until])
    return {
        "mode": mode,
        "requests": len(loaded),
        "tokens_per_s": sum(r.completion_tokens for r in loaded) / span,
        "peak_tokens_per_s": tokens_within(records, peak_lo, peak_hi) / (peak_hi - peak_lo),
        "peak_latency_p50_s": percentile(latencies, 0.5),
        "peak_latency_p95_s": percentile(latencies, 0.95),
        "peak_per_token_p50_s": percentile(per_token, 0.5),
        "peak_per_token_p95_s": percentile(per_token, 0.95),
        "mean_tau": weighted,
        "verified_share": verified,
        "final_tau": final[-1] if final else float("nan"),
        "max_replicas": max((s.replicas for s in samples), default=0),
    }


def table(rows: list[dict], target: float) -> str:
    lines = [
        "| mode | requests | tokens/s | peak tokens/s | x tau=1.0 | p50 latency s | p95 latency s "
        "| p50 s/token | p95 s/token "
        f"| p95 vs objective ({target:g} s/token) | mean tau | verified | tau after load | replicas |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0]["peak_tokens_per_s"] if rows else float("nan")  # fixed tau=1.0 runs first
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['peak_tokens_per_s']:.1f} "
            f"| {r['peak_tokens_per_s'] / base:.2f} | {r['peak_latency_p50_s']:.2f} "
            f"| {r['peak_latency_p95_s']:.2f} | {r['peak_per_token_p50_s']:.4f} "
            f"| {r['peak_per_token_p95_s']:.4f} "
            f"| {r['peak_per_token_p95_s'] / target:.2f}x | {r['mean_tau']:.3f} "
            f"| {100 * r['verified_share']:.0f}% | {r['final_tau']:.2f} "
            f"| {r['max_replicas']} |"
        )
    return "\n".join(lines)


def plot(
    runs: dict[str, tuple[list[RequestRecord], list[Sample], float]], target: float, path: Path, bin_s: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for mode, (records, samples, start) in runs.items():
        end = max(s.at for s in samples) - start
        edges = [i * bin_s for i in range(int(end / bin_s) + 1)]
        done = [[r for r in records if e <= r.finished - start < e + bin_s] for e in edges]
        axes[0].plot(edges, [sum(r.completion_tokens for r in d) / bin_s for d in done], label=mode)
        p95 = [percentile([p for r in d if (p := r.inter_token) is not None], 0.95) for d in done]
        axes[1].plot(edges, p95, label=mode)
        axes[2].step(
            [s.at - start for s in samples],
            [s.tau if s.tau else float("nan") for s in samples],
            where="post",
            label=mode,
        )
        axes[3].step([s.at - start for s in samples], [s.replicas for s in samples], where="post", label=mode)
    clients_x = [s.at - start for s in samples]
    twin = axes[0].twinx()
    twin.step(clients_x, [s.clients for s in samples], where="post", color="grey", alpha=0.4)
    twin.set_ylabel("clients (grey)")
    axes[1].axhline(target, color="red", linestyle="--", label="objective")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel("p95 s/token")
    axes[2].set_ylabel("operating tau")
    axes[3].set_ylabel("replicas")
    axes[3].set_xlabel("seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("Ramp: fixed tau=1.0, fixed tau=tau_min, load-adaptive tau (same replica count)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _record_json(record: RequestRecord) -> dict:
    """A request as `ramp.json` has always written it (the keys its readers know)."""
    return {
        "started": record.started,
        "first": record.first_token,
        "finished": record.finished,
        "tokens": record.completion_tokens,
    }


def serve_mode(mode: str, args: RampConfig) -> str:
    """(Re)deploy the app for one mode: fixed tau, or the controller with the objective."""
    from ray import serve

    from mars_ray.serve.app import build_app

    model = {
        "model": args.model,
        "name": "bench",
        "block_size": args.block_size,
        "num_cpus": args.num_cpus,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "max_batch_size": max(args.levels),
        "max_ongoing_requests": 2 * max(args.levels),
        "stats_window_s": 5.0,
        "engine": args.engine,
        "stream_interval_s": args.stream_interval_s,
    }
    if mode == "controller":
        model["tau_control"] = {
            "tau_min": args.tau_min,
            "tau_max": 1.0,
            "tau_step": args.tau_step,
            "metric": "itl_p95",
            "target": args.target,
            "patience": 2,
            "interval_s": 1.0,
            "verify_tau": args.verify_tau,
        }
    else:
        model["tau"] = 1.0 if mode == "tau=1.0" else args.tau_min
    serve.run(build_app({"models": [model]}), name="ramp", route_prefix="/")
    return f"http://127.0.0.1:{args.port}"


def main(argv: list[str] | None = None) -> None:
    args = cli_args.parse_command(
        RampConfig, argv, prog="python -m mars_ray.bench.ramp", description=__doc__.split("\n")[0]
    )

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    chats = heldout_chats(args.source, 200)
    start_local_ray(args.num_cpus)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    runs, rows = {}, []
    try:
        for mode in ("tau=1.0", f"tau={args.tau_min:g}", "controller"):
            url = serve_mode(mode, args)
            start = time.perf_counter()
            records, samples = asyncio.run(ramp(url, chats, args))
            runs[mode] = (records, samples, start)
            rows.append(summarize(mode, records, samples, start, args))
            print(
                f"{mode}: {rows[-1]['tokens_per_s']:.1f} tokens/s, final tau {rows[-1]['final_tau']}",
                flush=True,
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    plot(runs, args.target, args.out / "ramp.png", bin_s=max(args.stage_s / 3, 1.0))
    dump = {
        "args": args.model_dump(mode="json"),
        "machine": machine.describe(),
        "rows": rows,
        "runs": {
            mode: {
                "records": [_record_json(r) for r in rec],
                "samples": [asdict(s) for s in sam],
                "start": st,
            }
            for mode, (rec, sam, st) in runs.items()
        },
    }
    (args.out / "ramp.json").write_text(json.dumps(dump, indent=1))
    print(
        f"{time.strftime('%Y-%m-%d')} · {machine.describe()} · {args.model} · "
        f"levels {list(args.levels)} x {args.stage_s:g}s, tail {args.tail_s:g}s, max_tokens {args.max_tokens}"
    )
    print(table(rows, args.target))


if __name__ == "__main__":
    main()
