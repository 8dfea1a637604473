"""Training benchmark: the MARS step against the AR SFT step on the same batch (the paper: about 2x), and
Ray Train throughput with 1 and 2 workers. Prints markdown for BENCHMARKS.md.

    .venv/bin/python scripts/bench_train.py --model tiny --steps 30
    .venv/bin/python scripts/bench_train.py --model smollm2-135m --strategies --steps 8   # DDP, FSDP, LoRA
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import ray
import torch

from mars_ray import data, models
from mars_ray.bench import machine
from mars_ray.core.objective import ScoredLM, collate_mars, mars_loss
from mars_ray.train import lora
from mars_ray.train.config import TrainConfig
from mars_ray.train.run import run_training
from mars_ray.train.steps import Objective


def step_seconds(model, loss_of: Callable[[list], torch.Tensor], batch, repeats: int, autocast) -> float:
    """Median wall time of forward, backward and AdamW step on `batch` (after one warm-up step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def bench_step(args: argparse.Namespace) -> list[str]:
    """The AR SFT step, the MARS step as the paper's code computes it (the full `[noisy | clean]` sequence,
    logits at every position) and the training loop's MARS step (scored noisy blocks and logits only),
    interleaved per precision."""
    torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model, dtype=torch.float32)
    model.train()
    rows = data.load_chats("tasks", tasks_count=args.batch_size // 2)
    dialogs = data.load_chats("chatterbot").select(range(args.batch_size - len(rows)))
    batch = data.tokenize_chats(rows, tokenizer, args.max_length, "tasks")[0]
    batch += data.tokenize_chats(dialogs, tokenizer, args.max_length, "chatterbot")[0]
    ids = (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id)
    scored = ScoredLM(model)
    ar, mars = (Objective(stage, args.block_size, 1.0, *ids) for stage in ("ar-sft", "mars"))

    def paper_layout(examples):
        full = collate_mars(examples, args.block_size, *ids, compact=False)
        logits = model(
            input_ids=full.input_ids, position_ids=full.position_ids, attention_mask=full.attention_mask
        ).logits
        return mars_loss(logits[full.scored], full).total

    steps = {
        "ar-sft": lambda e: ar.loss_sums(scored, e, "cpu")["total"] / ar.normaliser(e),
        "mars, paper layout": paper_layout,
        "mars": lambda e: mars.loss_sums(scored, e, "cpu")["total"] / mars.normaliser(e),
    }
    tokens = sum(len(e.input_ids) for e in batch)
    lines = [
        f"Step time, one process, {args.threads} threads, `{args.model}`, batch {len(batch)} chats "
        f"(half tasks, half dialogs; {tokens} tokens, max_length {args.max_length}), B={args.block_size}, "
        f"median of {args.repeats}:",
        "",
        "| precision | step | s/step | tokens/s | vs AR SFT |",
        "|---|---|---|---|---|",
    ]
    for precision in args.precisions:
        autocast = torch.bfloat16 if precision == "bf16" else None
        seconds = {name: step_seconds(model, f, batch, args.repeats, autocast) for name, f in steps.items()}
        lines += [
            f"| {precision} | {name} | {s:.3f} | {tokens / s:.0f} | {s / seconds['ar-sft']:.2f}x |"
            for name, s in seconds.items()
        ]
    return lines


def timed_run(
    args: argparse.Namespace, output_dir: str, name: str, workers: int, threads: int, **extra
) -> tuple[TrainConfig, list[dict], float]:
    """One stage-mars run of `args.steps` + 3 steps (the same global batch for any worker count): its
    config, the logged steps after the 3 warm-up steps, and the seconds of the whole fit."""
    config = TrainConfig(
        model=args.model,
        datasets=["tasks", "chatterbot"],
        max_length=args.max_length,
        name=name,
        output_dir=output_dir,
        stages=["mars"],
        steps=args.steps + 3,
        batch_size=args.global_batch // workers,
        num_workers=workers,
        cpus_per_worker=threads,
        checkpoint_every=args.steps + 3,
        lr=1e-4,
        **extra,
    )
    began = time.perf_counter()
    run_training(config)
    fit = time.perf_counter() - began
    log = (config.run_dir / "mars" / "metrics.jsonl").read_text().splitlines()
    return config, [json.loads(line) for line in log][3:], fit


def bench_workers(args: argparse.Namespace) -> list[str]:
    """The same global batch and steps with 1 worker (1 or 2 threads) and 2 workers (1 thread each)."""
    ray.init(address="local", num_cpus=2, dashboard_port=8274)  # not 8265: leave the default free
    lines = [
        f"Ray Train, `{args.model}`, stage mars, global batch {args.global_batch} chats, {args.steps} steps "
        "after 3 warm-up steps (pace: median time between reports; compute: median step inside a worker; "
        "tokens/s: chat tokens over the steps' wall time; fit: all of `TorchTrainer.fit()`):",
        "",
        "| workers x threads | pace s/step | compute s/step | tokens/s | fit s |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as output_dir:
        for workers, threads in ((1, 1), (1, 2), (2, 1)):
            _, steps, fit = timed_run(args, output_dir, f"bench-{workers}x{threads}", workers, threads)
            pace = statistics.median(b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False))
            compute = statistics.median(s["step_time_s"] for s in steps)
            tokens = sum(s["tokens_per_s"] * s["step_time_s"] for s in steps[1:])
            wall = steps[-1]["time"] - steps[0]["time"]
            lines.append(
                f"| {workers} x {threads} | {pace:.3f} | {compute:.3f} | {tokens / wall:.0f} | {fit:.0f} |"
            )
    ray.shutdown()
    return lines


def bench_strategies(args: argparse.Namespace) -> list[str]:
    """DDP, FSDP and LoRA (on DDP) on 2 workers x 1 thread: the same model, global batch and steps."""
    ray.init(address="local", num_cpus=2, dashboard_port=8274)
    lines = [
        f"Ray Train, `{args.model}`, stage mars, 2 workers x 1 thread, global batch {args.global_batch} "
        f"chats (max_length {args.max_length}), {args.steps} steps after 3 warm-up steps (compute: median "
        "step inside a worker; peak memory: the largest worker's peak RSS, model load included; trainable: "
        "parameters AdamW updates):",
        "",
        "| strategy | compute s/step | steps/s | tokens/s | peak memory per worker MB | trainable |",
        "|---|---|---|---|---|---|",
    ]
    variants = {"ddp": {}, "fsdp": {"strategy": "fsdp"}, "lora r=16 (ddp)": {"lora": {"r": 16}}}
    with tempfile.TemporaryDirectory() as output_dir:
        for name, extra in variants.items():
            config, steps, _ = timed_run(
                args, output_dir, f"bench-{name.split()[0]}", 2, 1, precision=args.train_precision, **extra
            )
            compute = statistics.median(s["step_time_s"] for s in steps)
            wall = steps[-1]["time"] - steps[0]["time"]
            tokens = sum(s["tokens_per_s"] * s["step_time_s"] for s in steps[1:])
            peak = max(s["peak_memory_mb"] for s in steps)
            pace = (len(steps) - 1) / wall
            lines.append(
                f"| {name} | {compute:.3f} | {pace:.3f} | {tokens / wall:.0f} | {peak:.0f} "
                f"| {_trainable(args.model, config)} |"
            )
    ray.shutdown()
    return lines


def _trainable(model_name: str, config: TrainConfig) -> str:
    model, _ = models.load(model_name, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    if config.lora is not None:
        model = lora.with_adapters(model, config.lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{trainable / 1e6:.2f}M of {total / 1e6:.2f}M"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=32, help="chats in the step-time batch")
    parser.add_argument("--global-batch", type=int, default=32, help="chats per step in the Ray Train runs")
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="steps per Ray Train run")
    parser.add_argument("--skip-workers", action="store_true", help="only the step-time comparison")
    parser.add_argument(
        "--strategies", action="store_true", help="only DDP against FSDP against LoRA on 2 workers"
    )
    parser.add_argument("--train-precision", choices=("auto", "fp32", "bf16"), default="auto")
    args = parser.parse_args()
    print(f"{machine.describe()}; torch {torch.__version__}, ray {ray.__version__}, ")
    print(f"{time.strftime('%Y-%m-%d')}; load average {os.getloadavg()[0]:.1f} at start\n")
    if args.strategies:
        print("\n".join(bench_strategies(args)))
        return
    print("\n".join(bench_step(args)) + "\n")
    if not args.skip_workers:
        print("\n".join(bench_workers(args)))


if __name__ == "__main__":
    main()
