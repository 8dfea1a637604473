"""The load-adaptive tau, proven under a ramp: fixed tau=1.0, fixed tau=tau_min, and the controller.

    python -m mars_ray.bench.ramp --model PATH [--levels 1 4 8 16 16 8 2] [--rounds 2] [--out DIR]

A local Serve app with one replica of `--model` on 127.0.0.1 takes, in each mode, the same bounded ramp of
closed-loop streaming clients (`--levels`, `--stage-s` seconds each), then `--tail-s` idle seconds (the
controller should return to tau_max there). The modes are the replica's controller knobs (its Serve
`user_config`, sent as `serve deploy` sends them): a fixed tau is a ladder of one point. So every mode runs
on the same replica process, started once, and `--rounds` makes the modes take turns: the ratios compare
one engine start with itself (separate vLLM starts moved a setting by up to 20%). The run samples
`GET /v1/status` twice a second (tau, replicas, queue) and records every request. It prints a table (per
round: throughput over the ramp and at its peak stages beside that round's fixed tau=1.0, request latency
and per-token latency p50/p95 at the peak, time-weighted tau, final tau), each mode's peak ratio over the
rounds, and writes `ramp.json` and `ramp.png` (throughput, p95 per-token latency against the objective, and
tau, over time). It stops by itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict
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
    stream_chat,
)
from mars_ray.bench.cluster import start_local_ray
from mars_ray.bench.ramp_report import Sample, plot, record_json, summarize, table
from mars_ray.core.dtypes import DtypeName
from mars_ray.serve.config import BlockSize, ModelConfig, Tau, TauObjective, TauOrNone
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
    rounds: int = Field(1, ge=1, description="the modes take turns this many times on the one replica")
    port: int = Field(8125, ge=1, le=65535, description="the local app's port")
    dashboard_port: int = Field(
        8266, ge=1, le=65535, description="the local cluster's dashboard (Serve's REST API) on 127.0.0.1"
    )
    source: ServedSource = Field("tasks", description=SERVED_SOURCE_HELP)
    out: Path = Field(Path("results/ramp"), description="folder for ramp.json and ramp.png")


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


def modes(args: RampConfig) -> list[str]:
    return ["tau=1.0", f"tau={args.tau_min:g}", "controller"]


def knobs(mode: str, args: RampConfig) -> dict:
    """The replica's controller knobs in a mode: the objective, or a fixed tau as a ladder of one point."""
    objective = TauObjective(
        tau_min=args.tau_min,
        tau_max=1.0,
        tau_step=args.tau_step,
        metric="itl_p95",
        target=args.target,
        patience=2,
        interval_s=1.0,
        verify_tau=args.verify_tau,
    )
    if mode != "controller":
        tau = 1.0 if mode == "tau=1.0" else args.tau_min
        objective = objective.model_copy(update={"tau_min": tau, "tau_max": tau, "verify_tau": None})
    return objective.model_dump()


def served_model(args: RampConfig) -> ModelConfig:
    return ModelConfig(
        model=args.model,
        name="bench",
        block_size=args.block_size,
        num_cpus=args.num_cpus,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        max_batch_size=max(args.levels),
        max_ongoing_requests=2 * max(args.levels),
        stats_window_s=5.0,
        engine=args.engine,
        stream_interval_s=args.stream_interval_s,
    )


def deploy_mode(mode: str, args: RampConfig, dashboard: str) -> None:
    """Deploy the app with the mode's knobs, as `serve deploy` does: the first call starts the replica, the
    next ones change only its `user_config`, which Serve applies to the running replica in place."""
    model = served_model(args)
    app = {
        "name": "ramp",
        "route_prefix": "/",
        "import_path": "mars_ray.serve.app:build_app",
        "args": {"models": [model.model_dump(mode="json", exclude_unset=True)]},
        "deployments": [{"name": model.deployment_name, "user_config": knobs(mode, args)}],
    }
    config = {"http_options": {"host": "127.0.0.1", "port": args.port}, "applications": [app]}
    httpx.put(f"{dashboard}/api/serve/applications/", json=config, timeout=60).raise_for_status()


def wait_for_mode(mode: str, args: RampConfig, url: str, timeout_s: float = 900) -> int:
    """Until the replica reports the mode's knobs and stands at their tau_max (a controller that comes from a
    lower fixed tau climbs there while idle); returns its process id."""
    wanted = knobs(mode, args)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = httpx.get(f"{url}/v1/status", timeout=10).json()["models"].get("bench", {})
        except (httpx.HTTPError, ValueError, KeyError):
            status = {}
        taken = [
            s["pid"]
            for s in status.values()
            if s.get("objective") == wanted and s["controller"]["tau"] == wanted["tau_max"]
        ]
        if len(taken) == len(status) == 1:
            return taken[0]
        time.sleep(1)
    raise TimeoutError(f"the replica did not take mode {mode} within {timeout_s:g} s")


def main(argv: list[str] | None = None) -> None:
    args = cli_args.parse_command(
        RampConfig, argv, prog="python -m mars_ray.bench.ramp", description=__doc__.split("\n")[0]
    )

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    chats = heldout_chats(args.source, 200)
    dashboard = start_local_ray(args.num_cpus, args.dashboard_port)
    url = f"http://127.0.0.1:{args.port}"
    runs, rows, replica, load_ended = {}, [], None, -float("inf")
    try:
        for round_ in range(1, args.rounds + 1):
            for mode in modes(args):
                deploy_mode(mode, args, dashboard)
                pid = wait_for_mode(mode, args, url)
                if replica not in (None, pid):
                    raise RuntimeError(f"the replica restarted (pid {replica} -> {pid}): not one start")
                replica = pid
                if mode == "controller":  # it keeps what it measured for memory_s: none of the last mode's
                    time.sleep(max(0.0, knobs(mode, args)["memory_s"] - (time.perf_counter() - load_ended)))
                start = time.perf_counter()
                records, samples = asyncio.run(ramp(url, chats, args))
                load_ended = time.perf_counter() - args.tail_s
                label = mode if args.rounds == 1 else f"{mode} #{round_}"
                runs[label] = (records, samples, start)
                rows.append({"round": round_, **summarize(mode, records, samples, start, args)})
                print(
                    f"{label}: {rows[-1]['tokens_per_s']:.1f} tokens/s, final tau {rows[-1]['final_tau']}",
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
        "replica_pid": replica,  # every mode and round ran on this one process
        "rows": rows,
        "runs": {
            mode: {
                "records": [record_json(r) for r in rec],
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
