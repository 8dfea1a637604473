"""The driver: prepare the data once, then run each stage as a Ray Train `TorchTrainer` fit.

A run lives in `output_dir/name/`:

    config.yaml        the config it was started with (a rerun must match it)
    data_report.json   rows kept, truncated and skipped (by reason) for each source
    ar-sft/            Ray Train's run folder: checkpoint_000100/ ..., metrics.jsonl, and
      final/           the stage's result, a plain `save_pretrained` folder (stage 2 starts from it); with
                       `lora.gated`, the gated folder (the base it names plus its adapter, `core/gated.py`)
      final-adapter/   with LoRA: the adapter of final/, unmerged (final/ is it merged into the base)
    mars/
      final/

Rerunning the same name skips finished stages and resumes an unfinished one from its latest checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import ray
import ray.train
from ray.train.torch import TorchTrainer
from transformers import AutoTokenizer

from mars_ray import data, folders, models
from mars_ray.core.errors import ConfigError
from mars_ray.core.objective import Example
from mars_ray.train import lora, sharding, stream
from mars_ray.train.config import Stage, TrainConfig
from mars_ray.train.loop import train_worker
from mars_ray.train.steps import TRAINER_STATE, is_manifest, verify_checkpoint

RESUMABLE_CHANGES = {"max_failures", "checkpoint_every", "keep_checkpoints"}  # safe to change on a rerun
# The workers may change on a rerun while the global batch stays: each step then trains on the same examples
# (a sharded checkpoint is resharded on load).
WORKER_LAYOUT = {"num_workers", "batch_size", "grad_accum", "cpus_per_worker"}
# Ray Train's controller collects reports when it polls the workers (every 2 s by default), and a worker's
# report waits until its previous one was collected: with per-step reports, a 2 s poll caps training at one
# step per 2 s. The controller reads this variable from the driver's environment.
POLL_INTERVAL = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def prepare_data(config: TrainConfig, tokenizer) -> tuple[list[Example], list[data.DataReport]]:
    """Load and tokenize every source on the driver, before any worker starts; report what was skipped."""
    tokenized = data.load_each(
        config.datasets,
        "datasets",
        lambda source: data.tokenize_chats(
            data.load_chats(source, config.split_of(source), config.tasks_count),
            tokenizer,
            config.max_length,
            source,
        ),
    )
    examples = [example for source_examples, _ in tokenized for example in source_examples]
    if not examples:
        raise ConfigError("datasets", f"no usable rows in {config.datasets}")
    return examples, [report for _, report in tokenized]


def check_rerun(config: TrainConfig) -> None:
    """A run name is resumed only under the config it started with: its checkpoints depend on it."""

    def resumable(saved: dict) -> set[str]:
        saved_batch = math.prod(saved.get(k, 0) for k in ("batch_size", "grad_accum", "num_workers"))
        return RESUMABLE_CHANGES | (WORKER_LAYOUT if saved_batch == config.global_batch else set())

    folders.check_rerun(config.run_dir / "config.yaml", config.model_dump(), resumable, "name")


class ProgressLog(ray.train.UserCallback):
    """Runs in the Ray Train controller: every step into `metrics.jsonl`, and a line on the driver's console
    at most every `PRINT_EVERY_S` seconds, and at every checkpoint."""

    PRINT_EVERY_S = 1.0

    def __init__(self, stage: Stage, total_steps: int, path: Path) -> None:
        self.stage, self.total_steps, self.path = stage, total_steps, path
        self.printed = 0.0

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        step = dict(metrics[0])  # the rank-0 worker's; the losses are already summed over workers
        now = time.time()
        if "data_report" in step:  # streamed data: the rows read so far
            report = json.dumps(step.pop("data_report"), indent=2)
            (self.path.parent.parent / "data_report.json").write_text(report)
        with self.path.open("a") as log:
            log.write(json.dumps({**step, "checkpoint": checkpoint is not None, "time": now}) + "\n")
        if not checkpoint and now - self.printed < self.PRINT_EVERY_S:
            return
        self.printed = now
        parts = "".join(
            f" {name[:-5]} {step[name]:.3f}" for name in ("noisy_loss", "clean_loss") if name in step
        )
        print(
            f"[{self.stage}] step {step['step']}/{self.total_steps} epoch {step['epoch']:.2f} "
            f"loss {step['loss']:.4f}{parts} lr {step['lr']:.2e} {step['tokens_per_s']:.0f} tok/s"
            + (" (checkpoint)" if checkpoint else ""),
            flush=True,
        )


def _checkpoint_files(checkpoint: ray.train.Checkpoint, folder: Path) -> None:
    """The checkpoint's files, verified, minus the trainer state and manifest: what a user loads."""
    checkpoint.to_directory(str(folder))
    verify_checkpoint(folder)
    (folder / TRAINER_STATE).unlink()
    shutil.rmtree(folder / sharding.SHARDS, ignore_errors=True)
    for path in folder.iterdir():
        if is_manifest(path.name):
            path.unlink()


def fit_stage(
    config: TrainConfig, stage: Stage, source: str, inputs: dict, rows: int, total_steps: int
) -> Path:
    """One stage on `config.num_workers` Ray Train workers; returns its `final/` folder. `inputs` holds the
    data: `examples` (an object ref of every example) or `datasets` (Ray Data, streamed); `rows` is its
    number of rows (an epoch)."""
    stage_dir = config.run_dir / stage
    stage_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(*POLL_INTERVAL)
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "config": config,
            "stage": stage,
            "source": source,
            "examples": inputs.get("examples"),
            "rows": rows,
            "total_steps": total_steps,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.num_workers,
            use_gpu=config.use_gpu,
            resources_per_worker={"CPU": config.cpus_per_worker, **({"GPU": 1} if config.use_gpu else {})},
        ),
        datasets=inputs.get("datasets"),
        run_config=ray.train.RunConfig(
            name=stage,
            storage_path=str(config.run_dir),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.keep_checkpoints),
            failure_config=ray.train.FailureConfig(max_failures=config.max_failures),
            callbacks=[ProgressLog(stage, total_steps, stage_dir / "metrics.jsonl")],
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # our line per step is enough
        ),
    )
    result = trainer.fit()
    final = stage_dir / "final"
    if config.lora is None:
        folders.publish(final, lambda folder: _checkpoint_files(result.checkpoint, folder))
        return final
    adapter = final.with_name(final.name + lora.ADAPTER_SUFFIX)
    folders.publish(adapter, lambda folder: _checkpoint_files(result.checkpoint, folder))
    block_size = config.block_size if stage == "mars" else None
    folders.publish(final, lambda folder: lora.export(adapter, source, folder, block_size))
    return final


def worker_runtime_env() -> dict:
    """The runtime env of the training driver's Ray job: Ray's own jemalloc preloaded in every worker.

    Under glibc malloc the training worker's heap fragments step after step on a CPU: its resident memory
    grows and each step slows (BENCHMARKS.md, "jemalloc in the training workers"). Ray bundles jemalloc for
    its own daemons; a user's LD_PRELOAD is left alone.
    """
    jemalloc = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    if os.environ.get("LD_PRELOAD") or not jemalloc.is_file():
        return {}
    return {"env_vars": {"LD_PRELOAD": str(jemalloc)}}


def start_ray(config: TrainConfig) -> None:
    """Join the running Ray, or start a local one. Streamed data is read and tokenized by Ray Data tasks
    beside the training workers, so a local cluster then declares a CPU more than the workers take (on a
    small machine they would otherwise hold every CPU, and no read task could ever start)."""
    if ray.is_initialized():
        return
    runtime_env = worker_runtime_env()
    needed = config.num_workers * config.cpus_per_worker + 1
    if config.streaming and (os.cpu_count() or 1) < needed:
        try:
            ray.init(num_cpus=needed, runtime_env=runtime_env)
            return
        except ValueError:  # Ray refuses num_cpus when it joins a running cluster, which has its own CPUs
            pass
    ray.init(runtime_env=runtime_env)


def run_training(config: TrainConfig) -> dict[Stage, Path]:
    """Run the configured stages in order, each starting from the previous one's result; their final folders.

    Everything that can be wrong with the config or data fails here, before Ray starts a worker.
    """
    source = models.resolve(config.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    if config.lora is not None:
        lora.check_targets(source, config.lora)
    if config.streaming:
        start_ray(config)
        train_data, rows = stream.plan(config, source)
        check_rerun(config)
        inputs = {"datasets": {"train": train_data}}
        print(f"{rows} rows streamed from {len(config.datasets)} sources (report: data_report.json)")
    else:
        examples, reports = prepare_data(config, tokenizer)
        check_rerun(config)
        (config.run_dir / "data_report.json").write_text(json.dumps([r.to_dict() for r in reports], indent=2))
        for report in reports:
            print(f"data {report.summary()}")
        start_ray(config)
        inputs, rows = {"examples": ray.put(examples)}, len(examples)
    total_steps = config.total_steps(rows)
    print(f"{rows} examples, {total_steps} steps per stage of {config.global_batch} examples")
    finals: dict[Stage, Path] = {}
    for stage in config.stages:
        final = config.run_dir / stage / "final"
        if (final / "config.json").exists():
            print(f"[{stage}] already finished: {final}")
        else:
            final = fit_stage(config, stage, source, inputs, rows, total_steps)
            print(f"[{stage}] finished: {final}")
        finals[stage] = final
        source = str(final)
    return finals
